"""``optimize``: trace, profile, plan and rewrite in one call. The only module here that needs torch.

Example:
    >>> import torch
    >>> from planner import optimize
    >>> model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh())
    ...                               for _ in range(8)])
    >>> x = torch.randn(512, 64)
    >>> opt = optimize(model, (x,), budget_gb=1.0)   # roomy budget: nothing recomputed
    >>> opt.plan.recomputed_nodes
    ()
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

from planner.errors import InfeasibleBudgetError, InputError, PlannerError
from planner.costgraph import (
    CostGraph,
    Storage,
    hold_parameter_grads,
    protect_reads_before_writes,
    shard_parameters,
)
from planner.plan import GIB, Plan
from planner.solve import check_max_stages, check_time_limit, solve

__all__ = ["optimize", "plan_for_budget"]

log = logging.getLogger(__name__)


#: A budget above this many GiB is taken for a unit mistake (MiB or bytes passed as GiB): no
#: single accelerator holds a terabyte.
MAX_PLAUSIBLE_BUDGET_GB = 1024.0


def _budget_bytes(budget_gb: float, name: str = "budget_gb") -> int:
    """``budget_gb`` in bytes, or :class:`InputError` for a value that cannot be a budget in GiB."""
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


def _budget_planning_at_least(planning_bytes: int, reserve_bytes: int, safety_margin: float) -> int:
    """The smallest budget in bytes whose planning room (``plan_for_budget``'s arithmetic,
    floats included) is at least ``planning_bytes``."""
    budget = math.ceil(planning_bytes / (1 - safety_margin)) + reserve_bytes
    while int((budget - reserve_bytes) * (1 - safety_margin)) < planning_bytes:
        budget += 1
    while budget > reserve_bytes + 1 and int((budget - 1 - reserve_bytes) * (1 - safety_margin)) >= planning_bytes:
        budget -= 1
    return budget


def plan_for_budget(
    graph: CostGraph,
    budget_gb: float,
    *,
    reserve_gb: float = 0.0,
    safety_margin: float = 0.01,
    max_stages: int = 32,
    solver: str | None = None,
    time_limit_s: float = 60.0,
    selective: bool = False,
    world_size: int = 1,
    grads_held: bool = False,
    exact: bool | None = None,
    max_solve_s: float | None = None,
) -> Plan:
    """Solve ``graph`` for a budget in GiB, keeping ``reserve_gb`` and a ``safety_margin`` free.

    The returned plan's ``budget_bytes`` is the user's budget; its predicted peak stays under
    ``(budget - reserve) * (1 - safety_margin)``. An infeasible budget raises
    :class:`InfeasibleBudgetError` naming the smallest ``budget_gb`` (in bytes) that works.

    ``world_size`` > 1 plans the per-rank step with parameters and their gradients sharded over
    that many ranks (FSDP / ZeRO-3, see :func:`planner.costgraph.shard_parameters`);
    ``grads_held`` plans a step that starts with every ``.grad`` allocated (gradient accumulation).
    ``exact`` and ``max_solve_s``: see :func:`planner.solve.solve`.

    Example:
        >>> from planner.costgraph import CostGraph, CostNode, Storage
        >>> g = CostGraph((CostNode("x", "placeholder", kind="input", output_storages=(0,)),),
        ...               (Storage(0, 2**20, True),))
        >>> plan_for_budget(g, 1.0).segments
        ()
    """
    budget_bytes = _budget_bytes(budget_gb)
    reserve_bytes = _budget_bytes(reserve_gb, "reserve_gb") if reserve_gb else 0
    if budget_bytes <= reserve_bytes:
        raise InputError(f"reserve_gb={reserve_gb} leaves no room inside budget_gb={budget_gb}")
    if not 0 <= safety_margin < 1:
        raise InputError(f"safety_margin must be in [0, 1), got {safety_margin}")
    planning_bytes = int((budget_bytes - reserve_bytes) * (1 - safety_margin))
    # set by the profiler from the captured graph: transformations the user asked for by name
    changes = tuple(graph.metadata.get("computation_changes", ()))
    try:
        graph = shard_parameters(graph, world_size)
    except ValueError as exc:
        raise PlannerError(str(exc)) from None
    if grads_held:
        graph = hold_parameter_grads(graph)
    graph = protect_reads_before_writes(graph)
    try:
        plan = solve(graph, planning_bytes, max_stages=max_stages, solver=solver, time_limit_s=time_limit_s,
                     selective=selective, exact=exact, max_solve_s=max_solve_s)
    except InfeasibleBudgetError as exc:
        raise InfeasibleBudgetError(budget_bytes, _budget_planning_at_least(
            exc.min_feasible_bytes, reserve_bytes, safety_margin)) from None
    return dataclasses.replace(plan, budget_bytes=budget_bytes, computation_changes=changes)


def optimize(
    model: Any,
    example_inputs: Any,
    budget_gb: float,
    *,
    reserve_gb: float = 0.0,
    trace_method: str = "export",
    max_stages: int = 32,
    solver: str | None = None,
    time_limit_s: float = 60.0,
    timing_repeats: int = 3,
    safety_margin: float = 0.01,
    selective: bool = False,
    world_size: int = 1,
    cache_dir: str | None = None,
    progress: bool = False,
    exact: bool | None = None,
    max_solve_s: float | None = None,
    simplify_attention_masks: bool = False,
) -> Any:
    """Return a drop-in replacement for ``model`` whose training step fits in ``budget_gb``.

    Args:
        model: an ``nn.Module`` in training mode.
        example_inputs: a tuple of positional arguments, or a dict of keyword arguments, shaped
            like a real batch.
        budget_gb: peak training-step memory allowed, in GiB (2**30 bytes): parameters, buffers,
            inputs, activations, gradients and temporaries of one forward plus backward.
        reserve_gb: room set aside inside the budget (e.g. for optimizer state).
        trace_method: ``"export"`` (default) or ``"symbolic_trace"``.
        max_stages: how many stages the graph is reduced to before the ILP.
        solver: None (default): segments-only stage models are solved exactly by dynamic
            programming over the stage chain, the rest (selective plans, the smallest peak) by
            the best installed MILP solver; ``"HiGHS"`` or ``"CBC"``: that MILP solver for all.
        time_limit_s: solver time limit per ILP solve (a plan takes several).
        timing_repeats: warm training steps each node is timed in (after one untimed step);
            the median is used (:mod:`profiling.node_times`).
        safety_margin: fraction of the budget kept free for what the memory model does not see
            (allocator rounding, small temporaries); the plan's predicted peak stays below
            ``budget * (1 - safety_margin)``.
        selective: after choosing segments, decide node by node which outputs inside them
            are kept from the forward (a selective checkpoint policy) instead of recomputed,
            by measured time per byte held (:mod:`planner.keep`), in segments where keeping
            saves more than the policy's own per-node cost (measured by the profiler). Fewer
            recomputed FLOPs; slower to plan (a second ILP for the smallest-peak segments); see
            docs/benchmarks/selective_cost.md for what it measured.
        world_size: plan the per-rank peak with parameters and their gradients sharded over this
            many ranks (FSDP / ZeRO-3 sharding); 1 (default) for one process or DDP.
        cache_dir: a folder for profiles (JSON, keyed by a fingerprint of the graph, input shapes,
            torch version and target): another budget for the same model skips profiling.
        progress: draw a tqdm bar while profiling (when tqdm is installed); progress of
            profiling and solving is logged at INFO either way.
        exact: after the ILP, search an optimistic memory account checked against the simulator
            until it proves the plan the cheapest over the stages or finds a cheaper one
            (:mod:`planner.relaxation`). None (default): on graphs of fewer than 64 compute
            nodes, where it is fast, and on graphs under 512 where the ILP's plan leaves more
            than 1 % of the budget unused (up to 30 s; 14 to 22 % less recompute on the quality
            models where it ran); True: always, which on a real model whose ILP plan fills the
            budget costs up to 2x the solve time and rarely finds a cheaper plan (docs/benchmarks/exact_search.md).
        max_solve_s: stop improving the plan after this many seconds of solving and return the
            cheapest found by then (``plan.hit_time_limit`` says it was cut). The first ILP, and
            the search for the smallest budget when none fits, still run to ``time_limit_s``.
            None (default): no bound, so plans do not depend on the machine's speed. The
            chain DP (default ``solver``) makes segments-only solves fast; the bound matters most
            for ``selective=True`` and named MILP solvers (docs/benchmarks/solve_time.md).
        simplify_attention_masks: pass ``is_causal`` (or no mask) to attention calls whose
            mask is a constant causal or all-visible mask, where the eager model passes the
            mask: a faster kernel with other rounding and, with attention dropout, another random
            stream, so the module no longer computes exactly what ``model`` computes (opt-in;
            ``plan.computation_changes`` says so). Default: every call as the eager model makes it.

    Returns:
        An ``nn.Module`` called like ``model``, returning the same output structure, sharing its
        parameters and ``state_dict()`` keys, with ``.plan`` (a :class:`planner.Plan`). Inputs
        of another shape, under another autocast state or with gradients already accumulated
        are re-planned for the same budget on first use (one INFO log line each, then cached).

    Raises:
        InputError: a budget that is not a positive number of GiB or looks like another unit; a
            model in eval mode, on the meta device or with nothing to train; inputs that do not
            fit ``model.forward`` or sit on another device.
        InfeasibleBudgetError: no plan fits; the message names the smallest feasible budget.
        TraceError: the model could not be captured (names the submodule and source line).
        SolverError: no MILP solver is installed, or none found a plan within ``time_limit_s``.
    """
    from profiling.validate import check_model_and_inputs
    from rewrite.apply import CheckpointedModule

    # fail on a bad budget, model or inputs before the slow work
    _budget_bytes(budget_gb)
    if reserve_gb:
        _budget_bytes(reserve_gb, "reserve_gb")
    check_time_limit(time_limit_s)
    check_max_stages(max_stages)
    if max_solve_s is not None:
        check_time_limit(max_solve_s, "max_solve_s")
    check_model_and_inputs(model, example_inputs)
    replan = Replanner(budget_gb, reserve_gb, trace_method, max_stages, solver, time_limit_s, timing_repeats,
                       safety_margin, selective, world_size, cache_dir, progress, exact, max_solve_s,
                       simplify_attention_masks)
    gm, plan, graph = replan(model, example_inputs)
    return CheckpointedModule(gm, model, plan, cost_graph=graph, example_inputs=example_inputs, replan=replan)


@dataclasses.dataclass(frozen=True)
class Replanner:
    """Trace, profile, plan and rewrite ``model`` for some inputs with fixed options: what
    ``optimize`` runs once, and what the module it returns runs again for inputs it was not
    planned for. ``graph`` (a profile of the same shapes) skips tracing's profile step.

    Example:
        >>> import torch
        >>> replan = Replanner(budget_gb=1.0)
        >>> gm, plan, graph = replan(torch.nn.Linear(4, 4), (torch.randn(2, 4),))
        >>> plan.segments
        ()
    """

    budget_gb: float
    reserve_gb: float = 0.0
    trace_method: str = "export"
    max_stages: int = 32
    solver: str | None = None
    time_limit_s: float = 60.0
    timing_repeats: int = 3
    safety_margin: float = 0.01
    selective: bool = False
    world_size: int = 1
    cache_dir: str | None = None
    progress: bool = False
    exact: bool | None = None
    max_solve_s: float | None = None
    simplify_attention_masks: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int) or self.world_size < 1:
            raise PlannerError(f"world_size must be a positive integer, got {self.world_size!r}")

    def __call__(self, model: Any, example_inputs: Any, graph: CostGraph | None = None,
                 grads_held: bool = False) -> tuple[Any, Plan, CostGraph]:
        from profiling.cache import cached_profile_graph
        from profiling.progress import heartbeat
        from profiling.trace import trace_module
        from rewrite.apply import apply_plan

        gm = trace_module(model, example_inputs, method=self.trace_method,
                          simplify_attention_masks=self.simplify_attention_masks)
        if graph is None:
            graph = cached_profile_graph(gm, example_inputs, self.cache_dir, timing_repeats=self.timing_repeats,
                                         progress=self.progress)
        with heartbeat(f"solving for {self.budget_gb:.4g} GiB ({len(graph.nodes)} nodes)"):
            plan = plan_for_budget(graph, self.budget_gb, reserve_gb=self.reserve_gb,
                                   safety_margin=self.safety_margin, max_stages=self.max_stages, solver=self.solver,
                                   time_limit_s=self.time_limit_s, selective=self.selective,
                                   world_size=self.world_size, grads_held=grads_held, exact=self.exact,
                                   max_solve_s=self.max_solve_s)
        log.info("plan: predicted peak %.3f GiB of %.3f GiB budget, %d segments",
                 plan.predicted_peak_bytes / GIB, plan.budget_bytes / GIB, len(plan.segments))
        return apply_plan(gm, plan), plan, graph

    def solve(self, graph: CostGraph, grads_held: bool = False, keep: frozenset[str] = frozenset(),
              extra_bytes: int = 0) -> Plan:
        """Plan ``graph`` again with these options, recomputing none of the nodes in ``keep`` and
        holding ``extra_bytes`` more all step (no tracing or profiling: safe under
        ``torch.distributed``)."""
        if keep:
            graph = dataclasses.replace(graph, nodes=tuple(
                dataclasses.replace(n, recomputable=False) if n.name in keep else n for n in graph.nodes))
        if extra_bytes > 0:
            key = max((st.key for st in graph.storages), default=-1) + 1
            graph = dataclasses.replace(graph, storages=(*graph.storages, Storage(key, int(extra_bytes), True)),
                                        measured_peak_bytes=None)
        return plan_for_budget(graph, self.budget_gb, reserve_gb=self.reserve_gb, safety_margin=self.safety_margin,
                               max_stages=self.max_stages, solver=self.solver, time_limit_s=self.time_limit_s,
                               selective=self.selective, world_size=self.world_size, grads_held=grads_held,
                               exact=self.exact, max_solve_s=self.max_solve_s)
