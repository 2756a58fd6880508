"""``optimize``: capture, profile, plan and rewrite in one call: the front door that joins the
stages. :class:`Replanner` runs them as named steps on one
:class:`planner.planning_steps.PlanningSteps` (docs/design.md#the-pipeline lists them), and the
module ``optimize`` returns runs it again for inputs it was not planned for. It needs torch, so
``planner`` loads it on first use of ``optimize``; the rest of the planner imports without torch.

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
from collections.abc import Callable
from typing import Any

from planner.budget_plan import plan_for_budget
from planner.capture_options import CaptureOptions
from planner.compiled_plan import compile_backend_of, plan_compiled
from planner.core.costgraph import CostGraph, with_held_bytes
from planner.core.errors import InfeasibleBudgetError, InputError, TraceError
from planner.core.options import MAX_PLAUSIBLE_BUDGET_GB, PlanOptions, check_budget_choice, check_offload_device
from planner.core.plan import GIB, Plan
from planner.graph_break_plan import plan_graph_breaks
from planner.loss_chunking import choose_loss_chunks, is_chunked, with_chunked_floor
from planner.measured_fit import check_on_device, fit_on_measurement, measured_floor
from planner.module_plan import plan_modules
from planner.planning_steps import PlanningSteps, log_plan, plan_if_the_step_fits, planning_room_bytes
from planner.rank_zero import planned_on_rank_zero, shared_from_rank_zero
from planner.uncaptured import plan_without_capture
from profiling.measure import StepInputs, TrainingStep, measure_step_peak_bytes
from profiling.progress import heartbeat
from profiling.validate import check_model_and_inputs
from rewrite.apply import CheckpointedModule, apply_plan
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
    timing_repeats: int | None = CaptureOptions.timing_repeats,
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
        timing_repeats: warm training steps each node is timed in, more while they disagree; the
            median is used, twin ops of other layers pooled (:mod:`profiling.node_times`). None
            (default): on CPU the step that measures temporaries alone, which times every node
            (docs/tuning.md#cpu_timing_passes says why one); two on CUDA, and on the graph-break
            and module paths, whose memory step times nothing.
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
            machine, torch version and target): the same model again, at this budget or another,
            skips profiling and is planned on the same node times, so it gets the same plan
            (measured node times move by 10 % or more from run to run on a CPU, enough to swap
            near-equal plans: docs/benchmarks/plan_stability.md). ``"auto"`` (default):
            ``$CKPT_PLANNER_CACHE_DIR`` (empty: no cache), else ``~/.cache/ckpt-planner/profiles``
            (``$XDG_CACHE_HOME`` where set); None: profile every call. Delete the folder to
            measure again (after a change of load on the machine, say). The captured-graph path
            only: the graph-break and module paths profile every call.
        progress: draw a tqdm bar while profiling (when tqdm is installed); progress of
            profiling and solving is logged at INFO either way.
        exact: after the ILP, search an optimistic memory account checked against the simulator
            until it proves the plan the cheapest over the stages or finds a cheaper one
            (:mod:`planner.solvers.relaxation`). None (default): on graphs of fewer than 64 compute
            nodes, where it is fast, and on graphs under 512 where the ILP's plan leaves more
            than 1 % of the budget unused (up to 30 s, and up to 2.5 s once a plan is in hand; docs/tuning.md#exact_by_default_below);
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
                                 step=capture.step, cache_dir=capture.cache_dir)
    if not isinstance(share_plan, bool):
        raise InputError(f"share_plan must be True or False, got {share_plan!r}")
    replan = Replanner(budget_gb, planning, capture, share_plan=share_plan)
    try:
        gm, plan, graph = replan(model, example_inputs)
    except TraceError as exc:
        return plan_without_capture(model, example_inputs, budget_gb, planning, capture, exc)
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

    def steps(self, model: Any, example_inputs: Any, grads_held: bool = False) -> PlanningSteps:
        """What each step of planning ``model`` on ``example_inputs`` needs, with these options."""
        return PlanningSteps(model, example_inputs, self.budget_gb, self.planning, self.capture, grads_held)

    def _rewrite_with(self, model: Any, example_inputs: Any, plan: Plan, graph: CostGraph | None) -> Any:
        """This rank's capture of ``model`` rewritten with ``plan``, made on rank 0 from ``graph``."""
        gm = self.steps(model, example_inputs).capture()
        if graph is not None and is_chunked(graph):
            chunk_loss(gm)
        return apply_plan(gm, plan)

    def _plan(self, model: Any, example_inputs: Any, graph: CostGraph | None = None,
              grads_held: bool = False) -> tuple[Any, Plan, CostGraph | None]:
        """:meth:`__call__` on this process alone: capture, profile, plan, rewrite. A first plan
        (no profile given, no gradients held) may be measured instead of profiled; an unsharded
        plan (``world_size=1``) is checked on a measured step."""
        steps = self.steps(model, example_inputs, grads_held)
        gm = steps.capture()
        first = graph is None and not grads_held
        unsharded = self.planning.world_size == 1
        if first and self.capture.compile_backend is not None:
            return plan_compiled(steps, gm)  # compiled, and held to the compiled step's measured peak
        node_peaks = None
        if first and unsharded:
            fit = plan_if_the_step_fits(steps, gm)  # the unoptimized step measured: nothing profiled
            if fit.plan is not None:
                return apply_plan(gm, fit.plan), fit.plan, None
            node_peaks = fit.node_peaks  # that step was the profile's memory pass
        if graph is None:
            graph = steps.profile(gm, node_peaks)
        with heartbeat(f"solving for {self.budget_gb:.4g} GiB ({len(graph.nodes)} nodes)"):
            try:
                gm, plan, graph = choose_loss_chunks(steps, gm, graph)
            except InfeasibleBudgetError as refusal:
                fitted = fit_on_measurement(steps, gm, graph, refusal)  # just under the floor: measured
                if fitted is None:  # the floor named is one a measured plan meets
                    raise with_chunked_floor(steps, gm, measured_floor(steps, gm, graph, refusal)) from None
                module, plan = fitted
                log_plan(plan, measured=True)
                return module, plan, graph
        if not grads_held and unsharded and graph.metadata.get("mode") == "measured":
            module, plan = check_on_device(steps, gm, plan, graph)
            log_plan(plan, measured=True)
            return module, plan, graph
        log_plan(plan, measured=False)
        return apply_plan(gm, plan), plan, graph

    def profile_for(self, model: Any, example_inputs: Any) -> CostGraph:
        """The profile of ``model``'s step on ``example_inputs``, captured and profiled as
        ``__call__`` does (what a plan made without a profile reads on demand)."""
        steps = self.steps(model, example_inputs)
        return steps.profile(steps.capture())

    def fits_with_grads_held(self, plan: Plan, grad_bytes: int) -> bool:
        """Whether a plan made without a profile (:func:`planner.planning_steps.plan_if_the_step_fits`)
        still fits its planning room with ``grad_bytes`` of parameter gradients held all step on
        top of its measured peak (an upper bound: the step's own gradients are counted twice)."""
        measured = plan.measured_peak_bytes
        return measured is not None and measured + grad_bytes <= planning_room_bytes(plan.budget_bytes, self.planning)

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

