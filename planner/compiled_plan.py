"""Plan a step that runs under ``torch.compile``: the budget held by the compiled step's measured peak.

The profile is the eager step's; the compiled step peaks lower (fused kernels keep fewer
temporaries) or elsewhere (the partitioner saves other tensors). :func:`plan_compiled`

1. compiles the captured graph with nothing recomputed and measures its step at the allocator:
   within the budget's room, that is the plan (nothing profiled);
2. otherwise solves the eager profile for the eager peak expected to compile into the room, less
   the safety margin (:func:`planner.compiled_aim.eager_target_bytes`: compile saves a share of
   the activations, not a fixed number of bytes); where that is below the eager floor, for the
   floor (the compiled step peaks lower);
3. compiles the chosen plan (its segments traced by Dynamo: :mod:`rewrite.compiled`) and
   measures the compiled step, as :mod:`planner.closed_loop` checks eager plans: above the room,
   or more than twice the margin below it, the graph is solved again for the eager peak read off
   the plans measured so far, kept between the highest eager prediction that fitted and the
   lowest that did not (up to :data:`MAX_COMPILED_SOLVES` plans; a solve giving a plan already
   compiled ends the search); the plan that measured within the room and recomputes least is
   returned;
4. where no plan fitted and a target fell below the eager floor, compiles other plans at the
   same floor (:func:`_floor_variant`: plans that peak and cost alike eagerly compile to peaks
   several percent apart);
5. compiles the hand-placed plans worth trying beside the search's (:func:`_with_hand_plans`).

The plan returned has ``measured_peak_bytes`` (the compiled step's), ``compile_graph_breaks``
and ``compile_s`` set. Each plan checked costs one compile.

Example:
    >>> import torch
    >>> from planner import optimize
    >>> model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh()).train()
    >>> opt = optimize(model, (torch.randn(8, 16),), budget_gb=1.0, compile="aot_eager")
    >>> opt.plan.compile_graph_breaks
    0
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from collections.abc import Callable
from typing import Any

from planner.compiled_aim import (MAX_COMPILED_HAND_PLANS, MAX_FLOOR_VARIANTS, PeakPair, cost_variant, costed_on,
                                  eager_target_bytes, hand_plans_to_compile, keeps_matmul_outputs, plan_structure,
                                  within_bracket)
from planner.core.costgraph import CostGraph, with_held_bytes
from planner.core.errors import InfeasibleBudgetError, InputError
from planner.core.options import COMPILE_BACKEND, check_budget_gb
from planner.core.plan import GIB, Plan
from planner.core.simulate import simulate
from planner.planning_steps import PlanningSteps
from rewrite.attach import attach_to_user_modules
from rewrite.compiled import (COMPILED_STEP, CompiledStep, check_compile_available, compiled_step_peak_bytes,
                              compiled_step_times_ms, paired_ratio)
from rewrite.segments import apply_plan, module_copy

__all__ = ["compile_backend_of", "compiled_and_measured", "plan_compiled"]

log = logging.getLogger(__name__)

#: Plans compiled and measured at most: the first, and solves again after a measured overshoot,
#: or with the room a plan left unused (docs/tuning.md#max_compiled_solves).
MAX_COMPILED_SOLVES = 5

#: The search's compiled plan replaces the hand-placed one that fits only where its step measured
#: faster by more than this share (the median of paired per-round ratios): two copies of one
#: compiled step measure up to 1 % apart (docs/tuning.md#compiled_time_tolerance).
COMPILED_TIME_TOLERANCE = 0.02


def compile_backend_of(compile: bool | str, *, selective: bool = False, chunk_loss: bool = False,
                       world_size: int = 1, trace_method: str = "export") -> str | None:
    """The ``torch.compile`` backend ``optimize(compile=...)`` names (None: eager), or
    :class:`InputError` (one line) for a value or option combination compile=True does not take.

    Example:
        >>> compile_backend_of(True)
        'inductor'
        >>> compile_backend_of(True, selective=True)
        Traceback (most recent call last):
        ...
        planner.core.errors.InputError: compile=True does not take selective=True: a selective policy's markers do not run inside a compiled graph; pass selective=False
    """
    if compile is False:
        return None
    if compile is not True and (not isinstance(compile, str) or not compile):
        raise InputError(f"compile must be True, False or a torch.compile backend name, got {compile!r}")
    refused = (
        ("selective=True", selective, "a selective policy's markers do not run inside a compiled graph",
         "selective=False"),
        ("chunk_loss=True", chunk_loss, "the chunked loss is planned on the eager step", "chunk_loss=False"),
        (f"world_size={world_size}", world_size != 1, "sharded plans are checked on the eager step", "world_size=1"),
        ("trace_method='modules'", trace_method == "modules", "the module path runs the model's own forward",
         "trace_method='export'"),
    )
    for option, given, why, fix in refused:
        if given:
            raise InputError(f"compile=True does not take {option}: {why}; pass {fix}")
    check_compile_available()
    return COMPILE_BACKEND if compile is True else compile


def _compiled_fields(plan: Plan, run: CompiledStep | None) -> Plan:
    if run is None:
        return plan
    return dataclasses.replace(plan, compile_graph_breaks=run.graph_breaks, compile_s=run.compile_s,
                               compile_split_before_loss=run.split_before_loss)


def _with_hand_plans(best: tuple[Any, Plan] | None, graph: CostGraph, pairs: list[PeakPair], room_bytes: int,
                     budget_bytes: int, compiled_unoptimized: int, measured: Callable[[Plan], tuple[Any, Plan, int]],
                     step_times_ms: Callable[[list[Any]], list[list[float]]]) -> tuple[Any, Plan] | None:
    """``best`` (the search's plan that measured within the room, compiled), or a hand-placed plan
    (:func:`planner.compiled_aim.hand_plans_to_compile`) that measured within the room: the first
    of them that fits is compiled beside it and the two steps timed in interleaved rounds
    (``step_times_ms``: each module's times, round by round); the hand-placed plan is taken
    unless the search's steps faster by more than :data:`COMPILED_TIME_TOLERANCE` (the median
    of the rounds' ratios), so that timing noise does not swap the plan from run to run. Each measured plan's pair (with
    the peak ``measured`` gives for aiming, its third value) is added to ``pairs``."""
    for _ in range(MAX_COMPILED_HAND_PLANS):
        # asked again after each plan measured over the room: that measurement moves the aim
        chosen = hand_plans_to_compile(graph, pairs, room_bytes, budget_bytes, limit=1)
        if not chosen:
            return best
        candidate = dataclasses.replace(chosen[0], measured_unoptimized_peak_bytes=compiled_unoptimized)
        if best is not None and candidate.segments == best[1].segments:
            return best
        module, plan, aim_peak = measured(candidate)
        peak = plan.measured_peak_bytes
        assert peak is not None
        pairs.append(PeakPair(plan.predicted_peak_bytes, aim_peak, keeps_matmul_outputs(plan)))
        if peak > room_bytes:
            log.info("%s compiled measured %.4f GiB, over the room of %.4f GiB", plan.solver, peak / GIB,
                     room_bytes / GIB)
            continue
        if best is None:
            return module, plan
        search_ms, hand_ms = step_times_ms([best[0], module])
        ratio = paired_ratio(search_ms, hand_ms)
        log.info("compiled steps: the search's plan (%d segments) %.1f ms, %s (%d segments) %.1f ms: %.3fx",
                 len(best[1].segments), statistics.median(search_ms), plan.solver, len(plan.segments),
                 statistics.median(hand_ms), ratio)
        return best if ratio < 1 - COMPILED_TIME_TOLERANCE else (module, plan)
    return best


def _floor_variant(floor_bytes: int, solve_for: Callable[[int, CostGraph], Plan], graph: CostGraph,
                   compiled_before: set[tuple[Any, ...]], measured: Callable[[Plan], tuple[Any, Plan, int]],
                   pairs: list[PeakPair], room_bytes: int) -> tuple[Any, Plan] | None:
    """Where the plan at the eager floor measured over the room: the first plan at the same floor,
    solved on the profile with its node times moved within a timing pass's spread
    (:func:`planner.compiled_aim.cost_variant`, seeds 1, 2, ...), that compiles within the room.
    Such plans peak alike eagerly and cost alike within the timing noise, but their compiled
    peaks differ (docs/tuning.md#max_floor_variants). At most :data:`MAX_FLOOR_VARIANTS` plans
    not compiled before are measured, each one's pair added to ``pairs``."""
    compiled = 0
    for seed in range(1, 3 * MAX_FLOOR_VARIANTS + 1):
        if compiled == MAX_FLOOR_VARIANTS:
            break
        try:
            candidate = solve_for(floor_bytes, cost_variant(graph, seed))
        except InfeasibleBudgetError:
            continue
        if plan_structure(candidate.segments) in compiled_before:
            continue
        compiled_before.add(plan_structure(candidate.segments))
        compiled += 1
        module, plan, aim_peak = measured(candidate)
        peak = plan.measured_peak_bytes
        assert peak is not None
        pairs.append(PeakPair(plan.predicted_peak_bytes, aim_peak, keeps_matmul_outputs(plan)))
        log.info("plan at the eager floor (node times varied, seed %d) compiled measured %.4f GiB against a room of "
                 "%.4f GiB", seed, peak / GIB, room_bytes / GIB)
        if peak <= room_bytes:
            return module, plan
    return None


def compiled_and_measured(candidate: Plan, rewritten: Callable[[Plan], Any], room_bytes: int,
                          peak_of: Callable[[Any, bool], int]) -> tuple[Any, Plan, int]:
    """``candidate`` rewritten and compiled with whole segments keeping their outputs, and its
    measured peak (``peak_of(module, keep_outputs)`` compiles and measures); over the room, compiled
    again with plain checkpoint tags, which peak lower on some plans (docs/design.md, plans that
    compile): the lower of the two. Third, the peak with outputs kept, which the search aims by:
    its line from eager predictions to compiled peaks is one mode's, whichever plan is kept.

    Example:
        >>> from planner.core.plan import Segment
        >>> plan = Plan(100, 90, 200, (Segment(("a",), 1.0, 10),), 1.0, 2.0, 0, "search", 0.0)
        >>> peaks = {True: 120, False: 95}  # kept outputs: over the room of 100; plain: within
        >>> module, measured, aimed_by = compiled_and_measured(plan, lambda p: object(), 100, lambda m, keep: peaks[keep])
        >>> measured.measured_peak_bytes, aimed_by
        (95, 120)
    """
    module = rewritten(candidate)
    peak_bytes = kept_bytes = peak_of(module, True)
    if peak_bytes > room_bytes and any(not segment.kept_nodes for segment in candidate.segments):
        plain = rewritten(candidate)
        plain_bytes = peak_of(plain, False)
        log.info("compiled plan with segment outputs kept measured %.4f GiB, with plain checkpoint tags %.4f GiB",
                 peak_bytes / GIB, plain_bytes / GIB)
        if plain_bytes < peak_bytes:
            module, peak_bytes = plain, plain_bytes
    return module, dataclasses.replace(candidate, measured_peak_bytes=peak_bytes), kept_bytes


def plan_compiled(steps: PlanningSteps, gm: Any) -> tuple[Any, Plan, CostGraph | None]:
    """The rewritten graph (compiled, kept in its ``meta``), its plan and the profile it was
    solved on (None where the compiled unoptimized step fits: nothing profiled), for a step run
    under ``torch.compile`` with ``steps.capture_options.compile_backend`` (see module docs).
    ``gm`` is the captured graph, left unchanged; ``steps.profile(gm)`` profiles it eagerly.
    Each graph compiled reads its parameters through the user's module (``steps.model``), as
    the module ``optimize`` returns does (so that one's first step does not compile again).
    The module's example runs it."""
    budget_gb, planning, step = steps.budget_gb, steps.plan_options, steps.capture_options.step
    backend = steps.capture_options.compile_backend
    assert backend is not None, "plan_compiled plans a compiled step: CaptureOptions(compile=...) names its backend"

    def rewritten(plan: Plan) -> Any:
        module = apply_plan(module_copy(gm), plan)
        attach_to_user_modules(module, steps.model)
        return module

    inputs = steps.step_inputs
    budget_bytes = check_budget_gb(budget_gb)
    room_bytes = budget_bytes - planning.reserve_bytes
    margin_bytes = int(room_bytes * planning.safety_margin)
    planning_room = int(room_bytes * (1 - planning.safety_margin))

    started = time.perf_counter()
    empty = Plan(budget_bytes=budget_bytes, predicted_peak_bytes=0, unoptimized_peak_bytes=0, segments=(),
                 forward_ms=0.0, step_ms=0.0, forward_flops=0, solver="none (the compiled unoptimized step fits)",
                 solve_s=0.0, computation_changes=tuple(gm.meta.get("computation_changes", ())))
    unoptimized = rewritten(empty)
    run, compiled_unoptimized = compiled_step_peak_bytes(unoptimized, inputs, step, backend=backend)
    if compiled_unoptimized <= planning_room:
        log.info("plan: the compiled unoptimized step's measured peak %.4f GiB fits the %.4f GiB budget: nothing to "
                 "recompute, nothing profiled", compiled_unoptimized / GIB, budget_bytes / GIB)
        plan = dataclasses.replace(empty, predicted_peak_bytes=compiled_unoptimized,
                                   unoptimized_peak_bytes=compiled_unoptimized,
                                   measured_unoptimized_peak_bytes=compiled_unoptimized,
                                   measured_peak_bytes=compiled_unoptimized, solve_s=time.perf_counter() - started)
        return unoptimized, _compiled_fields(plan, run), None

    graph = steps.profile(gm)
    log.info("the compiled unoptimized step peaks at %.4f GiB, the eager one at %.4f GiB: each plan is solved on the "
             "eager profile for the eager peak expected to compile into the room, then compiled and measured",
             compiled_unoptimized / GIB, (graph.measured_peak_bytes or 0) / GIB)

    def solve_for(eager_room_bytes: int, costs: CostGraph | None = None) -> Plan:
        """The plan for an eager peak of ``eager_room_bytes`` (the solver's room, after the margin),
        solved on ``costs`` (a :func:`cost_variant` of the profile) where given."""
        extra_bytes = eager_room_bytes - planning_room
        held, room = max(0, -extra_bytes), max(0, extra_bytes)  # a smaller room: bytes held all step
        budget_for_room_gb = budget_gb + room / (1 - planning.safety_margin) / GIB
        solved = steps.plan(with_held_bytes(costs or graph, held), budget_for_room_gb)
        if costs is not None:
            solved = costed_on(solved, with_held_bytes(graph, held))
        return dataclasses.replace(solved, budget_bytes=budget_bytes, measured_unoptimized_peak_bytes=compiled_unoptimized)

    def eager_floor_bytes(exc: InfeasibleBudgetError, eager_room_bytes: int) -> int:
        """The solver's room at the smallest budget ``exc`` names, for the graph without held bytes."""
        held = max(0, planning_room - eager_room_bytes)
        return int((exc.min_feasible_bytes - planning.reserve_bytes) * (1 - planning.safety_margin)) - held

    measured_peaks = [compiled_unoptimized]

    def measured(candidate: Plan) -> tuple[Any, Plan, int]:
        if not candidate.segments:
            return unoptimized, dataclasses.replace(candidate, measured_peak_bytes=compiled_unoptimized), \
                compiled_unoptimized
        module, plan, aim_peak = compiled_and_measured(
            candidate, rewritten, room_bytes,
            lambda module, keep: compiled_step_peak_bytes(module, inputs, step, backend=backend, keep_outputs=keep)[1])
        measured_peaks.append(plan.measured_peak_bytes or aim_peak)
        return module, plan, aim_peak

    target_bytes = room_bytes - margin_bytes  # aimed inside the room by the margin
    pairs = [PeakPair(simulate(graph).peak_bytes, compiled_unoptimized)]
    eager_bytes = eager_target_bytes(pairs, target_bytes, graph.persistent_bytes)
    best: tuple[Any, Plan] | None = None
    floor_bytes: int | None = None  # the eager floor, once a target fell below it
    compiled_before: set[tuple[Any, ...]] = set()
    for attempt in range(MAX_COMPILED_SOLVES):
        try:
            solved = solve_for(eager_bytes)
        except InfeasibleBudgetError as exc:
            # below the eager floor: the floor's plan may still fit compiled, which peaks lower
            if best is not None or floor_bytes is not None:
                break  # the floor's plan measured already
            floor_bytes = eager_floor_bytes(exc, eager_bytes)
            if floor_bytes <= eager_bytes:
                raise InfeasibleBudgetError(  # in the user's budget's terms
                    budget_bytes, max(budget_bytes + 1, budget_bytes + floor_bytes - eager_bytes), exc.note,
                    compiled_unoptimized) from None
            eager_bytes = floor_bytes
            solved = solve_for(eager_bytes)
        if plan_structure(solved.segments) in compiled_before:
            break  # the solve gave a plan already compiled: nothing new to measure
        compiled_before.add(plan_structure(solved.segments))
        module, plan, aim_peak = measured(solved)
        peak = plan.measured_peak_bytes
        assert peak is not None
        pairs.append(PeakPair(plan.predicted_peak_bytes, aim_peak, keeps_matmul_outputs(plan)))
        if peak <= room_bytes and (best is None or plan.recompute_ms < best[1].recompute_ms):
            best = module, plan
        if peak <= room_bytes and (not plan.segments or room_bytes - peak <= 2 * margin_bytes):
            break  # fits, with no more than twice the margin left unused
        following = within_bracket(eager_target_bytes(pairs, target_bytes, graph.persistent_bytes), pairs, room_bytes)
        if following == eager_bytes or attempt == MAX_COMPILED_SOLVES - 1:
            break
        log.log(logging.INFO if peak <= room_bytes else logging.WARNING,
                "compiled plan measured %.4f GiB against a room of %.4f GiB (eager prediction %.4f GiB): solving "
                "again for an eager peak of %.4f GiB (%d of %d)", peak / GIB, room_bytes / GIB,
                plan.predicted_peak_bytes / GIB, following / GIB, attempt + 1, MAX_COMPILED_SOLVES - 1)
        eager_bytes = following
    if best is None and floor_bytes is not None:
        best = _floor_variant(floor_bytes, solve_for, graph, compiled_before, measured, pairs, room_bytes)
    best = _with_hand_plans(best, graph, pairs, room_bytes, budget_bytes, compiled_unoptimized, measured,
                            lambda modules: compiled_step_times_ms(modules, inputs, step))
    if best is None:
        lowest = min(measured_peaks)
        raise InfeasibleBudgetError(budget_bytes, lowest + planning.reserve_bytes, note=(
            f"the lowest compiled plan measured {lowest / GIB:.4f} GiB (docs/memory.md#compiled-steps); "
            f"torch.compile(optimize(model, ..., compile=False)) runs the eager plan between compiled graphs, "
            f"with graph breaks"),
            unoptimized_peak_bytes=compiled_unoptimized)
    module, plan = best
    plan = _compiled_fields(plan, module.meta.get(COMPILED_STEP))
    log.info("plan (compiled): measured peak %.3f GiB of %.3f GiB budget, %d segments, %d graph breaks",
             plan.measured_peak_bytes / GIB, plan.budget_bytes / GIB, len(plan.segments), plan.compile_graph_breaks)
    return module, plan, graph
