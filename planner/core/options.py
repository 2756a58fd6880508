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
from dataclasses import dataclass, replace

from planner.core.errors import InputError, check_max_stages, check_time_limit
from planner.core.offload import HOST_LINKS, OffloadSpec

__all__ = ["PlanOptions", "check_budget_gb", "check_budget_choice", "check_offload_device", "MAX_PLAUSIBLE_BUDGET_GB"]

#: A budget above this many GiB is taken for a unit mistake (MiB or bytes passed as GiB): no
#: single accelerator holds a terabyte.
MAX_PLAUSIBLE_BUDGET_GB = 1024.0

GIB = 2**30


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


@dataclass(frozen=True)
class PlanOptions:
    """The planning options of :func:`planner.pipeline.optimize` (its docstring says what each
    does), checked when made, so a bad one fails before any profiling.

    ``reserve_gb``: room kept outside the plan; ``safety_margin``: share of the rest kept free;
    ``max_stages``, ``solver``, ``time_limit_s``, ``selective``, ``exact``, ``max_solve_s``: see
    :func:`planner.solvers.solve.solve`; ``world_size``: ranks the parameters are sharded over.
    ``offload``: held outputs may also go to pinned host memory (:mod:`planner.solvers.offload`),
    over ``host_link``'s bandwidths (:data:`planner.core.offload.HOST_LINKS`) or
    ``host_bandwidth_gbps`` both ways, with at most ``pinned_host_gb`` GiB pinned.

    Example:
        >>> PlanOptions(offload=True, host_bandwidth_gbps=25).offload_spec().d2h_gbps
        25.0
        >>> PlanOptions(offload=True, pinned_host_gb=8).offload_spec().pinned_host_bytes == 8 * 2**30
        True
    """

    reserve_gb: float = 0.0
    safety_margin: float = 0.01
    max_stages: int = 32
    solver: str | None = None
    time_limit_s: float = 60.0
    selective: bool = False
    world_size: int = 1
    exact: bool | None = None
    max_solve_s: float | None = None
    offload: bool = False
    host_link: str = "h100"
    host_bandwidth_gbps: float | None = None
    pinned_host_gb: float | None = None

    def __post_init__(self) -> None:
        if self.reserve_gb:
            check_budget_gb(self.reserve_gb, "reserve_gb")
        if isinstance(self.safety_margin, bool) or not isinstance(self.safety_margin, (int, float)) \
                or not 0 <= self.safety_margin < 1:
            raise InputError(f"safety_margin must be in [0, 1), got {self.safety_margin!r}")
        check_max_stages(self.max_stages)
        check_time_limit(self.time_limit_s)
        if self.max_solve_s is not None:
            check_time_limit(self.max_solve_s, "max_solve_s")
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int) or self.world_size < 1:
            raise InputError(f"world_size must be a positive integer, got {self.world_size!r}")
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
        """The host link the offload start prices copies with."""
        spec = HOST_LINKS[self.host_link]
        if self.host_bandwidth_gbps is not None:
            spec = replace(spec, h2d_gbps=float(self.host_bandwidth_gbps), d2h_gbps=float(self.host_bandwidth_gbps))
        if self.pinned_host_gb is not None:
            spec = replace(spec, pinned_host_bytes=int(self.pinned_host_gb * GIB))
        return spec

    @property
    def reserve_bytes(self) -> int:
        return check_budget_gb(self.reserve_gb, "reserve_gb") if self.reserve_gb else 0


def check_offload_device(offload: bool, device_type: str) -> None:
    """Refuse ``offload=True`` in :func:`planner.pipeline.optimize`: on CPU because copies to host
    memory pay off only behind GPU compute; on CUDA until the GPU check has measured offload
    plans (docs/benchmarks/offload.md is predicted). Plan one on a profile with
    :func:`planner.solvers.offload.offload_plan` and apply it to the captured graph with
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
    raise InputError("offload=True waits for a measurement on a GPU, so optimize refuses it: plan with "
                     "planner.solvers.offload.offload_plan and apply with rewrite.offload.apply_offload "
                     "(docs/design.md#offload), or leave offload off")
