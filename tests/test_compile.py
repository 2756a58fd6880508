"""optimize(compile=...): the plan honoured inside one torch.compile graph.

The compiled cases are ``slow`` (each compiles several graphs). They check the promises under
compile: no graph break in the planned step where ``torch.compile`` of the plain graph has none,
the measured compiled peak within the budget, and the same loss and gradients (dropout
included) as the compiled model without the planner, bit for bit on CPU.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from planner import optimize
from planner.compiled_plan import compile_backend_of
from planner.core.errors import InputError
from planner.core.plan import Plan, Segment
from profiling import StepInputs, measure_step_peak_bytes
from rewrite.compiled import MatmulsKeptSegment, OutputsKeptSegment, checkpointed_traceable, graph_break_count, traceable_segments
from rewrite.segments import checkpointed_call

FAST = {"timing_repeats": 1, "max_stages": 12}


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)
        self.drop = nn.Dropout(0.2)

    def forward(self, x):
        return x + self.drop(self.down(torch.nn.functional.gelu(self.up(self.norm(x)))))


def make_net(batch: int = 256, width: int = 32, blocks: int = 4):
    torch.manual_seed(0)
    model = nn.Sequential(*[Block(width) for _ in range(blocks)], nn.Linear(width, 3)).train()
    return model, (torch.randn(batch, width),)


def step_of(module, owner, inputs, seed: int):
    """Loss and gradients (by parameter name) of one step from ``seed``."""
    owner.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = module(*inputs).pow(2).mean()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in owner.named_parameters()}
    owner.zero_grad(set_to_none=True)
    return loss.detach(), grads


# ------------------------------------------------------------------ input errors (fast)

@pytest.mark.parametrize("options, words", [
    ({"compile": "", "budget_gb": 1.0}, "compile must be True, False or a torch.compile backend name"),
    ({"compile": 2, "budget_gb": 1.0}, "compile must be True, False or a torch.compile backend name"),
    ({"compile": True, "selective": True, "budget_gb": 1.0}, "does not take selective=True"),
    ({"compile": True, "chunk_loss": True, "budget_gb": 1.0}, "does not take chunk_loss=True"),
    ({"compile": True, "trace_method": "modules", "budget_gb": 1.0}, "pass trace_method='export'"),
])
def test_bad_compile_options_fail_in_one_line_before_any_work(options, words):
    model, inputs = make_net(batch=4)
    with pytest.raises(InputError, match=words) as err:
        optimize(model, inputs, **options)
    assert "\n" not in str(err.value)


def test_compile_where_torch_compile_cannot_run_says_so(monkeypatch):
    monkeypatch.setattr(torch._dynamo, "is_dynamo_supported", lambda: False)
    with pytest.raises(InputError, match="not supported on this platform.*pass compile=False"):
        compile_backend_of(True)


def test_compile_backend_names():
    assert compile_backend_of(False) is None
    assert compile_backend_of(True) == "inductor"
    assert compile_backend_of("aot_eager") == "aot_eager"


def test_summary_reports_the_graph_breaks_of_a_compiled_plan():
    plan = Plan(2**30, 2**29, 2**30, (Segment(("a", "b"), 1.0, 10),), 5.0, 20.0, 100, "chain DP", 0.1,
                measured_unoptimized_peak_bytes=2**29, measured_peak_bytes=2**28, compile_graph_breaks=2,
                compile_s=12.5)
    line = next(line for line in plan.summary().splitlines() if line.startswith("compiled"))
    assert "2 graph breaks" in line and "12.5 s" in line and "unoptimized 0.5000 GiB" in line
    eager = Plan(2**30, 2**29, 2**30, (), 5.0, 20.0, 100, "chain DP", 0.1)
    assert not any(line.startswith("compiled") for line in eager.summary().splitlines())


def test_traceable_segments_keep_matmul_outputs_by_operator_and_refuse_other_kept_outputs():
    from rewrite.segments import apply_plan
    from profiling.trace import trace_module
    from planner.core.errors import PlannerError

    model, inputs = make_net(batch=4, blocks=1)
    gm = trace_module(model, inputs)
    names = [n.name for n in gm.graph.nodes if n.op == "call_function"]
    plain = apply_plan(trace_module(model, inputs), Plan(0, 0, 0, (Segment(tuple(names[:3]), 0.0, 0),),
                                                           0.0, 0.0, 0, "none", 0.0))
    traceable_segments(plain)
    targets = [n.target for n in plain.graph.nodes if n.op == "call_function"]
    assert checkpointed_traceable in targets and checkpointed_call not in targets
    # a whole segment keeps the op that makes its output, as the eager step holds it
    (call,) = [n for n in plain.graph.nodes if n.op == "call_function" and n.target is checkpointed_traceable]
    whole = getattr(plain, call.args[0].target)
    assert isinstance(whole, OutputsKeptSegment)
    segment_ops = [str(gm.graph.find_nodes(op="call_function", target=n.target)[0].target)
                   for n in gm.graph.nodes if n.name in names[:3]]
    (kept_op,) = whole.kept_calls
    assert kept_op == segment_ops[-1] and whole.kept_calls[kept_op] == {segment_ops.count(kept_op) - 1}
    # run eagerly, the policy counts the forward's calls and the recompute's apart: the same step
    loss, grads = step_of(trace_module(model, inputs), model, inputs, seed=1)
    again, regrads = step_of(plain, model, inputs, seed=1)
    assert torch.equal(loss, again) and all(torch.equal(grads[n], regrads[n]) for n in grads)
    ops = {n.name: str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
    norm = next(name for name in names[:3] if "layer_norm" in ops[name])
    up = next(name for name in names[:3] if "linear" in ops[name])
    kept = apply_plan(trace_module(model, inputs), Plan(0, 0, 0, (Segment(tuple(names[:3]), 0.0, 0, kept_nodes=(norm,)),),
                                                        0.0, 0.0, 0, "none", 0.0))
    with pytest.raises(PlannerError, match="selective=False"):
        traceable_segments(kept)
    # keeping a matmul output: a policy by operator, which a compiled graph traces
    matmul = apply_plan(gm, Plan(0, 0, 0, (Segment(tuple(names[:3]), 0.0, 0, kept_nodes=(up,)),),
                                 0.0, 0.0, 0, "none", 0.0))
    traceable_segments(matmul)
    calls = [n for n in matmul.graph.nodes if n.op == "call_function" and n.target is checkpointed_traceable]
    assert len(calls) == 1 and checkpointed_call not in [n.target for n in matmul.graph.nodes]
    segment = getattr(matmul, calls[0].args[0].target)
    assert isinstance(segment, MatmulsKeptSegment)
    assert {"aten.linear.default", "aten.addmm.default", "aten.mm.default"} == set(segment.saved_ops)


# ------------------------------------------------------------------ compiled (slow)

@pytest.mark.slow
def test_compiled_plan_is_one_graph_within_budget_with_the_compiled_models_randomness():
    """aot_eager: the partitioner honours the checkpoints, no graph break where torch.compile of
    the eager plan breaks at every segment, the measured peak within the budget, and loss and
    gradients (dropout on) bitwise those of ``torch.compile(model)``."""
    torch._dynamo.reset()
    model, inputs = make_net()
    step_inputs = StepInputs.from_example(inputs)
    compiled_model = torch.compile(model, backend="aot_eager")
    before = graph_break_count()
    compiled_peak = measure_step_peak_bytes(compiled_model, step_inputs)   # first call compiles
    assert graph_break_count() == before
    compiled_peak = measure_step_peak_bytes(compiled_model, step_inputs)
    budget_gb = 0.7 * compiled_peak / 2**30
    opt = optimize(model, inputs, budget_gb=budget_gb, compile="aot_eager", **FAST)
    assert opt.plan.segments and opt.plan.compile_graph_breaks == 0
    assert opt.plan.measured_peak_bytes <= opt.plan.budget_bytes
    before = graph_break_count()
    assert measure_step_peak_bytes(opt, step_inputs) <= opt.plan.budget_bytes   # measured again here
    assert graph_break_count() == before   # no compile, no break at run time
    # the eager plan under torch.compile: a graph break at every segment
    eager_plan = optimize(model, inputs, budget_gb=budget_gb, **FAST)
    assert eager_plan.plan.segments
    before = graph_break_count()
    step_of(torch.compile(eager_plan, backend="aot_eager"), model, inputs, seed=1)
    assert graph_break_count() - before >= len(eager_plan.plan.segments)
    for seed in (3, 4):
        loss_a, grads_a = step_of(compiled_model, model, inputs, seed)
        loss_b, grads_b = step_of(opt, model, inputs, seed)
        assert torch.equal(loss_a, loss_b)
        assert all(torch.equal(grads_a[n], grads_b[n]) for n in grads_a)
    torch._dynamo.reset()


@pytest.mark.slow
def test_inductor_gpt2_plan_measures_within_budget_bitwise_with_dropout():
    """Inductor on a small HF GPT-2 (dropout 0.1): the planned compiled step has no graph break,
    measures within the budget, and its loss and gradients equal ``torch.compile(model)``'s bit
    for bit (Inductor's own random stream, the same in both)."""
    pytest.importorskip("transformers")
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    from models import gpt2

    torch._dynamo.reset()
    model, example = gpt2(batch=2, seq_len=64, layers=2, width=128, vocab=512)  # the layers peak, not the loss
    inputs = StepInputs.from_example(example)
    compiled_model = torch.compile(model)
    # 70 % of the eager peak: under the compiled unoptimized graph's peak, above the floor
    opt = optimize(model, example, budget_gb=0.7 * measure_step_peak_bytes(model, inputs) / 2**30, compile=True,
                   **FAST)
    assert opt.plan.segments and opt.plan.compile_graph_breaks == 0 and opt.plan.compile_split_before_loss
    assert measure_step_peak_bytes(opt, inputs) <= opt.plan.budget_bytes
    assert "0 graph breaks, split before the loss" in opt.plan.summary()

    def step(module, seed):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        loss = module(**example).loss
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        return loss.detach(), grads

    for seed in (1, 2):
        loss_a, grads_a = step(compiled_model, seed)
        loss_b, grads_b = step(opt, seed)
        assert torch.equal(loss_a, loss_b)
        assert all(torch.equal(grads_a[n], grads_b[n]) for n in grads_a)
    model.zero_grad(set_to_none=True)
    torch._dynamo.reset()


@pytest.mark.slow
def test_enable_passes_compile_on():
    """``planner.enable(model, compile=...)`` plans in place on the first batch, and the model's
    own forward then runs the compiled planned step (no graph break, the compiled model's loss)."""
    from planner.integrations.inplace import disable, enable, plan_of

    torch._dynamo.reset()
    model, inputs = make_net()
    reference, _ = step_of(torch.compile(model, backend="aot_eager"), model, inputs, seed=5)
    peak = measure_step_peak_bytes(torch.compile(model, backend="aot_eager"), StepInputs.from_example(inputs))
    enable(model, budget_gb=0.7 * peak / 2**30, compile="aot_eager", **FAST)
    try:
        step_of(model, model, inputs, seed=1)   # plans and compiles
        plan = plan_of(model)
        assert plan.segments and plan.compile_graph_breaks == 0
        before = graph_break_count()
        loss, _ = step_of(model, model, inputs, seed=5)
        assert graph_break_count() == before and torch.equal(loss, reference)
    finally:
        disable(model)
        torch._dynamo.reset()


# ------------------------------------------------------------------ hand-placed plans beside the search's (fast)

def _hand_choice(best_segments: int, peaks: dict[str, int], times_ms: tuple[float, float], room: int = 800):
    """``_with_hand_plans`` on a four-layer chain, with each plan's compiled peak looked up by its
    label in ``peaks`` and the two timed steps given: the plans measured, and the one chosen."""
    from planner.compiled_aim import PeakPair
    from planner.compiled_plan import _with_hand_plans
    from planner.core.simulate import simulate
    from test_compiled_aim import _four_layers

    graph = _four_layers()
    search = Plan(room, 700, 1100, tuple(Segment((f"n{i}",), 1.0, 100) for i in range(1, 1 + best_segments)),
                  8.0, 20.0, 0, "search", 0.0, measured_peak_bytes=780)
    measured_labels: list[str] = []

    def measured(plan):
        measured_labels.append(plan.solver)
        return (f"module of {plan.solver}", Plan(**{**plan.__dict__, "measured_peak_bytes": peaks[plan.solver]}),
                peaks[plan.solver])

    timed: list[list[str]] = []

    def step_times_ms(modules):
        timed.append(modules)
        return [[t] for t in times_ms]

    pairs = [PeakPair(simulate(graph).peak_bytes, 900)]
    best = None if best_segments == 0 else ("module of search", search)
    chosen = _with_hand_plans(best, graph, pairs, room, room, 900, measured, step_times_ms)
    return measured_labels, timed, chosen


def test_a_hand_plan_that_fits_and_steps_faster_replaces_the_search_plan():
    peaks = {"hand-placed: every 3rd layer": 790, "hand-placed: every layer": 700}
    measured, timed, chosen = _hand_choice(6, peaks, (12.0, 10.0))
    assert measured == ["hand-placed: every 3rd layer"]  # the first that fits ends the search
    assert timed == [["module of search", "module of hand-placed: every 3rd layer"]]
    assert chosen[1].solver == "hand-placed: every 3rd layer" and chosen[1].measured_peak_bytes == 790


def test_the_search_plan_stays_where_it_steps_faster_and_a_hand_plan_over_the_room_is_passed_over():
    peaks = {"hand-placed: every 3rd layer": 850, "hand-placed: every layer": 700}
    measured, timed, chosen = _hand_choice(6, peaks, (9.0, 10.0))
    assert measured == ["hand-placed: every 3rd layer", "hand-placed: every layer"]
    assert chosen[1].solver == "search" and len(timed) == 1


def test_within_the_timing_tolerance_the_hand_plan_is_taken():
    from planner.compiled_plan import COMPILED_TIME_TOLERANCE

    peaks = {"hand-placed: every 3rd layer": 790}
    faster_by_less = 10.0 * (1 - COMPILED_TIME_TOLERANCE / 2)
    assert _hand_choice(6, peaks, (faster_by_less, 10.0))[2][1].solver == "hand-placed: every 3rd layer"


def test_the_search_plan_faster_by_more_than_the_tolerance_stays():
    from planner.compiled_plan import COMPILED_TIME_TOLERANCE

    peaks = {"hand-placed: every 3rd layer": 790}
    faster_by_more = 10.0 * (1 - 1.5 * COMPILED_TIME_TOLERANCE)
    assert _hand_choice(6, peaks, (faster_by_more, 10.0))[2][1].solver == "search"


def test_with_no_search_plan_in_the_room_the_first_hand_plan_that_fits_is_taken_untimed():
    peaks = {"hand-placed: every 3rd layer": 790, "hand-placed: every layer": 700}
    measured, timed, chosen = _hand_choice(0, peaks, (1.0, 1.0))
    assert chosen[1].solver == "hand-placed: every 3rd layer" and timed == []


def test_compiled_step_times_ms_times_each_module_each_round_and_leaves_gradients_as_they_were():
    from rewrite.compiled import compile_step, compiled_step_times_ms
    from rewrite.segments import apply_plan, module_copy
    from profiling.trace import trace_module

    model, inputs = make_net(batch=32, width=16, blocks=2)
    gm = trace_module(model, inputs)
    names = [n.name for n in gm.graph.nodes if n.op == "call_function"]
    plain = module_copy(gm)
    planned = apply_plan(module_copy(gm), Plan(0, 0, 0, (Segment(tuple(names[:3]), 0.0, 0),), 0.0, 0.0, 0, "t", 0.0))
    step_inputs = StepInputs.from_example(inputs)
    for module in (plain, planned):
        compile_step(module, step_inputs, backend="eager")
    model.zero_grad(set_to_none=True)
    times = compiled_step_times_ms([plain, planned], step_inputs, rounds=3)
    assert len(times) == 2 and all(len(t) == 3 and all(ms > 0 for ms in t) for t in times)
    assert all(p.grad is None for p in model.parameters())
    torch._dynamo.reset()


@pytest.mark.slow
def test_a_plan_keeping_matmul_outputs_compiles_to_one_graph_bitwise_below_the_compiled_peak():
    """A hand-placed plan recomputing its first segment whole and keeping the matmul outputs of
    the others, compiled with Inductor: no graph break, a lower measured peak than
    ``torch.compile(model)``'s, and the same loss and gradients bit for bit, dropout included
    (the recomputed pointwise ops draw Inductor's stream as the compiled model does)."""
    from planner.capture_options import CaptureOptions
    from planner.compiled_aim import _partly_kept
    from planner.planning_steps import PlanningSteps
    from planner.solvers.hand_policies import hand_placed_plans
    from rewrite.compiled import compiled_step_peak_bytes
    from rewrite.segments import apply_plan

    torch._dynamo.reset()
    model, inputs = make_net(batch=256, width=32, blocks=4)
    steps = PlanningSteps(model, inputs, budget_gb=1.0, capture_options=CaptureOptions(timing_repeats=1))
    gm = steps.capture()
    hands = hand_placed_plans(steps.profile(gm))
    hand = next(h for h in _partly_kept(hands) if h.name.startswith("every layer, matmul outputs kept in the last"))
    kept = [bool(s.kept_nodes) for s in hand.segments]
    assert kept[0] is False and all(kept[1:]) and len(kept) >= 4  # the first recomputed whole
    planned = apply_plan(gm, Plan(0, 0, 0, hand.segments, 0.0, 0.0, 0, "none", 0.0))
    step_inputs = StepInputs.from_example(inputs)
    run, planned_peak = compiled_step_peak_bytes(planned, step_inputs)
    compiled_model = torch.compile(model)
    assert run.graph_breaks == 0
    assert planned_peak < measure_step_peak_bytes(compiled_model, step_inputs)
    for seed in (1, 2):
        loss_a, grads_a = step_of(compiled_model, model, inputs, seed)
        loss_b, grads_b = step_of(run.module, model, inputs, seed)
        assert torch.equal(loss_a, loss_b)
        assert all(torch.equal(grads_a[n], grads_b[n]) for n in grads_a)
    torch._dynamo.reset()


def test_a_compiled_plan_over_the_room_is_compiled_again_with_plain_checkpoint_tags():
    """Whole segments keep their outputs compiled; where that measures over the room, the plan is
    compiled once more with plain tags and the lower measurement (and its module) is kept."""
    from planner.compiled_plan import compiled_and_measured

    plan = Plan(100, 90, 200, (Segment(("a",), 1.0, 10),), 1.0, 2.0, 0, "search", 0.0)
    compiled: list[bool] = []

    def run(peaks):
        compiled.clear()

        def peak_of(module, keep):
            compiled.append(keep)
            return peaks[keep]
        return compiled_and_measured(plan, lambda p: object(), 100, peak_of)

    _, within, aimed_by = run({True: 99, False: 50})
    assert compiled == [True] and within.measured_peak_bytes == aimed_by == 99  # within the room: compiled once
    _, over, aimed_by = run({True: 120, False: 95})
    # the lower measurement is the plan's; the search aims by the outputs-kept one, its other plans' mode
    assert compiled == [True, False] and over.measured_peak_bytes == 95 and aimed_by == 120
    _, both_over, aimed_by = run({True: 120, False: 130})
    assert compiled == [True, False] and both_over.measured_peak_bytes == aimed_by == 120
    kept_only = dataclasses.replace(plan, segments=(Segment(("a",), 1.0, 10, kept_nodes=("a",)),))
    compiled.clear()
    compiled_and_measured(kept_only, lambda p: object(), 100, lambda m, keep: compiled.append(keep) or 120)
    assert compiled == [True]  # no whole segment: nothing to compile differently


# ------------------------------------------------------------------ plans at the eager floor (fast)

def test_floor_variants_compile_new_plans_until_one_fits():
    """Where the floor's own plan measured over the room, plans at the same floor solved on varied
    node times are compiled, skipping any compiled before or infeasible, until one fits."""
    from planner.compiled_aim import MAX_FLOOR_VARIANTS, PeakPair, plan_structure
    from planner.compiled_plan import _floor_variant
    from planner.core.errors import InfeasibleBudgetError
    from test_compiled_aim import _four_layers

    def plan_of(*names):
        return Plan(800, 790, 1100, tuple(Segment((n,), 1.0, 100) for n in names), 8.0, 20.0, 0, "search", 0.0)

    floor_plan = plan_of("n1", "n3")
    by_call = [floor_plan, None, plan_of("n2", "n4"), plan_of("n1", "n4"), plan_of("n2", "n3")]
    floors: list[int] = []

    def solve_for(eager_bytes, costs):
        floors.append(eager_bytes)
        plan = by_call[len(floors) - 1]
        if plan is None:
            raise InfeasibleBudgetError(800, 900)
        return plan

    peaks = {plan_structure(plan_of("n2", "n4").segments): 850, plan_structure(plan_of("n1", "n4").segments): 790}
    measured_plans: list[Plan] = []

    def measured(plan):
        measured_plans.append(plan)
        peak = peaks[plan_structure(plan.segments)]
        return f"module {len(measured_plans)}", dataclasses.replace(plan, measured_peak_bytes=peak), peak

    pairs = [PeakPair(1100, 900)]
    compiled_before = {plan_structure(floor_plan.segments)}
    module, plan = _floor_variant(790, solve_for, _four_layers(), compiled_before, measured, pairs, 800)
    assert floors == [790] * 4  # the floor's plan again and an infeasible variant are passed over
    assert [plan_structure(p.segments) for p in measured_plans] == [
        plan_structure(plan_of("n2", "n4").segments), plan_structure(plan_of("n1", "n4").segments)]
    assert module == "module 2" and plan.measured_peak_bytes == 790 and len(pairs) == 3

    # none fits: at most MAX_FLOOR_VARIANTS new plans are compiled, and None is returned
    distinct = iter(range(100))

    def over_the_room(plan):
        return "module", dataclasses.replace(plan, measured_peak_bytes=900), 900

    over = _floor_variant(790, lambda eager_bytes, costs: plan_of(f"n{next(distinct)}"), _four_layers(), set(),
                          over_the_room, [], 800)
    assert over is None and next(distinct) == MAX_FLOOR_VARIANTS
