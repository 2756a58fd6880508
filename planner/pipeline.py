"""``optimize``: trace, profile, plan and rewrite in one call: the front door that joins the
stages. It needs torch, so ``planner`` loads it on first use of ``optimize``; the rest of the
planner imports without torch.

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
import time
from collections.abc import Callable
from typing import Any

from planner.budget_plan import hand_plans_to_measure, plan_for_budget
from planner.capture_options import CaptureOptions
from planner.closed_loop import measured_plan
from planner.compiled_plan import compile_backend_of, plan_compiled
from planner.core.costgraph import CostGraph, with_held_bytes
from planner.core.errors import InfeasibleBudgetError, InputError, TraceError
from planner.core.options import (MAX_PLAUSIBLE_BUDGET_GB, PlanOptions, check_budget_choice, check_budget_gb,
                                  check_offload_device)
from planner.core.plan import GIB, Plan
from planner.graph_break_plan import plan_graph_breaks
from planner.measured_fit import MEASURED_FIT_TOLERANCE, plan_fitting_on_measurement
from planner.module_plan import plan_modules
from planner.rank_zero import planned_on_rank_zero, shared_from_rank_zero
from planner.uncaptured import plan_without_capture
from profiling.cache import cached_profile_graph
from profiling.measure import StepInputs, TrainingStep, measure_step_peak_bytes
from profiling.progress import heartbeat
from profiling.trace import trace_module
from profiling.validate import check_model_and_inputs
from rewrite.apply import CheckpointedModule, apply_plan
from rewrite.segments import module_copy
from planner.loss_chunking import is_chunked, plan_choosing_loss_chunks
from rewrite.chunked_loss import chunk_loss

__all__ = ["optimize", "plan_for_budget", "CaptureOptions", "Replanner", "PlanOptions", "MAX_PLAUSIBLE_BUDGET_GB"]

log = logging.getLogger(__name__)



def optimize(
    model: Any,
    example_inputs: Any,
    budget_gb: float | None = None,
    *,
    budget_fraction: float | None = None,
    reserve_gb: float = PlanOptions.reserve_gb,
    trace_method: str = CaptureOptions.trace_method,
    max_stages: int = PlanOptions.max_stages,
    solver: str | None = PlanOptions.solver,
    time_limit_s: float = PlanOptions.time_limit_s,
    timing_repeats: int = CaptureOptions.timing_repeats,
    safety_margin: float = PlanOptions.safety_margin,
    selective: bool = PlanOptions.selective,
    world_size: int = PlanOptions.world_size,
    cache_dir: str | None = CaptureOptions.cache_dir,
    progress: bool = CaptureOptions.progress,
    exact: bool | None = PlanOptions.exact,
    max_solve_s: float | None = PlanOptions.max_solve_s,
    simplify_attention_masks: bool = CaptureOptions.simplify_attention_masks,
    chunk_loss: bool = CaptureOptions.chunk_loss,
    loss_fn: Callable[[Any], Any] | None = CaptureOptions.loss_fn,
    output_held: bool = CaptureOptions.output_held,
    share_plan: bool = True,
    offload: bool = PlanOptions.offload,
    host_link: str = PlanOptions.host_link,
    host_bandwidth_gbps: float | None = PlanOptions.host_bandwidth_gbps,
    pinned_host_gb: float | None = PlanOptions.pinned_host_gb,
    compile: bool | str = CaptureOptions.compile,
) -> Any:
    """Return a drop-in replacement for ``model`` whose training step fits in ``budget_gb``.

    Args:
        model: an ``nn.Module`` in training mode.
        example_inputs: a tuple of positional arguments, or a dict of keyword arguments, shaped
            like a real batch.
        budget_gb: peak training-step memory allowed, in GiB (2**30 bytes): parameters, buffers,
            inputs, activations, gradients and temporaries of one forward plus backward. A budget
            at or above the step's measured unoptimized peak (with ``reserve_gb`` and
            ``safety_margin`` kept free) returns the empty plan at once, nothing profiled.
        budget_fraction: instead of ``budget_gb``: this share, in (0, 1], of the unoptimized
            step's peak, measured at the allocator on ``example_inputs`` (one training step run
            eagerly first); inputs of another shape are then planned for the same budget in GiB.
        reserve_gb: room set aside inside the budget (e.g. for optimizer state).
        trace_method: ``"export"`` (default) or ``"symbolic_trace"``: capture the forward as a
            graph, and where capture fails plan over the ATen ops the eager step dispatches, graph
            breaks and all (:mod:`planner.graph_break_plan`), else over submodule calls (one
            warning names the failure); ``"graph-breaks"`` or ``"modules"``: that path directly
            (``plan.capture`` says which path made the plan).
        max_stages: how many stages the graph is reduced to before the ILP.
        solver: None (default): segments-only stage models are solved exactly by dynamic
            programming over the stage chain, the rest (selective plans, the smallest peak) by
            the best installed MILP solver; ``"HiGHS"`` or ``"CBC"``: that MILP solver for all.
        time_limit_s: solver time limit per ILP solve (a plan takes several).
        timing_repeats: warm training steps each node is timed in, more while they disagree
            (after the step that measures temporaries); the median is used, twin ops of
            other layers pooled (:mod:`profiling.node_times`; docs/tuning.md says why 2).
        safety_margin: fraction of the budget kept free for what the memory model does not see
            (allocator rounding, small temporaries); the plan's predicted peak stays below
            ``budget * (1 - safety_margin)``.
        selective: after choosing segments, decide node by node which outputs inside them
            are kept from the forward (a selective checkpoint policy) instead of recomputed,
            by measured time per byte held (:mod:`planner.solvers.keep`), in segments where keeping
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
            (:mod:`planner.solvers.relaxation`). None (default): on graphs of fewer than 64 compute
            nodes, where it is fast, and on graphs under 512 where the ILP's plan leaves more
            than 1 % of the budget unused (up to 30 s, and up to 5 s once a plan is in hand; docs/tuning.md#exact_by_default_below);
            True: always, slower where the ILP's plan fills the budget and rarely cheaper there (docs/benchmarks/exact_search.md).
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
        chunk_loss: let the plan compute the output head and cross-entropy loss (a ``linear``
            into ``cross_entropy`` with a mean or sum over the tokens, found in the captured
            graph) in row chunks under checkpoint, so only one chunk's logits exist at a time
            (:mod:`planner.loss_chunking`): a lower floor on language models, where the loss
            sets the peak, for the chunks' forward run again in the backward. Used only where
            it is the only feasible way or costs less; another summation order, so the loss and
            gradients are ``allclose`` (rtol 1e-5 in float32), not bit for bit (opt-in;
            ``plan.computation_changes`` says when it is used). Default off: an infeasible
            budget that it would reach says so in the error, with the lower floor.
        loss_fn: the criterion the training loop applies to the module's output
            (``lambda out: F.cross_entropy(out.logits.flatten(0, 1), y.flatten())``), profiled
            and measured as part of the step: what it saves for the backward counts. None
            (default): the output's ``loss`` field (``model(**batch).loss``), else the sum of
            its floating-point outputs.
        output_held: the training loop keeps the module's output alive through the backward
            (``out = opt(x); criterion(out, y).backward(); log(out)``), so its tensors count
            until the step ends. False (default): the output is dropped once the loss is taken,
            as in ``criterion(opt(x), y).backward()``, ``model(**batch).loss.backward()`` and
            the HF Trainer; a module planned so warns once if a loop holds the output anyway
            (docs/memory.md).
        offload, host_link, host_bandwidth_gbps, pinned_host_gb: held outputs to pinned host
            memory as a third choice (:mod:`planner.solvers.offload`), copies priced over
            ``host_link`` or ``host_bandwidth_gbps`` GB/s each way (docs/tuning.md#host_links), with
            at most ``pinned_host_gb`` GiB pinned. Refused with a one-line error until a GPU has measured offload plans
            (docs/benchmarks/offload.md); on CPU copies pay off only behind GPU compute.
        share_plan: under ``torch.distributed``, rank 0 profiles and plans and every rank runs
            its plan (:mod:`planner.rank_zero`), so all ranks recompute the same segments: call
            ``optimize`` on every rank. False: each rank plans on its own profile (node times
            differ between ranks, and so can their plans).
        compile: run the training step under ``torch.compile`` (True: the default ``"inductor"``
            backend; a string: that backend) with the plan honoured inside one graph: each segment's
            non-reentrant checkpoint is traced by Dynamo (:mod:`rewrite.compiled`). Plans are
            checked on the compiled step's measured peak (:mod:`planner.compiled_plan`), one compile
            each; ``plan.compile_graph_breaks`` counts Dynamo's graph breaks. Not with
            ``selective``, ``chunk_loss`` or ``world_size`` > 1.

    Returns:
        An ``nn.Module`` called like ``model``, returning the same output structure, sharing its
        parameters and ``state_dict()`` keys, with ``.plan`` (a :class:`planner.Plan`). Inputs
        of another shape, under another autocast state or with gradients already accumulated
        are re-planned for the same budget on first use (one INFO log line each, then cached).

    Raises:
        InputError: neither or both of ``budget_gb`` and ``budget_fraction``; a budget that is
            not a positive number of GiB or looks like another unit, a fraction outside (0, 1]; a
            model in eval mode, on the meta device or with nothing to train; inputs that do not
            fit ``model.forward`` or sit on another device.
        InfeasibleBudgetError: no plan fits; the message names the smallest feasible budget and
            the unoptimized step's peak.
        TraceError: the model could not be captured and one training step of it, run eagerly,
            failed too (the message names both failures).
        ProfileError: with ``trace_method="modules"``, one training step failed when run eagerly.
        SolverError: no MILP solver is installed, or none found a plan within ``time_limit_s``.
    """
    # fail on a bad budget, option, model or inputs before the slow work
    check_budget_choice(budget_gb, budget_fraction)
    planning = PlanOptions(reserve_gb=reserve_gb, safety_margin=safety_margin, max_stages=max_stages, solver=solver,
                           time_limit_s=time_limit_s, selective=selective, world_size=world_size, exact=exact,
                           max_solve_s=max_solve_s, offload=offload, host_link=host_link,
                           host_bandwidth_gbps=host_bandwidth_gbps, pinned_host_gb=pinned_host_gb)
    capture = CaptureOptions(trace_method=trace_method, timing_repeats=timing_repeats, cache_dir=cache_dir,
                             progress=progress, simplify_attention_masks=simplify_attention_masks,
                             chunk_loss=chunk_loss, loss_fn=loss_fn, output_held=output_held)
    check_model_and_inputs(model, example_inputs)
    check_offload_device(offload, next((t.device.type for t in (*model.parameters(), *model.buffers())), "cpu"))
    if compile is not False:
        compile_backend_of(compile, selective=selective, chunk_loss=chunk_loss, world_size=world_size,
                           trace_method=trace_method)  # a one-line error for what compile does not take
        capture = dataclasses.replace(capture, compile=compile)
    if budget_fraction is not None:
        budget_gb = _budget_from_fraction(model, example_inputs, budget_fraction, capture.step)
    assert budget_gb is not None  # check_budget_choice asks for one of the two
    if capture.trace_method == "modules":
        return plan_modules(model, example_inputs, budget_gb, planning, timing_repeats=timing_repeats,
                            step=capture.step)
    if capture.trace_method == "graph-breaks":
        return plan_graph_breaks(model, example_inputs, budget_gb, planning, timing_repeats=timing_repeats,
                                 step=capture.step)
    if not isinstance(share_plan, bool):
        raise InputError(f"share_plan must be True or False, got {share_plan!r}")
    replan = Replanner(budget_gb, planning, capture, share_plan=share_plan)
    try:
        gm, plan, graph = replan(model, example_inputs)
    except TraceError as exc:
        return plan_without_capture(model, example_inputs, budget_gb, planning, timing_repeats, capture.step, exc)
    return CheckpointedModule(gm, model, plan, cost_graph=graph, example_inputs=example_inputs, replan=replan)


def _budget_from_fraction(model: Any, example_inputs: Any, fraction: float, step: TrainingStep) -> float:
    """``fraction`` of the unoptimized step's peak measured on ``example_inputs``, in GiB."""
    peak_bytes = measure_step_peak_bytes(model, StepInputs.from_example(example_inputs), step)
    budget_gb = fraction * peak_bytes / GIB
    log.info("budget %.4f GiB: %.3g of the measured unoptimized peak %.4f GiB", budget_gb, fraction, peak_bytes / GIB)
    return budget_gb


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
    planning: PlanOptions = PlanOptions()
    capture: CaptureOptions = CaptureOptions()
    #: under ``torch.distributed``, rank 0 plans and every rank runs its plan
    #: (:mod:`planner.rank_zero`); False: each rank plans on its own profile
    share_plan: bool = True

    @property
    def world_size(self) -> int:
        """Ranks the plan shards parameters over (the rewrite asks, to re-plan per FSDP unit)."""
        return self.planning.world_size

    def __call__(self, model: Any, example_inputs: Any, graph: CostGraph | None = None,
                 grads_held: bool = False) -> tuple[Any, Plan, CostGraph | None]:
        """The rewritten graph, its plan and the profile it was solved on (None where the
        measured unoptimized step fits the budget: the empty plan, nothing profiled). Under
        ``torch.distributed`` (with ``share_plan``) the plan and profile are rank 0's."""
        if not self.share_plan:
            return self._plan(model, example_inputs, graph, grads_held)
        return planned_on_rank_zero(lambda: self._plan(model, example_inputs, graph, grads_held),
                                    lambda plan, profiled: self._rewrite_with(model, example_inputs, plan, profiled))

    def _rewrite_with(self, model: Any, example_inputs: Any, plan: Plan, graph: CostGraph | None) -> Any:
        """This rank's capture of ``model`` rewritten with ``plan``, made on rank 0 from ``graph``."""
        gm = trace_module(model, example_inputs, method=self.capture.trace_method,
                          simplify_attention_masks=self.capture.simplify_attention_masks)
        if graph is not None and is_chunked(graph):
            chunk_loss(gm)
        return apply_plan(gm, plan)

    def _plan(self, model: Any, example_inputs: Any, graph: CostGraph | None = None,
              grads_held: bool = False) -> tuple[Any, Plan, CostGraph | None]:
        """:meth:`__call__` on this process alone."""
        def trace() -> Any:
            return trace_module(model, example_inputs, method=self.capture.trace_method,
                                simplify_attention_masks=self.capture.simplify_attention_masks)

        def profile(captured: Any) -> CostGraph:
            return cached_profile_graph(captured, example_inputs, self.capture.cache_dir,
                                        timing_repeats=self.capture.timing_repeats, progress=self.capture.progress,
                                        step=self.capture.step)

        def plan_at(profiled: CostGraph, budget_gb: float | None) -> Plan:
            budget = self.budget_gb if budget_gb is None else budget_gb + self.planning.reserve_gb
            return plan_for_budget(profiled, budget, self.planning, grads_held=grads_held)

        gm = trace()
        if self.capture.compile_backend is not None and graph is None and not grads_held:
            return plan_compiled(gm, example_inputs, self.budget_gb, self.planning, self.capture.step,
                                 self.capture.compile_backend, profile, lambda g, budget_gb: plan_for_budget(
                                     g, budget_gb, self.planning), original=model)
        if graph is None and not grads_held and self.planning.world_size == 1:
            roomy = self._plan_if_the_step_fits(gm, example_inputs)
            if roomy is not None:
                return apply_plan(gm, roomy), roomy, None
        if graph is None:
            graph = profile(gm)
        with heartbeat(f"solving for {self.budget_gb:.4g} GiB ({len(graph.nodes)} nodes)"):
            try:
                gm, plan, graph = plan_choosing_loss_chunks(gm, graph, chunk_loss_on=self.capture.chunk_loss,
                                                            trace=trace, profile=profile, plan=plan_at)
            except InfeasibleBudgetError as refusal:
                # a budget just under the predicted floor: the plans that would meet it are measured
                fitted = plan_fitting_on_measurement(
                    gm, example_inputs, refusal, self.planning,
                    lambda budget_gb, options: plan_for_budget(graph, budget_gb, options, grads_held=grads_held),
                    grads_held=grads_held, step=self.capture.step)
                if fitted is None:
                    raise
                log.info("plan: measured peak %.3f GiB of %.3f GiB budget (predicted %.3f GiB), %d segments",
                         fitted[1].measured_peak_bytes / GIB, fitted[1].budget_bytes / GIB,
                         fitted[1].predicted_peak_bytes / GIB, len(fitted[1].segments))
                return fitted[0], fitted[1], graph
        if not grads_held and self.planning.world_size == 1 and graph.metadata.get("mode") == "measured":
            module, plan = self._measured(gm, plan, graph, example_inputs)
            log.info("plan: measured peak %.3f GiB of %.3f GiB budget (predicted %.3f GiB), %d segments",
                     plan.measured_peak_bytes / GIB, plan.budget_bytes / GIB, plan.predicted_peak_bytes / GIB,
                     len(plan.segments))
            return (module if module is not None else apply_plan(gm, plan)), plan, graph
        log.info("plan: predicted peak %.3f GiB of %.3f GiB budget, %d segments",
                 plan.predicted_peak_bytes / GIB, plan.budget_bytes / GIB, len(plan.segments))
        return apply_plan(gm, plan), plan, graph

    def profile_for(self, model: Any, example_inputs: Any) -> CostGraph:
        """The profile of ``model``'s step on ``example_inputs``, captured and profiled as
        ``__call__`` does (what a plan made without a profile reads on demand)."""
        gm = trace_module(model, example_inputs, method=self.capture.trace_method,
                          simplify_attention_masks=self.capture.simplify_attention_masks)
        return cached_profile_graph(gm, example_inputs, self.capture.cache_dir, timing_repeats=self.capture.timing_repeats,
                                    progress=self.capture.progress, step=self.capture.step)

    def fits_with_grads_held(self, plan: Plan, grad_bytes: int) -> bool:
        """Whether a plan made without a profile (:meth:`_plan_if_the_step_fits`) still fits
        its planning room with ``grad_bytes`` of parameter gradients held all step on top of
        its measured peak (an upper bound: the step's own gradients are counted twice)."""
        measured = plan.measured_peak_bytes
        return measured is not None and measured + grad_bytes <= self._room_bytes(plan.budget_bytes)

    def _room_bytes(self, budget_bytes: int) -> int:
        return int((budget_bytes - self.planning.reserve_bytes) * (1 - self.planning.safety_margin))

    def _plan_if_the_step_fits(self, gm: Any, example_inputs: Any) -> Plan | None:
        """The empty plan when one measured step of ``gm`` (nothing recomputed) fits the
        planning room (the budget less ``reserve_gb`` and ``safety_margin``), else None: a roomy
        budget needs no profile and no solve."""
        started = time.perf_counter()
        budget_bytes = check_budget_gb(self.budget_gb)
        room_bytes = self._room_bytes(budget_bytes)
        peak_bytes = measure_step_peak_bytes(gm, StepInputs.from_example(example_inputs), self.capture.step)
        if peak_bytes > room_bytes:
            log.debug("the unoptimized step peaks at %.4f GiB, above the room of %.4f GiB: planning", peak_bytes / GIB,
                      room_bytes / GIB)
            return None
        log.info("plan: the unoptimized step's measured peak %.4f GiB fits the %.4f GiB budget: nothing to recompute, "
                 "nothing profiled", peak_bytes / GIB, budget_bytes / GIB)
        return Plan(budget_bytes=budget_bytes, predicted_peak_bytes=peak_bytes, unoptimized_peak_bytes=peak_bytes,
                    segments=(), forward_ms=0.0, step_ms=0.0, forward_flops=0,
                    solver="none (the measured unoptimized step fits)", solve_s=time.perf_counter() - started,
                    measured_unoptimized_peak_bytes=peak_bytes, measured_peak_bytes=peak_bytes,
                    computation_changes=tuple(gm.meta.get("computation_changes", ())))

    def _measured(self, gm: Any, plan: Plan, graph: CostGraph, example_inputs: Any) -> tuple[Any, Plan]:
        """``plan`` checked by measuring its step on the device (:mod:`planner.closed_loop`)."""
        inputs = StepInputs.from_example(example_inputs)
        room_bytes = plan.budget_bytes - self.planning.reserve_bytes
        margin_bytes = int(room_bytes * self.planning.safety_margin)

        def measure(candidate: Plan) -> tuple[Any, int]:
            module = apply_plan(module_copy(gm), candidate)
            return module, measure_step_peak_bytes(module, inputs, self.capture.step)

        def resolve(held_bytes: int, extra_room_bytes: int) -> Plan:
            budget_gb = self.budget_gb + extra_room_bytes / (1 - self.planning.safety_margin) / GIB
            solved = plan_for_budget(with_held_bytes(graph, held_bytes), budget_gb, self.planning)
            return dataclasses.replace(solved, budget_bytes=plan.budget_bytes)

        try:
            return measured_plan(plan, room_bytes, margin_bytes, measure, resolve, graph.measured_peak_bytes,
                                 hand_plans_to_measure(graph, plan, self.planning, MEASURED_FIT_TOLERANCE))
        except InfeasibleBudgetError as exc:
            raise exc.with_unoptimized_peak(graph.measured_peak_bytes) from None

    def solve(self, graph: CostGraph, grads_held: bool = False, keep: frozenset[str] = frozenset(),
              extra_bytes: int = 0) -> Plan:
        """Plan ``graph`` again with these options, recomputing none of the nodes in ``keep`` and
        holding ``extra_bytes`` more all step (no tracing or profiling: safe under
        ``torch.distributed``; there, with ``share_plan``, rank 0's plan on every rank)."""
        if keep:
            graph = dataclasses.replace(graph, nodes=tuple(
                dataclasses.replace(n, recomputable=False) if n.name in keep else n for n in graph.nodes))
        held = with_held_bytes(graph, extra_bytes)

        def solved() -> Plan:
            return plan_for_budget(held, self.budget_gb, self.planning, grads_held=grads_held)

        return shared_from_rank_zero(solved) if self.share_plan else solved()

