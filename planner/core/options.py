"""How to plan, whatever the budget: one object from ``optimize`` and the CLI to the solver.

Example:
    >>> PlanOptions(selective=True).max_stages
    32
    >>> PlanOptions(max_stages=0)
    Traceback (most recent call last):
    ...
    planner.core.errors.InputError: max_stages must be a positive integer (32 by default), got 0
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from typing import Any

from planner.core.errors import InputError, check_max_stages, check_time_limit
from planner.core.offload import HOST_LINKS, OffloadSpec
from planner.core.units import GIB

__all__ = ["SolveOptions", "PlanOptions", "with_overrides", "FINER_PASS_S", "FINER_PASS_ROUNDS",
           "EXACT_SEARCH_S", "check_budget_gb", "check_budget_choice", "check_offload_device",
           "MAX_PLAUSIBLE_BUDGET_GB", "TRACE_METHODS", "COMPILE_BACKEND", "option"]

#: The ways :func:`profiling.trace.trace_module` captures a forward as one graph.
TRACE_METHODS = ("export", "symbolic_trace")
#: The backend ``optimize(compile=True)`` compiles with: ``torch.compile``'s default.
COMPILE_BACKEND = "inductor"

#: A budget above this many GiB is taken for a unit mistake (MiB or bytes passed as GiB): no
#: single accelerator holds a terabyte.
MAX_PLAUSIBLE_BUDGET_GB = 1024.0


def check_budget_gb(budget_gb: float, name: str = "budget_gb") -> int:
    """``budget_gb`` in bytes, or :class:`InputError` for a value that cannot be a budget in GiB.

    Example:
        >>> check_budget_gb(0.5)
        536870912
        >>> check_budget_gb("0.5")
        Traceback (most recent call last):
        ...
        planner.core.errors.InputError: budget_gb must be a number of GiB, got the string '0.5': pass budget_gb=0.5 (a float, not a str)
    """
    if isinstance(budget_gb, str):
        try:
            value = float(budget_gb)
        except ValueError:
            value = None
        fix = (f"pass {name}={value:g} (a float, not a str)" if value is not None and math.isfinite(value)
               and value > 0 else f"pass a float, e.g. {name}=6 for 6 GiB")
        raise InputError(f"{name} must be a number of GiB, got the string {budget_gb!r}: {fix}")
    if isinstance(budget_gb, bool) or not isinstance(budget_gb, (int, float)):
        raise InputError(f"{name} must be a number of GiB, got {type(budget_gb).__name__}")
    if not math.isfinite(budget_gb) or budget_gb <= 0:
        raise InputError(f"{name} must be a positive finite number of GiB, got {budget_gb}")
    if budget_gb > MAX_PLAUSIBLE_BUDGET_GB:
        raise InputError(
            f"{name}={budget_gb:g} looks like the wrong unit: it is in GiB (2**30 bytes), and no single "
            f"device has more than {MAX_PLAUSIBLE_BUDGET_GB:g} GiB; for {budget_gb:g} MiB pass "
            f"{name}={budget_gb / 1024:.4g}"
        )
    return int(budget_gb * GIB)


def check_budget_choice(budget_gb: float | None, budget_fraction: float | None) -> None:
    """Raise :class:`InputError` unless exactly one of ``budget_gb`` (GiB) and
    ``budget_fraction`` (a share in (0, 1] of the measured unoptimized peak) is given, and valid.

    Example:
        >>> check_budget_choice(None, 0.6)
        >>> check_budget_choice(1.0, 0.6)
        Traceback (most recent call last):
        ...
        planner.core.errors.InputError: pass budget_gb or budget_fraction, not both
    """
    if budget_gb is not None and budget_fraction is not None:
        raise InputError("pass budget_gb or budget_fraction, not both")
    if budget_gb is None and budget_fraction is None:
        raise InputError("pass budget_gb (GiB) or budget_fraction (a share of the measured unoptimized peak)")
    if budget_gb is not None:
        check_budget_gb(budget_gb)
    if budget_fraction is not None:
        if isinstance(budget_fraction, bool) or not isinstance(budget_fraction, (int, float)) \
                or not math.isfinite(budget_fraction) or not 0 < budget_fraction <= 1:
            raise InputError(f"budget_fraction must be a number in (0, 1], got {budget_fraction!r}")


#: Seconds the finer rounds of one start may take (docs/tuning.md#finer_pass_s).
FINER_PASS_S = 20.0
#: Most times the stages are doubled after the first plan (docs/tuning.md#finer_pass_rounds).
FINER_PASS_ROUNDS = 2
#: Seconds the exact search may take when it runs by default (docs/tuning.md#exact_search_s).
EXACT_SEARCH_S = 30.0


def option(default: object, help: str) -> Any:
    """A dataclass field with its default and its one-line ``help``, read by the front doors
    (the CLI makes a flag of it, :mod:`planner.cli_options`).

    Example:
        >>> from dataclasses import dataclass, fields
        >>> @dataclass(frozen=True)
        ... class Knobs:
        ...     depth: int = option(3, "how deep")
        >>> Knobs().depth, fields(Knobs)[0].metadata["help"]
        (3, 'how deep')
    """
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class SolveOptions:
    """How :func:`planner.solvers.solve.solve` searches: each field's default and one-line help
    are declared here once, checked when made. docs/design.md#how-the-planner-decides says what
    each part of the search does. ``offload``: held outputs may also go to pinned host memory
    (the solve's offload step, :mod:`planner.solvers.starts.offload`), copies priced over
    ``host_link``'s bandwidths (:data:`planner.core.offload.HOST_LINKS`) or
    ``host_bandwidth_gbps`` both ways, with at most ``pinned_host_gb`` GiB pinned
    (:meth:`offload_spec`).

    Example:
        >>> SolveOptions().finer_rounds, SolveOptions(exact=True).exact
        (2, True)
        >>> SolveOptions(offload=True, host_bandwidth_gbps=25).offload_spec().d2h_gbps
        25.0
        >>> SolveOptions(offload=True, pinned_host_gb=8).offload_spec().pinned_host_bytes == 8 * 2**30
        True
        >>> SolveOptions(refine_s=-1)
        Traceback (most recent call last):
        ...
        planner.core.errors.InputError: refine_s must be 0 or more seconds, got -1
    """

    max_stages: int = option(32, "stages the graph is reduced to for the first plan; more search finer, slower")
    solver: str | None = option(None, "solve every stage model as an ILP with this solver (HiGHS, CBC); "
                                       "default: the chain DP")
    time_limit_s: float = option(60.0, "seconds each ILP may take")
    max_attempts: int = option(8, "times a stage model's target is lowered until its plan's replay fits")
    selective: bool = option(False, "also keep single outputs inside recomputed segments (selective policy)")
    refine_s: float = option(2.0, "seconds of local moves judged by the simulator (0: none)")
    polish: bool = option(False, "also run those moves on a plan the stage models found")
    exact: bool | None = option(None, "prove the plan the cheapest over its stages or find a cheaper one (slower "
                                      "on large graphs; by default it runs under 64 compute nodes, and under 512 "
                                      "where the first plan leaves over 1 % of the budget unused)")
    finer_s: float = option(FINER_PASS_S, "seconds the finer rounds of one start may take (0: none)")
    exact_s: float = option(EXACT_SEARCH_S, "seconds the exact search may take when it runs by default")
    finer_rounds: int = option(FINER_PASS_ROUNDS, "times the stages are doubled after a plan (0: none)")
    short_segments: bool = option(True, "start also from short segments on many stages (deep graphs)")
    max_solve_s: float | None = option(None, "stop improving each plan after this many seconds of solving and use "
                                             "the cheapest found by then (the first plan runs to its own limit); "
                                             "default: no bound, so plans do not depend on the machine's speed")
    offload: bool = option(False, "held outputs may also go to pinned host memory (CUDA; predicted only)")
    host_link: str = option("h100", "the host link whose bandwidths price the copies (planner.core.offload.HOST_LINKS)")
    host_bandwidth_gbps: float | None = option(None, "host link bandwidth both ways in GB/s, instead of host_link's")
    pinned_host_gb: float | None = option(None, "most GiB of pinned host memory the copies may hold")

    def __post_init__(self) -> None:
        check_max_stages(self.max_stages)
        check_time_limit(self.time_limit_s)
        check_time_limit(self.exact_s, "exact_s")
        if self.max_solve_s is not None:
            check_time_limit(self.max_solve_s, "max_solve_s")
        for name in ("refine_s", "finer_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise InputError(f"{name} must be 0 or more seconds, got {value!r}")
        for name, least in (("finer_rounds", 0), ("max_attempts", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise InputError(f"{name} must be an integer of at least {least}, got {value!r}")
        if not isinstance(self.offload, bool):
            raise InputError(f"offload must be True or False, got {self.offload!r}")
        if self.host_link not in HOST_LINKS:
            raise InputError(f"host_link must be one of {sorted(HOST_LINKS)}, got {self.host_link!r}")
        for name in ("host_bandwidth_gbps", "pinned_host_gb"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not math.isfinite(value) or value <= 0):
                raise InputError(f"{name} must be a positive number, got {value!r}")

    def offload_spec(self) -> OffloadSpec:
        """The host link the offload step prices copies with: ``host_link``'s, with
        ``host_bandwidth_gbps`` and ``pinned_host_gb`` in its place where given."""
        spec = HOST_LINKS[self.host_link]
        if self.host_bandwidth_gbps is not None:
            spec = replace(spec, h2d_gbps=float(self.host_bandwidth_gbps), d2h_gbps=float(self.host_bandwidth_gbps))
        if self.pinned_host_gb is not None:
            spec = replace(spec, pinned_host_bytes=int(self.pinned_host_gb * GIB))
        return spec

    def solve_options(self) -> SolveOptions:
        """Only the fields of :class:`SolveOptions` (a :class:`PlanOptions` carries more)."""
        return SolveOptions(**{f.name: getattr(self, f.name) for f in fields(SolveOptions)})


def with_overrides(options: SolveOptions | None, overrides: dict[str, Any]) -> SolveOptions:
    """``options`` (default: :class:`SolveOptions`'s defaults) with ``overrides`` by field name;
    an unknown name is an :class:`InputError` naming the fields.

    Example:
        >>> with_overrides(None, {"max_stages": 8}).max_stages
        8
    """
    base = options if options is not None else SolveOptions()
    unknown = sorted(set(overrides) - {f.name for f in fields(base)})
    if unknown:
        raise InputError(f"unknown solve option(s) {', '.join(unknown)}: the fields of {type(base).__name__} are "
                         f"{', '.join(f.name for f in fields(base))}")
    return replace(base, **overrides) if overrides else base


@dataclass(frozen=True)
class PlanOptions(SolveOptions):
    """The planning options of :func:`planner.pipeline.optimize`: how to solve
    (:class:`SolveOptions`, offload to host memory included) and what room to keep, checked when
    made, so a bad one fails before any profiling.

    Example:
        >>> PlanOptions(reserve_gb=1).reserve_bytes == 2**30
        True
        >>> PlanOptions(offload=True).solve_options().offload
        True
    """

    reserve_gb: float = option(0.0, "GiB kept outside the plan (optimizer state, other tensors)")
    safety_margin: float = option(0.01, "share of the rest of the budget kept free")
    world_size: int = option(1, "ranks the parameters and their gradients are sharded over (FSDP/ZeRO-3)")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.reserve_gb:
            check_budget_gb(self.reserve_gb, "reserve_gb")
        if isinstance(self.safety_margin, bool) or not isinstance(self.safety_margin, (int, float)) \
                or not 0 <= self.safety_margin < 1:
            raise InputError(f"safety_margin must be in [0, 1), got {self.safety_margin!r}")
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int) or self.world_size < 1:
            raise InputError(f"world_size must be a positive integer, got {self.world_size!r}")

    @property
    def reserve_bytes(self) -> int:
        return check_budget_gb(self.reserve_gb, "reserve_gb") if self.reserve_gb else 0


def check_offload_device(offload: bool, device_type: str) -> None:
    """Refuse ``offload=True`` in :func:`planner.pipeline.optimize`: on CPU because copies to host
    memory pay off only behind GPU compute; on CUDA until the GPU check has measured offload
    plans (docs/benchmarks/offload.md is predicted). Predict one with ``ckpt-planner report
    --offload`` or plan one on a profile with ``solve(graph, budget_bytes, offload=True)``
    (:func:`planner.solvers.solve.solve`), and apply it to the captured graph with
    :func:`rewrite.offload.apply_offload` before :func:`rewrite.apply.apply_plan`.

    Example:
        >>> check_offload_device(False, "cpu")
        >>> check_offload_device(True, "cpu")
        Traceback (most recent call last):
        ...
        planner.core.errors.InputError: offload=True needs a CUDA device (copies to host memory pay off only behind GPU compute): leave offload off on cpu
    """
    if not offload:
        return
    if device_type != "cuda":
        raise InputError(f"offload=True needs a CUDA device (copies to host memory pay off only behind GPU "
                         f"compute): leave offload off on {device_type}")
    raise InputError("offload=True waits for a measurement on a GPU, so optimize refuses it: predict it with "
                     "`ckpt-planner report --offload`, or plan with planner.solvers.solve.solve(..., offload=True) "
                     "and apply with rewrite.offload.apply_offload (docs/design.md#offload), or leave offload off")
