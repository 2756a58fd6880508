"""Bad arguments to ``optimize`` fail at once with one typed line that says what to do."""

from __future__ import annotations

import pytest
import torch

from planner import InfeasibleBudgetError, InputError, PlannerError, optimize, pipeline


def small_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 16)).train()


class TwoInputs(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x, mask):
        return self.proj(x) * mask


def assert_one_line(exc: BaseException, *fragments: str) -> None:
    message = str(exc)
    assert "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, (fragment, message)


@pytest.mark.parametrize("budget, fragment", [
    (0, "positive finite number of GiB"),
    (-1.0, "positive finite number of GiB"),
    (float("nan"), "positive finite number of GiB"),
    (float("inf"), "positive finite number of GiB"),
    ("2", "must be a number of GiB, got the string '2': pass budget_gb=2"),
    (True, "must be a number of GiB, got bool"),
    (6000, "budget_gb=6000 looks like the wrong unit"),
    (8e9, "looks like the wrong unit"),
])
def test_bad_budgets_fail_before_any_work(budget, fragment, monkeypatch):
    def no_tracing(*args, **kwargs):
        raise AssertionError("a bad budget must fail before tracing")

    monkeypatch.setattr(pipeline.Replanner, "__call__", no_tracing)
    with pytest.raises(InputError) as info:
        optimize(small_model(), (torch.randn(4, 16),), budget_gb=budget)
    assert_one_line(info.value, fragment)


def test_unit_error_says_what_to_pass_instead():
    with pytest.raises(InputError, match=r"for 6000 MiB pass budget_gb=5\.859"):
        optimize(small_model(), (torch.randn(4, 16),), budget_gb=6000)


def test_bad_reserve_is_named():
    with pytest.raises(InputError, match="reserve_gb must be a positive finite number"):
        optimize(small_model(), (torch.randn(4, 16),), budget_gb=1.0, reserve_gb=-1)


def test_budget_below_the_minimum_names_the_smallest_feasible_one():
    model, inputs = small_model(), (torch.randn(64, 16, requires_grad=False),)
    with pytest.raises(InfeasibleBudgetError) as info:
        optimize(model, inputs, budget_gb=1e-6)
    assert_one_line(info.value, "smallest feasible budget is", "raise budget_gb to at least")
    smallest_gb = info.value.min_feasible_bytes / 2**30
    assert optimize(model, inputs, budget_gb=smallest_gb).plan.predicted_peak_bytes <= info.value.min_feasible_bytes


def test_eval_mode_is_an_error_that_says_call_train():
    with pytest.raises(InputError) as info:
        optimize(small_model().eval(), (torch.randn(4, 16),), budget_gb=1.0)
    assert_one_line(info.value, "eval mode", "model.train()")


def test_meta_device_model_says_how_to_materialise_or_plan_fake():
    with torch.device("meta"):
        model = torch.nn.Linear(16, 16)
    with pytest.raises(InputError) as info:
        optimize(model, (torch.randn(4, 16),), budget_gb=1.0)
    assert_one_line(info.value, "'weight' is on the meta device", "to_empty", "fake=True", "--target h100")


def test_meta_inputs_are_refused():
    with pytest.raises(InputError, match="example input is on the meta device"):
        optimize(small_model(), (torch.empty(4, 16, device="meta"),), budget_gb=1.0)


def test_model_without_anything_to_train_is_refused():
    frozen = small_model().requires_grad_(False)
    with pytest.raises(InputError) as info:
        optimize(frozen, (torch.randn(4, 16),), budget_gb=1.0)
    assert_one_line(info.value, "nothing to train", "Sequential")
    with pytest.raises(InputError, match="nothing to train"):
        optimize(torch.nn.ReLU(), (torch.randn(4, 16),), budget_gb=1.0)


def test_parameter_free_model_with_an_input_that_requires_grad_is_planned():
    opt = optimize(torch.nn.Tanh(), (torch.randn(4, 16, requires_grad=True),), budget_gb=1.0)
    assert opt.plan.segments == ()


def test_not_a_module_and_not_a_tuple():
    with pytest.raises(InputError, match="must be a torch.nn.Module, got function"):
        optimize(lambda x: x, (torch.randn(4, 16),), budget_gb=1.0)
    with pytest.raises(InputError, match=r"wrap a single tensor as \(x,\)"):
        optimize(small_model(), torch.randn(4, 16), budget_gb=1.0)


def test_inputs_that_do_not_match_forward_name_the_signature():
    with pytest.raises(InputError) as info:
        optimize(TwoInputs().train(), (torch.randn(4, 8),), budget_gb=1.0)
    assert_one_line(info.value, "do not match TwoInputs.forward(x, mask)", "'mask'")
    with pytest.raises(InputError, match="unexpected keyword argument 'masks'"):
        optimize(TwoInputs().train(), {"x": torch.randn(4, 8), "mask": torch.ones(4, 8),
                                            "masks": torch.ones(4, 8)}, budget_gb=1.0)


def test_inputs_of_the_wrong_shape_fail_as_a_planner_error_naming_the_line():
    with pytest.raises(PlannerError) as info:
        optimize(small_model(), (torch.randn(4, 15),), budget_gb=1.0)
    message = str(info.value)
    assert "\n" not in message.strip().splitlines()[0]
    assert "4x15" in message or "shape" in message, message


def test_every_error_is_a_planner_error_and_input_errors_are_value_errors():
    assert issubclass(InputError, PlannerError) and issubclass(InputError, ValueError)
