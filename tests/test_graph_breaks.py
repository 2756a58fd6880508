"""The graph-break path: models torch.export cannot capture, planned over the ATen ops of their step."""

from __future__ import annotations

import copy
import io
import sys
from pathlib import Path

import pytest
import torch

from planner import optimize
from planner.graph_break_plan import plan_graph_breaks
from profiling.graph_breaks import profile_op_stream
from profiling.measure import StepInputs, measure_step_flops, measure_step_peak_bytes
from rewrite.graph_breaks import BreakCheckpointedModule
from rewrite.op_regions import RegionRunner

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from graph_break_models import build  # noqa: E402


def _step(module, params, x, seed=5):
    for p in params:
        p.grad = None
    torch.manual_seed(seed)
    loss = module(x).sum()
    loss.backward()
    return loss.detach().clone(), [p.grad.clone() for p in params]


def _same(a, b):
    return torch.equal(a[0], b[0]) and all(torch.equal(x, y) for x, y in zip(a[1], b[1]))


def _op_count(model, x):
    with RegionRunner(()) as runner:
        model(x)
    return runner.op_count


@pytest.mark.parametrize("name", ["item_branch", "nonzero_moe", "numpy_scale", "data_loop"])
def test_any_op_ranges_replay_bit_for_bit(name):
    """Whole forward, halves, and short ranges that cut layers and breaks anywhere."""
    model, (x,) = build(name, width=16, tokens=64, layers=3)
    params = list(model.parameters())
    reference = _step(model, params, x)
    torch.manual_seed(5)
    n = _op_count(model, x)
    for regions in [((0, n - 1),), ((0, n // 2), (n // 2 + 1, n - 1)), tuple((i, i + 4) for i in range(1, n - 5, 6))]:
        planned = BreakCheckpointedModule(model, None, regions)
        assert _same(reference, _step(planned, params, x)), regions
        assert sum(r.replayed_ops for r in planned.last_runner.opened) > 0  # the backward replayed ops


def test_a_plan_without_ranges_runs_the_model_without_a_dispatch_mode():
    """Nothing to checkpoint: the model runs as it is, with no mode counting its ops (the
    captured-with-nothing-recomputed step pays nothing for the path)."""
    model, (x,) = build("item_branch", width=16, tokens=64, layers=3)
    depths = []
    hook = model.register_forward_pre_hook(lambda *_: depths.append(torch._C._len_torch_dispatch_stack()))
    try:
        params = list(model.parameters())
        reference = _step(model, params, x)
        empty = BreakCheckpointedModule(model, None, ())
        assert _same(reference, _step(empty, params, x)) and empty.last_runner is None
        _step(BreakCheckpointedModule(model, None, ((0, 3),)), params, x)
    finally:
        hook.remove()
    assert depths == [0, 0, 1]


def test_a_range_recomputes_what_it_saved_and_frees_it_in_the_forward():
    model, (x,) = build("item_branch", width=32, tokens=512, layers=4)
    inputs = StepInputs.from_example((x,))
    n = _op_count(model, x)
    quarters = BreakCheckpointedModule(model, None, tuple((k * n // 4, (k + 1) * n // 4 - 1) for k in range(4)))
    assert measure_step_peak_bytes(quarters, inputs) < 0.8 * measure_step_peak_bytes(model, inputs)
    assert measure_step_flops(quarters, inputs) > measure_step_flops(model, inputs)


def test_batch_norm_statistics_and_python_side_effects_happen_once():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)
            self.bn = torch.nn.BatchNorm1d(8)
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            h = self.bn(self.lin(x))
            if h.mean().item() > -10:  # a break between the two halves
                h = torch.tanh(h)
            return self.bn(h * 2)

    torch.manual_seed(0)
    model, x = Net().train(), torch.randn(16, 8)
    reference = copy.deepcopy(model)
    n = _op_count(copy.deepcopy(model), x)
    planned = BreakCheckpointedModule(model, None, ((0, n - 1),))
    for module in (reference, planned):
        torch.manual_seed(1)
        module(x).sum().backward()
    assert model.calls == 1 and model.bn.num_batches_tracked.item() == reference.bn.num_batches_tracked.item() == 2
    assert torch.equal(model.bn.running_mean, reference.bn.running_mean)
    assert torch.equal(model.bn.running_var, reference.bn.running_var)
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), reference.parameters()))


def test_a_range_that_writes_a_tensor_it_read_keeps_its_saved_tensors():
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8)
    buf = torch.zeros(4, 8)
    with RegionRunner(((0, 5),)) as runner:
        y = torch.tanh(x @ w)
        z = torch.tanh(y + buf)
        buf.add_(1.0)  # the range writes a tensor it read: a replay would read the new value
        z = torch.tanh(z)
    z.sum().backward()
    assert any(r.hold_reason for r in runner.opened)
    grad = w.grad.clone()
    w.grad = None
    buf.zero_()
    torch.tanh(torch.tanh(torch.tanh(x @ w) + buf)).sum().backward()
    assert torch.equal(grad, w.grad)


def test_the_profile_counts_breaks_and_python_made_tensors():
    model, (x,) = build("item_branch", width=16, tokens=32, layers=3)
    graph = profile_op_stream(model, (x,), timing_repeats=1)
    assert graph.metadata["capture"] == "graph-breaks" and graph.metadata["subgraphs"] == 4  # one .item() a layer
    numpy_model, (x,) = build("numpy_scale", width=16, tokens=32, layers=2)
    graph = profile_op_stream(numpy_model, (x,), timing_repeats=1)
    entries = [n for n in graph.compute_nodes if n.op == "aten.lift_fresh.default"]  # torch.from_numpy
    assert len(entries) == 2 and graph.metadata["subgraphs"] == 3
    assert graph.measured_peak_bytes == measure_step_peak_bytes(numpy_model, StepInputs.from_example((x,)))


def test_optimize_plans_an_uncapturable_model_through_its_breaks():
    model, (x,) = build("item_branch", width=32, tokens=512, layers=4)
    inputs = StepInputs.from_example((x,))
    peak_bytes = measure_step_peak_bytes(model, inputs)
    reference = _step(model, list(model.parameters()), x)
    opt = optimize(model, (x,), budget_gb=0.5 * peak_bytes / 2**30, timing_repeats=1)
    assert isinstance(opt, BreakCheckpointedModule) and opt.plan.capture == "graph-breaks"
    assert opt.plan.subgraphs == 5 and "graph-breaks" in opt.plan.summary()
    assert measure_step_peak_bytes(opt, inputs) <= 0.5 * peak_bytes
    assert _same(reference, _step(opt, list(model.parameters()), x))
    assert list(opt.state_dict()) == list(model.state_dict())
    buffer = io.BytesIO()
    torch.save(opt, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert loaded.plan == opt.plan and loaded.regions == opt.regions
    assert _same(_step(loaded.original, list(loaded.parameters()), x), _step(loaded, list(loaded.parameters()), x))


def test_a_graph_break_plan_prices_each_recorded_op_of_its_ranges():
    """The op-stream profile carries the measured cost of recording and replaying an op in a
    range, and every recomputed segment of the plan is priced with it for each of its nodes."""
    model, (x,) = build("item_branch", width=32, tokens=256, layers=4)
    peak_bytes = measure_step_peak_bytes(model, StepInputs.from_example((x,)))
    opt = plan_graph_breaks(model, (x,), 0.75 * peak_bytes / 2**30, timing_repeats=1)
    per_node_ms = opt.cost_graph.range_overhead_ms_per_node
    assert per_node_ms > 0 and opt.plan.segments
    assert all(s.recompute_ms >= per_node_ms * len(s.node_names) for s in opt.plan.segments)


@pytest.mark.slow
def test_other_shapes_are_planned_again_and_other_branches_stay_exact():
    model, (x,) = build("item_branch", width=32, tokens=512, layers=4)
    peak_bytes = measure_step_peak_bytes(model, StepInputs.from_example((x,)))
    opt = plan_graph_breaks(model, (x,), 0.6 * peak_bytes / 2**30, timing_repeats=1)
    params = list(model.parameters())
    other = torch.randn(256, 32) * 3 - 1  # another shape, other branches
    assert _same(_step(model, params, other), _step(opt, params, other))
    assert len(opt._plans) == 2
    assert measure_step_peak_bytes(opt, StepInputs.from_example((other,))) <= 0.6 * peak_bytes
    flipped = -x  # the example's shape: the plan is reused, its ranges guarded op by op
    assert _same(_step(model, params, flipped), _step(opt, params, flipped))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["item_branch", "nonzero_moe", "numpy_scale", "data_loop"])
def test_each_break_cause_plans_at_half_its_peak_bit_for_bit(name):
    model, (x,) = build(name, width=32, tokens=512, layers=4)
    inputs = StepInputs.from_example((x,))
    peak_bytes = measure_step_peak_bytes(model, inputs)
    reference = _step(model, list(model.parameters()), x)
    opt = optimize(model, (x,), budget_gb=0.5 * peak_bytes / 2**30, timing_repeats=1)
    assert opt.plan.capture == "graph-breaks"
    assert measure_step_peak_bytes(opt, inputs) <= 0.5 * peak_bytes
    assert _same(reference, _step(opt, list(model.parameters()), x))


def test_the_module_path_checkpoints_a_loop_body_over_several_lists_as_one_run():
    """Each call alone (a LayerNorm, a Linear) saves about what it holds anyway; the loop body
    ln[i], fc1[i], fc2[i] with the Python between them, checkpointed as one unit, meets half the peak."""
    model, (x,) = build("item_branch", width=32, tokens=512, layers=4)
    inputs = StepInputs.from_example((x,))
    peak_bytes = measure_step_peak_bytes(model, inputs)
    reference = _step(model, list(model.parameters()), x)
    opt = optimize(model, (x,), budget_gb=0.5 * peak_bytes / 2**30, trace_method="modules", timing_repeats=1)
    assert opt.plan.capture == "modules" and opt.checkpointed
    assert set(opt.checkpointed) <= {f"run:ln.{i}..fc2.{i}" for i in range(4)}
    assert measure_step_peak_bytes(opt, inputs) <= 0.5 * peak_bytes
    assert _same(reference, _step(opt, list(model.parameters()), x))



@pytest.mark.slow
def test_a_refusal_names_the_floor_the_smallest_peak_plan_measured_where_the_prediction_ran_low():
    from planner import InfeasibleBudgetError
    from planner.core.options import PlanOptions
    from planner.graph_break_plan import _fitting_on_measurement, graph_break_plan

    model, (x,) = build("item_branch", width=32, tokens=512, layers=4)
    graph = profile_op_stream(model, (x,), timing_repeats=1)
    options = PlanOptions(reserve_gb=2**20 / 2**30)
    with pytest.raises(InfeasibleBudgetError) as caught:
        graph_break_plan(graph, 2 * 2**20 / 2**30, options)   # far below anything: the solver names its floor
    floor_bytes = caught.value.min_feasible_bytes
    budget_bytes = int(floor_bytes * 0.99)
    refusal = InfeasibleBudgetError(budget_bytes, floor_bytes, None, graph.measured_peak_bytes)
    measured_bytes = floor_bytes + 3 * 2**20   # every plan's step measures 3 MiB above the floor

    def measured(plan):
        return (), measured_bytes

    needed = _fitting_on_measurement(graph, budget_bytes / 2**30, options, refusal, measured, budget_bytes)
    assert needed == measured_bytes + 2**20   # the smallest-peak plan's measured peak and the reserve

    def fits(plan):
        return (), budget_bytes

    plan, _ = _fitting_on_measurement(graph, budget_bytes / 2**30, options, refusal, fits, budget_bytes)
    assert plan.measured_peak_bytes == budget_bytes

    # a budget far below the floor: no plan is tried for it, but the floor named is still the
    # smallest-peak plan's measured need where that is above the prediction, and the solver's
    # floor where it is not
    far_bytes = floor_bytes // 2
    far = InfeasibleBudgetError(far_bytes, floor_bytes, None, graph.measured_peak_bytes)
    assert _fitting_on_measurement(graph, far_bytes / 2**30, options, far, measured, far_bytes) == \
        measured_bytes + 2**20
    assert _fitting_on_measurement(graph, far_bytes / 2**30, options, far, lambda plan: ((), 0), far_bytes) is None


class _TanhGelu(torch.autograd.Function):
    """A GELU written as a custom Function, as some model families write theirs: the forward saves
    its input, the backward recomputes the tanh with several temporaries of the input's size."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        tanh_out = torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x))
        ff = 0.5 * x * ((1 - tanh_out * tanh_out) * (0.79788456 + 0.1070322243 * x * x)) + 0.5 * (1 + tanh_out)
        return ff * grad


class _FunctionMLP(torch.nn.Module):
    def __init__(self, width=32, hidden=128, layers=3):
        super().__init__()
        self.ln = torch.nn.ModuleList(torch.nn.LayerNorm(width) for _ in range(layers))
        self.up = torch.nn.ModuleList(torch.nn.Linear(width, hidden) for _ in range(layers))
        self.down = torch.nn.ModuleList(torch.nn.Linear(hidden, width) for _ in range(layers))

    def forward(self, x):
        for ln, up, down in zip(self.ln, self.up, self.down):
            x = x + down(_TanhGelu.apply(up(ln(x))))
        return x


def test_a_custom_functions_backward_and_its_saved_input_belong_to_the_op_that_made_its_output():
    """The Function's autograd node is made before its forward's ops, which run without grad: its
    backward's temporaries, and the input it saves after them, are counted where the gradient
    reaches it (the op that made its output), not on its first op."""
    torch.manual_seed(0)
    model, x = _FunctionMLP(layers=1), torch.randn(512, 32)
    graph = profile_op_stream(model, (x,), timing_repeats=1)
    hidden_bytes = 512 * 128 * 4
    inside = [n for n in graph.compute_nodes if n.module == "" and not n.requires_grad and n.name.startswith("op")]
    made_output = next(n for n in graph.compute_nodes if n.requires_grad and n.name.startswith("op")
                       and graph.compute_nodes.index(n) > graph.compute_nodes.index(inside[-1]))
    assert made_output.backward_peak_bytes >= 4 * hidden_bytes   # the backward's temporaries and the saved input
    assert all(n.backward_peak_bytes == 0 for n in inside)


@pytest.mark.parametrize("fraction", [0.5, 0.6, 0.7])
def test_plans_of_a_model_with_a_custom_function_are_predicted_within_two_percent(fraction):
    from planner.graph_break_plan import graph_break_plan
    from planner import InfeasibleBudgetError

    torch.manual_seed(0)
    model, x = _FunctionMLP(), torch.randn(512, 32)
    inputs = StepInputs.from_example((x,))
    graph = profile_op_stream(model, (x,), timing_repeats=1)
    try:
        plan = graph_break_plan(graph, fraction * graph.measured_peak_bytes / 2**30)
    except InfeasibleBudgetError as refusal:   # the floor it names plans
        plan = graph_break_plan(graph, refusal.min_feasible_bytes / 2**30)
    from rewrite.graph_breaks import segment_regions
    probe = BreakCheckpointedModule(model, plan, segment_regions(plan))
    measured = measure_step_peak_bytes(probe, inputs)
    assert plan.segments
    assert abs(plan.predicted_peak_bytes / measured - 1) <= 0.02, (plan.predicted_peak_bytes, measured)


def test_a_model_with_a_custom_function_plans_at_three_quarters_of_its_peak_bit_for_bit():
    torch.manual_seed(0)
    model, x = _FunctionMLP(), torch.randn(512, 32)
    inputs = StepInputs.from_example((x,))
    peak_bytes = measure_step_peak_bytes(model, inputs)
    reference = _step(model, list(model.parameters()), x)
    opt = plan_graph_breaks(model, (x,), 0.75 * peak_bytes / 2**30, timing_repeats=1)
    assert opt.plan.segments and measure_step_peak_bytes(opt, inputs) <= 0.75 * peak_bytes
    assert _same(reference, _step(opt, list(model.parameters()), x))


class _LeafInput(torch.nn.Module):
    """A first layer whose input is made a leaf that requires grad, as wav2vec2's feature
    encoder does for checkpointing, then two convolutions."""

    def __init__(self) -> None:
        super().__init__()
        self.convs = torch.nn.ModuleList(torch.nn.Conv1d(c, 8, 3) for c in (1, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x[:, None]
        h.requires_grad = True
        for conv in self.convs:
            h = torch.relu(conv(h))
        return h.sum()


def test_the_profiled_op_stream_is_the_stream_a_plain_forward_dispatches():
    """The rewrite checkpoints ranges by op numbers counted in the plain forward: the profile
    must number the same ops (the FLOP counter's module hooks add none)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from profiling.op_counting import UNCOUNTED_OPS

    class Dispatched(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if str(func) not in UNCOUNTED_OPS:
                self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    model, x = _LeafInput().train(), torch.randn(4, 64)
    graph = profile_op_stream(model, (x,), timing_repeats=1)
    plain = Dispatched()
    with plain:
        model(x)
    assert graph.metadata["op_names"] == plain.ops


def test_an_op_stream_profile_is_kept_and_read_back_by_its_recorded_ops(tmp_path):
    """optimize with a cache folder: a second call on the same model reads the profile the first
    stored (same nodes, so the same plan), and the same model on another input shape, whose ops
    differ, is profiled anew."""
    model, (x,) = build("item_branch", width=32, tokens=256, layers=4)
    budget_gb = 0.75 * measure_step_peak_bytes(model, StepInputs.from_example((x,))) / 2**30
    first = optimize(model, (x,), budget_gb=budget_gb, trace_method="graph-breaks", timing_repeats=1,
                     cache_dir=str(tmp_path))
    again = optimize(model, (x,), budget_gb=budget_gb, trace_method="graph-breaks", timing_repeats=1,
                     cache_dir=str(tmp_path))
    assert first.cost_graph.metadata["cache"] == "miss" and again.cost_graph.metadata["cache"] == "hit"
    assert again.cost_graph.nodes == first.cost_graph.nodes
    assert again.plan.segments == first.plan.segments and again.regions == first.regions
    other = profile_op_stream(model, (x[:128],), timing_repeats=1, cache_dir=str(tmp_path))
    assert other.metadata["cache"] == "miss"
    assert other.metadata["fingerprint"] != first.cost_graph.metadata["fingerprint"]
    assert len(list(tmp_path.glob("*.json"))) == 2


@pytest.mark.slow
def test_where_the_budgets_plan_measures_far_over_the_smallest_peak_plan_is_measured_before_refusing(
        monkeypatch, tmp_path):
    """The plan solved for the budget measures far above its prediction, so that no plan fits
    once the overshoot is held; the smallest-peak plan, measured next, fits and is returned."""
    import planner.graph_break_plan as gbp
    from planner.core.options import PlanOptions

    model, (x,) = build("item_branch", width=32, tokens=256, layers=2)
    options = PlanOptions()
    graph = profile_op_stream(model, (x,), timing_repeats=1, cache_dir=str(tmp_path))
    floor = gbp._smallest_peak_plan(graph, options)
    assert floor is not None and floor.segments
    budget_gb = 1.3 * floor.budget_bytes / 2**30
    measured: list[int] = []

    def fake_peak_bytes(module, inputs, step=None):
        predicted = module.plan.predicted_peak_bytes
        measured.append(predicted)
        return int(budget_gb * 2**30) + 2**30 if len(measured) == 1 else predicted

    monkeypatch.setattr(gbp, "measure_step_peak_bytes", fake_peak_bytes)
    plan, regions = gbp._planned(model, StepInputs.from_example((x,)), graph, budget_gb, options, None)
    assert len(measured) == 2   # the budget's plan, then the smallest-peak plan
    assert plan.predicted_peak_bytes == measured[1] == floor.predicted_peak_bytes
    assert plan.measured_peak_bytes == floor.predicted_peak_bytes and plan.budget_bytes == int(budget_gb * 2**30)
    assert regions == gbp.segment_regions(plan)


class _Layer(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.ln = torch.nn.LayerNorm(width)
        self.fc1 = torch.nn.Linear(width, 4 * width)
        self.fc2 = torch.nn.Linear(4 * width, width)
        self.drop = torch.nn.Dropout(0.1)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.drop(self.fc2(torch.tanh(self.fc1(self.ln(h)))))


class _LayersWithABreak(torch.nn.Module):
    """Layers as the children of one module list, and an ``.item()`` branch between them."""

    def __init__(self, width: int = 32, layers: int = 4) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(_Layer(width) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
            if x.abs().max().item() > 1e6:
                x = x * 0.5
        return x


def _layers_and_budgets() -> tuple[torch.nn.Module, torch.Tensor, float, float]:
    """The model, its input, a budget a little above every layer checkpointed as a module call,
    and 80 % of the unoptimized step's peak (GiB)."""
    from rewrite.module_checkpoint import ModuleCheckpointedModule

    torch.manual_seed(0)
    model, x = _LayersWithABreak().train(), torch.randn(8, 256, 32)
    inputs = StepInputs.from_example((x,))
    every_layer = ModuleCheckpointedModule(model, None, tuple(f"layers.{i}" for i in range(4)))
    return (model, x, 1.1 * measure_step_peak_bytes(every_layer, inputs) / 2**30,
            0.8 * measure_step_peak_bytes(model, inputs) / 2**30)


@pytest.mark.parametrize("case", ["op ranges dearer", "op ranges refused", "op ranges cheaper"])
def test_whole_layers_run_as_module_calls_where_the_op_ranges_cost_more_or_find_no_plan(monkeypatch, case):
    """Where each recorded op of a range costs much (here 1 ms, set), every layer checkpointed
    as a module call is predicted cheaper than the op ranges, measured within the budget and
    returned, bit for bit; so it is where the op ranges find no plan for the budget (here made
    to refuse). Where recording costs nothing, the solved op ranges are never dearer than every
    layer, and they are returned."""
    import planner.graph_break_plan as graph_break_plan
    from planner.core.errors import InfeasibleBudgetError

    monkeypatch.setattr(graph_break_plan, "measured_range_overhead_ms_per_op",
                        lambda device: 1.0 if case == "op ranges dearer" else 0.0)
    if case == "op ranges refused":
        def refused(model, inputs, graph, budget_gb, options, step):
            raise InfeasibleBudgetError(int(budget_gb * 2**30), 2**40)

        monkeypatch.setattr(graph_break_plan, "_planned", refused)
    model, x, above_every_layer_gb, most_gb = _layers_and_budgets()
    budget_gb = most_gb if case == "op ranges cheaper" else above_every_layer_gb
    opt = plan_graph_breaks(model, (x,), budget_gb, timing_repeats=1)
    assert opt.plan.measured_peak_bytes <= budget_gb * 2**30
    params = list(model.parameters())
    assert _same(_step(model, params, x), _step(opt, params, x))
    if case == "op ranges cheaper":
        assert isinstance(opt, BreakCheckpointedModule) and opt.plan.capture == "graph-breaks"
    else:
        assert opt.plan.solver == "hand-placed (module calls): every layer" and opt.plan.capture == "modules"
        assert opt.checkpointed == tuple(f"layers.{i}" for i in range(4))


def test_a_range_ending_on_an_op_that_saves_its_output_is_predicted_with_that_save_held():
    """What is saved after a range's last op stays a tensor (the next op's saved input cannot be
    told from it): a range ending on a ReLU keeps the ReLU's output to its backward, which the
    prediction counts (``range_end_saves_held``) and the measured step shows."""
    import dataclasses

    from planner.core.plan import Plan, Segment
    from planner.core.simulate import simulate
    from rewrite.graph_breaks import segment_regions

    torch.manual_seed(0)
    # the dropout after each ReLU saves its mask, not the ReLU's output: only the ReLU saves that
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(1024, 1024), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(1024, 256))
    x = torch.randn(512, 256)
    graph = profile_op_stream(model, (x,), timing_repeats=1)
    names = [n.name for n in graph.nodes if n.kind == "compute"]
    first = next(i for i, name in enumerate(names) if name.endswith("_addmm"))
    last = next(i for i, name in enumerate(names) if i > first and name.endswith("_relu"))
    segment = Segment(tuple(names[first:last + 1]), recompute_ms=0.0, recompute_flops=0)
    held = simulate(dataclasses.replace(graph, range_end_saves_held=True), [segment]).peak_bytes
    freed = simulate(dataclasses.replace(graph, range_end_saves_held=False), [segment]).peak_bytes
    plan = Plan(budget_bytes=held, predicted_peak_bytes=held, unoptimized_peak_bytes=graph.measured_peak_bytes,
                segments=(segment,), forward_ms=0.0, step_ms=0.0, forward_flops=0, solver="test", solve_s=0.0)
    measured = measure_step_peak_bytes(BreakCheckpointedModule(model, plan, segment_regions(plan),
                                                               expected_ops=graph.metadata.get("op_names")),
                                       StepInputs.from_example((x,)))
    assert held - freed >= 2 * 2**20  # the ReLU's 2 MiB output, held to its backward
    assert measured >= freed + 2**20, (measured, held, freed)  # the step does hold it
    assert abs(measured - held) <= 0.03 * held, (measured, held, freed)


def test_a_range_ending_on_an_op_that_saves_its_inputs_recomputes_them():
    """The inputs a range's last op saves are saved before it runs, inside the range: a range
    ending on a linear recomputes the ReLU output the linear saves, and the prediction (which
    holds only the last op's saved outputs, ``range_end_saves_held``) matches the measured step."""
    import dataclasses

    from planner.core.plan import Plan, Segment
    from planner.core.simulate import simulate
    from rewrite.graph_breaks import segment_regions

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512),
                                torch.nn.ReLU(), torch.nn.Linear(512, 64))
    x = torch.randn(4096, 64)
    graph = dataclasses.replace(profile_op_stream(model, (x,), timing_repeats=1), range_end_saves_held=True)
    names = [n.name for n in graph.nodes if n.kind == "compute"]
    linears = [i for i, name in enumerate(names) if name.endswith("_addmm")]
    segment = Segment(tuple(names[linears[0]:linears[1] + 1]), recompute_ms=0.0, recompute_flops=0)
    last = graph.node(names[linears[1]])
    assert set(last.saved_storages) - set(last.output_storages)  # the linear saves the ReLU's 8 MiB output
    predicted = simulate(graph, [segment]).peak_bytes
    plan = Plan(budget_bytes=predicted, predicted_peak_bytes=predicted, unoptimized_peak_bytes=graph.measured_peak_bytes,
                segments=(segment,), forward_ms=0.0, step_ms=0.0, forward_flops=0, solver="test", solve_s=0.0)
    measured = measure_step_peak_bytes(BreakCheckpointedModule(model, plan, segment_regions(plan),
                                                               expected_ops=graph.metadata.get("op_names")),
                                       StepInputs.from_example((x,)))
    assert measured < graph.measured_peak_bytes - 4 * 2**20  # the range does free that output
    assert abs(measured - predicted) < 2**20, (measured, predicted)  # held, it would be 8 MiB over
