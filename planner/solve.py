"""Choose the segments to recompute: an integer linear program over a chain of stages.

The graph is first reduced to stages (:mod:`planner.stages`). A binary variable ``y[a, b]``
says that stages ``a..b`` run as one checkpointed segment. The ILP minimises the forward time
of everything recomputed subject to a linear account of memory at every stage, in the forward
(activations stored so far) and in the backward (stored activations of earlier stages, the
segment being recomputed, parameter gradients accumulated so far, gradients in flight).

The linear account is an approximation; :func:`planner.simulate.simulate` is the judge. Each
solution is replayed there, and when its simulated peak exceeds the budget the ILP is solved
again with the budget lowered by the excess. A plan is returned only when its simulated peak
is within the budget; otherwise :class:`InfeasibleBudgetError` names the smallest peak found.

Example:
    >>> from planner.costgraph import CostGraph, CostNode, Storage
    >>> nodes = [CostNode("x", "placeholder", kind="input", output_storages=(0,))]
    >>> for i in range(1, 9):
    ...     nodes.append(CostNode(f"n{i}", "relu", input_names=(nodes[-1].name,),
    ...                           output_storages=(i,), saved_storages=(i,), output_bytes=2**20,
    ...                           requires_grad=True, time_ms=1.0))
    >>> g = CostGraph(tuple(nodes), tuple(Storage(i, 2**20, i == 0) for i in range(9)), ("n8",))
    >>> plan = solve(g, budget_bytes=9 * 2**20)
    >>> plan.predicted_peak_bytes <= 9 * 2**20 < simulate(g).peak_bytes
    True
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import pulp

from planner.costgraph import CostGraph
from planner.errors import InfeasibleBudgetError, SolverError
from planner.plan import Plan, Segment
from planner.simulate import simulate
from planner.stages import Stage, build_stages

__all__ = ["solve", "minimum_peak_plan", "available_solvers"]

log = logging.getLogger(__name__)

MIB = float(2**20)
_ACCEPTED = (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible)


@dataclass(frozen=True)
class _StageModel:
    """Per-stage numbers of the linear memory account, in MiB, and recompute times in ms."""

    stages: list[Stage]
    persistent: float
    returned: float
    saved: list[float]
    param_grads: list[float]
    grads_in_flight: list[float]
    forward_transient: list[float]
    time_ms: list[float]
    flops: list[int]
    segment_inputs: dict[tuple[int, int], float]


def available_solvers() -> list[str]:
    """Names of the MILP solvers PuLP can run here, best first."""
    names = []
    if pulp.HiGHS(msg=False).available():
        names.append("HiGHS")
    if pulp.PULP_CBC_CMD(msg=False).available():
        names.append("CBC")
    return names


def _make_solver(name: str | None, time_limit_s: float) -> tuple[str, pulp.LpSolver]:
    names = available_solvers()
    if not names:
        raise SolverError("no MILP solver is available: pip install highspy (or a PuLP with CBC)")
    chosen = name or names[0]
    if chosen not in names:
        raise SolverError(f"solver {chosen!r} is not available here; available: {names}")
    if chosen == "HiGHS":
        return chosen, pulp.HiGHS(msg=False, timeLimit=time_limit_s, threads=1)
    return chosen, pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit_s)


def _stage_model(graph: CostGraph, stages: list[Stage], max_segment_stages: int) -> _StageModel:
    sizes = graph.storage_by_key
    persistent_keys = {k for k, s in sizes.items() if s.persistent}
    stage_of = {name: j for j, st in enumerate(stages) for name in st.node_names}
    nodes = graph.nodes
    k_count = len(stages)

    saved = [0.0] * k_count
    first_saver: dict[int, int] = {}
    for node in nodes:
        j = stage_of.get(node.name)
        if j is None:
            continue
        for k in node.saved_storages:
            if k not in persistent_keys and k not in first_saver:
                first_saver[k] = j
    for k, j in first_saver.items():
        saved[j] += sizes[k].size_bytes / MIB

    param_last_stage: dict[int, int] = {}
    param_bytes: dict[int, int] = {}
    for node in nodes:
        j = stage_of.get(node.name)
        if j is None:
            continue
        for name in node.input_names:
            src = graph.node(name)
            if src.kind == "param" and src.requires_grad and src.output_storages:
                key = src.output_storages[0]
                param_last_stage[key] = max(param_last_stage.get(key, j), j)
                param_bytes[key] = src.output_bytes
    param_grads = [0.0] * k_count
    for key, j in param_last_stage.items():
        for i in range(j + 1):
            param_grads[i] += param_bytes[key] / MIB

    differentiable = {n.name for n in nodes if n.requires_grad}
    grads = [0.0] * k_count
    transient = [0.0] * k_count
    time_ms = [0.0] * k_count
    flops = [0] * k_count
    for node in nodes:
        j = stage_of.get(node.name)
        if j is None:
            continue
        time_ms[j] += node.time_ms
        flops[j] += node.flops
        if not node.is_alias:
            transient[j] = max(transient[j], node.output_bytes / MIB)
        if node.requires_grad:
            inputs = sum(graph.node(n).output_bytes for n in set(node.input_names) if n in differentiable)
            grads[j] = max(grads[j], (node.output_bytes + inputs) / MIB)

    producer_stage: dict[int, int] = {}
    readers: list[set[int]] = [set() for _ in stages]
    for node in nodes:
        j = stage_of.get(node.name)
        if j is None:
            continue
        for k in node.output_storages:
            if k not in persistent_keys:
                producer_stage.setdefault(k, j)
        for name in node.input_names:
            readers[j].update(k for k in graph.node(name).output_storages if k not in persistent_keys)
    segment_inputs: dict[tuple[int, int], float] = {}
    for a in range(k_count):
        held: set[int] = set()
        total = 0.0
        for b in range(a, min(k_count, a + max_segment_stages)):
            if not stages[b].recomputable:
                break
            for k in readers[b]:
                if k not in held and producer_stage.get(k, -1) < a:
                    held.add(k)
                    total += sizes[k].size_bytes / MIB
            segment_inputs[(a, b)] = total

    returned = sum(
        sizes[k].size_bytes for k in {k for n in graph.output_names for k in graph.node(n).output_storages}
        if k not in persistent_keys
    ) / MIB
    starts = graph.loss_names or tuple(n for n in graph.output_names if n in differentiable)
    returned += sum(graph.node(n).output_bytes for n in starts) / MIB
    return _StageModel(
        stages=stages,
        persistent=graph.persistent_bytes / MIB,
        returned=returned,
        saved=saved,
        param_grads=param_grads,
        grads_in_flight=grads,
        forward_transient=transient,
        time_ms=time_ms,
        flops=flops,
        segment_inputs=segment_inputs,
    )


def _solve_ilp(
    model: _StageModel,
    budget_mib: float | None,
    solver_name: str | None,
    time_limit_s: float,
) -> tuple[list[tuple[int, int]], str] | None:
    """Solve once. ``budget_mib=None`` minimises the peak instead of the recompute time.

    Returns the chosen ``(first_stage, last_stage)`` segments and the solver name, or None
    when the model is infeasible.
    """
    k_count = len(model.stages)
    segs = list(model.segment_inputs)
    name, solver = _make_solver(solver_name, time_limit_s)
    prob = pulp.LpProblem("checkpoint_plan", pulp.LpMinimize)
    y = {s: pulp.LpVariable(f"y_{s[0]}_{s[1]}", cat="Binary") for s in segs}
    total_ms = sum(model.time_ms) or 1.0
    cost = pulp.lpSum(
        y[(a, b)] * (sum(model.time_ms[a : b + 1]) + 1e-3 * total_ms) for (a, b) in segs
    )
    if budget_mib is None:
        peak = pulp.LpVariable("peak_mib", lowBound=0)
        bound = peak
        prob += peak + 1e-6 * cost / total_ms
    else:
        bound = budget_mib
        prob += cost
    covering: list[list[tuple[int, int]]] = [[] for _ in range(k_count)]
    starting: list[list[tuple[int, int]]] = [[] for _ in range(k_count)]
    for a, b in segs:
        starting[a].append((a, b))
        for j in range(a, b + 1):
            covering[j].append((a, b))
    cov = [pulp.lpSum(y[s] for s in covering[j]) for j in range(k_count)]
    for j in range(k_count):
        if covering[j]:
            prob += cov[j] <= 1, f"one_segment_covers_stage_{j}"
    stored = [
        model.saved[i] * (1 - cov[i]) + pulp.lpSum(model.segment_inputs[s] * y[s] for s in starting[i])
        for i in range(k_count)
    ]
    big_m = (
        model.persistent + model.returned + sum(model.saved) + sum(model.segment_inputs.values())
        + max(model.param_grads, default=0) + max(model.grads_in_flight, default=0)
        + max(model.forward_transient, default=0)
    )
    base = model.persistent + model.returned
    prefix = 0
    for j in range(k_count):
        prefix = prefix + stored[j]
        prob += base + prefix + model.forward_transient[j] <= bound, f"forward_stage_{j}"
    before = [pulp.lpSum(stored[:j]) for j in range(k_count)]
    for j in range(k_count):
        tail = base + model.param_grads[j] + model.grads_in_flight[j]
        prob += (
            tail + before[j] + model.saved[j] <= bound + big_m * cov[j],
            f"backward_stage_{j}_stored",
        )
        for a, b in covering[j]:
            recomputed = sum(model.saved[a : j + 1])
            prob += (
                tail + before[a] + model.segment_inputs[(a, b)] + recomputed
                <= bound + big_m * (1 - y[(a, b)]),
                f"backward_stage_{j}_in_segment_{a}_{b}",
            )
    prob.solve(solver)
    if prob.sol_status not in _ACCEPTED:
        if prob.sol_status == pulp.LpSolutionNoSolutionFound and prob.status != pulp.LpStatusInfeasible:
            raise SolverError(
                f"{name} found no feasible plan within {time_limit_s:.0f} s; raise time_limit_s"
            )
        return None
    if prob.sol_status == pulp.LpSolutionIntegerFeasible:
        log.warning("%s stopped at its time limit; the plan is feasible but may not be optimal", name)
    chosen = [s for s in segs if (y[s].value() or 0) > 0.5]
    return chosen, name


def _to_plan(
    graph: CostGraph,
    model: _StageModel,
    chosen: list[tuple[int, int]],
    budget_bytes: int,
    unoptimized_peak_bytes: int,
    peak_bytes: int,
    solver: str,
    solve_s: float,
) -> Plan:
    segments = []
    for a, b in sorted(chosen):
        names = tuple(n for st in model.stages[a : b + 1] for n in st.node_names)
        segments.append(Segment(names, sum(model.time_ms[a : b + 1]), sum(model.flops[a : b + 1])))
    return Plan(
        budget_bytes=budget_bytes,
        predicted_peak_bytes=peak_bytes,
        unoptimized_peak_bytes=unoptimized_peak_bytes,
        segments=tuple(segments),
        forward_ms=graph.forward_ms,
        step_ms=graph.step_ms,
        forward_flops=graph.forward_flops,
        solver=solver,
        solve_s=solve_s,
        measured_unoptimized_peak_bytes=graph.measured_peak_bytes,
    )


def _segment_names(model: _StageModel, chosen: list[tuple[int, int]]) -> list[tuple[str, ...]]:
    return [tuple(n for st in model.stages[a : b + 1] for n in st.node_names) for a, b in chosen]


def minimum_peak_plan(
    graph: CostGraph,
    *,
    max_stages: int = 32,
    solver: str | None = None,
    time_limit_s: float = 60.0,
) -> Plan:
    """The plan with the smallest peak the ILP finds, whatever it costs.

    Its ``predicted_peak_bytes`` is the smallest budget :func:`solve` accepts.
    """
    started = time.perf_counter()
    stages = build_stages(graph, max_stages)
    model = _stage_model(graph, stages, max_segment_stages=len(stages))
    unoptimized = simulate(graph).peak_bytes
    result = _solve_ilp(model, None, solver, time_limit_s)
    if result is None:  # pragma: no cover - minimising the peak is always feasible
        raise SolverError("the minimum-peak model was reported infeasible")
    chosen, name = result
    peak = simulate(graph, _segment_names(model, chosen)).peak_bytes
    if peak > unoptimized:
        chosen, peak = [], unoptimized
    return _to_plan(graph, model, chosen, peak, unoptimized, peak, name, time.perf_counter() - started)


def solve(
    graph: CostGraph,
    budget_bytes: int,
    *,
    max_stages: int = 32,
    solver: str | None = None,
    time_limit_s: float = 60.0,
    max_attempts: int = 8,
) -> Plan:
    """The least-recompute plan whose simulated peak is at most ``budget_bytes``.

    Raises:
        InfeasibleBudgetError: no plan found fits; the error names the smallest peak reached.
        SolverError: no solver is installed, or it found nothing in ``time_limit_s``.
    """
    if not isinstance(budget_bytes, int) or isinstance(budget_bytes, bool):
        if not (isinstance(budget_bytes, float) and math.isfinite(budget_bytes)):
            raise ValueError(f"budget_bytes must be a finite number, got {budget_bytes!r}")
        budget_bytes = int(budget_bytes)
    if budget_bytes <= 0:
        raise ValueError(f"budget_bytes must be positive, got {budget_bytes}")
    started = time.perf_counter()
    unoptimized = simulate(graph).peak_bytes
    stages = build_stages(graph, max_stages)
    model = _stage_model(graph, stages, max_segment_stages=len(stages))
    if unoptimized <= budget_bytes:
        return _to_plan(graph, model, [], budget_bytes, unoptimized, unoptimized, "none", 0.0)
    target_mib = budget_bytes / MIB
    for attempt in range(max_attempts):
        result = _solve_ilp(model, target_mib, solver, time_limit_s)
        if result is None:
            break
        chosen, name = result
        peak = simulate(graph, _segment_names(model, chosen)).peak_bytes
        log.info("attempt %d: %d segments, simulated peak %.1f MiB (budget %.1f MiB)",
                 attempt, len(chosen), peak / MIB, budget_bytes / MIB)
        if peak <= budget_bytes:
            return _to_plan(graph, model, chosen, budget_bytes, unoptimized, peak, name,
                            time.perf_counter() - started)
        target_mib -= (peak - budget_bytes) / MIB + 0.5
    fallback = minimum_peak_plan(graph, max_stages=max_stages, solver=solver, time_limit_s=time_limit_s)
    if fallback.predicted_peak_bytes <= budget_bytes:
        return _to_plan(graph, model, _stage_ranges(model, fallback), budget_bytes, unoptimized,
                        fallback.predicted_peak_bytes, fallback.solver, time.perf_counter() - started)
    raise InfeasibleBudgetError(budget_bytes, fallback.predicted_peak_bytes)


def _stage_ranges(model: _StageModel, plan: Plan) -> list[tuple[int, int]]:
    first = {st.node_names[0]: j for j, st in enumerate(model.stages)}
    last = {st.node_names[-1]: j for j, st in enumerate(model.stages)}
    return [(first[s.node_names[0]], last[s.node_names[-1]]) for s in plan.segments]
