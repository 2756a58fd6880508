"""How ``optimize`` takes its budget: in GiB or as a share of the measured unoptimized peak; a
budget the unoptimized step already fits returns at once, nothing profiled; a refusal names the
unoptimized peak beside the smallest feasible budget; the summary says which figures are
predicted."""

from __future__ import annotations

import copy

import pytest
import torch

from planner import InfeasibleBudgetError, InputError, optimize
from planner.core.plan import GIB
from profiling.measure import StepInputs, measure_step_peak_bytes

FAST = {"timing_repeats": 1, "max_stages": 12}


def mlp() -> tuple[torch.nn.Module, tuple[torch.Tensor]]:
    torch.manual_seed(0)
    blocks = [torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)) for _ in range(3)]
    return torch.nn.Sequential(*blocks).train(), (torch.randn(512, 64),)


def test_budget_fraction_is_a_share_of_the_measured_unoptimized_peak():
    model, inputs = mlp()
    peak = measure_step_peak_bytes(model, StepInputs.from_example(inputs))
    opt = optimize(model, inputs, budget_fraction=0.6, **FAST)
    assert opt.plan.budget_bytes == int(0.6 * peak / GIB * GIB)
    assert opt.plan.segments
    assert measure_step_peak_bytes(opt, StepInputs.from_example(inputs)) <= opt.plan.budget_bytes


@pytest.mark.parametrize(("budget_gb", "budget_fraction", "says"), [
    (None, None, "pass budget_gb (GiB) or budget_fraction"),
    (1.0, 0.5, "pass budget_gb or budget_fraction, not both"),
    (None, 1.5, "budget_fraction must be a number in (0, 1]"),
    (None, "0.5", "budget_fraction must be a number in (0, 1]"),
])
def test_a_bad_budget_choice_is_one_line_before_any_work(budget_gb, budget_fraction, says, monkeypatch):
    import planner.pipeline
    import planner.planning_steps

    for module, name in ((planner.pipeline, "measure_step_peak_bytes"),  # the budget's fraction
                         (planner.planning_steps, "measure_step_peak_bytes"),
                         (planner.planning_steps, "measure_unoptimized_step")):  # the roomy step
        monkeypatch.setattr(module, name, lambda *a, **k: (_ for _ in ()).throw(AssertionError("must not run a step")))
    model, inputs = mlp()
    with pytest.raises(InputError) as refused:
        optimize(model, inputs, budget_gb, budget_fraction=budget_fraction)
    assert says in str(refused.value) and "\n" not in str(refused.value)


def test_a_budget_the_unoptimized_step_fits_returns_the_empty_plan_without_profiling(monkeypatch):
    import planner.planning_steps

    profiled = []
    profile = planner.planning_steps.cached_profile_graph
    monkeypatch.setattr(planner.planning_steps, "cached_profile_graph",
                        lambda *a, **k: profiled.append(1) or profile(*a, **k))
    model, inputs = mlp()
    eager = copy.deepcopy(model)
    opt = optimize(model, inputs, budget_gb=1.0)
    plan = opt.plan
    peak = measure_step_peak_bytes(eager, StepInputs.from_example(inputs))
    assert plan.segments == () and not profiled
    assert plan.unoptimized_peak_bytes == plan.predicted_peak_bytes == plan.measured_unoptimized_peak_bytes \
        == plan.measured_peak_bytes
    assert abs(plan.unoptimized_peak_bytes - peak) <= 0.01 * peak
    assert "(measured)" in plan.summary() and "none (the measured unoptimized step fits)" in plan.summary()
    opt(*inputs).sum().backward()
    eager(*inputs).sum().backward()
    grads = dict(eager.named_parameters())
    assert all(torch.equal(p.grad, grads[name].grad) for name, p in model.named_parameters())
    opt(*inputs).sum().backward()  # gradients held (accumulation): still fits, nothing profiled
    assert not profiled and list(opt.plans.values())[-1] is plan
    model.zero_grad(set_to_none=True)
    assert opt(torch.randn(64, 64)).shape == (64, 64)  # another batch: planned again, as roomy
    assert not profiled
    assert opt.cost_graph.measured_peak_bytes == plan.measured_peak_bytes  # the profile, made when read
    assert len(profiled) == 1 and opt.cost_graph is opt.cost_graph


def test_an_infeasible_budget_names_the_unoptimized_peak_too():
    model, inputs = mlp()
    with pytest.raises(InfeasibleBudgetError) as refused:
        optimize(model, inputs, budget_fraction=0.05, **FAST)
    error = refused.value
    assert error.unoptimized_peak_bytes is not None and error.unoptimized_peak_bytes > error.min_feasible_bytes
    assert f"the unoptimized step peaks at {error.unoptimized_peak_bytes / GIB:.4f} GiB" in str(error)
    assert "the smallest feasible budget is" in str(error) and "\n" not in str(error)


def test_the_summary_labels_the_extra_time_as_predicted():
    model, inputs = mlp()
    plan = optimize(model, inputs, budget_fraction=0.6, **FAST).plan
    row = next(line for line in plan.summary().splitlines() if line.startswith("extra time"))
    assert "per step, predicted (~" in row and "step, measured)" in row, row


def test_the_step_measured_against_the_budget_is_the_profiles_memory_pass(monkeypatch):
    import planner.planning_steps
    import profiling.profile

    passes, checks, given = [], [], []
    measure = profiling.profile.measure_node_peaks
    monkeypatch.setattr(profiling.profile, "measure_node_peaks", lambda *a, **k: passes.append(1) or measure(*a, **k))
    check = planner.planning_steps.measure_step_peak_bytes
    monkeypatch.setattr(planner.planning_steps, "measure_step_peak_bytes", lambda *a, **k: checks.append(1) or check(*a, **k))
    profile = planner.planning_steps.cached_profile_graph
    monkeypatch.setattr(planner.planning_steps, "cached_profile_graph",
                        lambda *a, **k: given.append(k.get("node_peaks")) or profile(*a, **k))
    model, inputs = mlp()
    peak = measure_step_peak_bytes(model, StepInputs.from_example(inputs))
    opt = optimize(model, inputs, budget_gb=0.7 * peak / GIB, cache_dir=None, **FAST)
    assert opt.plan.segments
    # two measured steps in all: the unoptimized one, against the budget and then the profile's
    # memory pass, and the plan's check
    assert len(passes) == 1 and len(checks) == 1 and len(given) == 1 and given[0] is not None
    graph = opt.cost_graph
    assert graph.measured_peak_bytes == opt.plan.measured_unoptimized_peak_bytes
    assert abs(graph.measured_peak_bytes - peak) <= 0.01 * peak
    measured = given[0]  # the profile's per-node peaks are that step's
    compared = [n for n in graph.nodes if n.name in measured.forward]
    assert len(compared) > 10 and all(n.forward_peak_bytes == measured.forward[n.name] for n in compared)
    assert any(n.backward_peak_bytes for n in graph.nodes)
    # and the profile's first timed pass: with one pass asked for, the only one, the step's time its own
    timed = measured.timed_pass
    assert timed is not None and timed.backward_ms > 0 and graph.metadata["timing_passes"] == 1
    run = [n.name for n in graph.nodes if n.kind != "input" and n.op != "loss_fn"]  # the criterion is no graph node
    assert graph.step_ms == pytest.approx(sum(timed.node_times_ms[name] for name in run) + timed.backward_ms)
