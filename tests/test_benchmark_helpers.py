"""The benchmarks' shared helpers: checkpoint-every-k-th-layer baselines and interleaved timing."""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from common import checkpoint_every_k, find_layers, step_time_ratios  # noqa: E402
from models import ResidualMLP, gpt2, llama  # noqa: E402

from profiling import StepInputs, measure_step_flops, measure_step_peak_bytes  # noqa: E402


def _grads(module: torch.nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    module.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    module(x).sum().backward()
    grads = {n: p.grad.clone() for n, p in module.named_parameters()}
    module.zero_grad(set_to_none=True)
    return grads


def test_find_layers_picks_the_repeated_blocks() -> None:
    model, _ = gpt2(batch=1, seq_len=8, layers=3, width=32, vocab=64)
    name, layers = find_layers(model)
    assert name == "transformer.h" and len(layers) == 3
    assert find_layers(ResidualMLP(width=8, hidden=16, blocks=4))[0] == "blocks"
    with pytest.raises(ValueError):
        find_layers(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("k", [1, 2])
def test_every_k_keeps_gradients_and_saves_memory(k: int) -> None:
    torch.manual_seed(0)
    model = ResidualMLP(width=32, hidden=128, blocks=4, dropout=0.1).train()
    x = torch.randn(256, 32)
    every = checkpoint_every_k(model, k)
    assert every is not model and every.training
    a, b = _grads(model, x), _grads(every, x)
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    inputs = StepInputs.from_example((x,))
    assert measure_step_peak_bytes(every, inputs) < measure_step_peak_bytes(model, inputs)
    # k=1 recomputes every block's forward: 4 blocks x 2 linears; k=2 half of that
    extra = measure_step_flops(every, inputs) - measure_step_flops(model, inputs)
    assert extra == (4 // k) * 2 * (2 * 256 * 32 * 128)
    with pytest.raises(ValueError):
        checkpoint_every_k(model, 0)


def test_step_time_ratios_are_relative_to_the_first_module() -> None:
    model = ResidualMLP(width=8, hidden=16, blocks=2).train()
    ratios = step_time_ratios([model, checkpoint_every_k(model, 1)], StepInputs.from_example((torch.randn(4, 8),)),
                              repeats=3)
    assert ratios[0] == 1.0 and ratios[1] > 0
    assert all(p.grad is None for p in model.parameters())


class _Tagged(torch.nn.Linear):
    """A linear layer that appends its tag to ``order`` each time it runs."""

    def __init__(self, tag: int, order: list[int]) -> None:
        super().__init__(4, 4)
        self.tag = tag
        self.order = order

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.order.append(self.tag)
        return super().forward(x)


def test_step_time_ratios_rotate_which_module_runs_first() -> None:
    """Repeat r starts at module r % n: no module always runs after the same neighbour."""
    order: list[int] = []
    ratios = step_time_ratios([_Tagged(i, order) for i in range(3)], StepInputs.from_example((torch.randn(2, 4),)),
                              repeats=3, warmup=0)
    assert order == [0, 1, 2, 1, 2, 0, 2, 0, 1]
    assert ratios[0] == 1.0


def test_step_time_ratios_time_several_steps_of_one_module_in_a_row() -> None:
    order: list[int] = []
    step_time_ratios([_Tagged(i, order) for i in range(2)], StepInputs.from_example((torch.randn(2, 4),)), repeats=2,
                     warmup=0, steps_per_sample=3)
    assert order == [0, 0, 0, 1, 1, 1, 1, 1, 1, 0, 0, 0]


def test_timed_segments_sees_each_segment_once_forward_and_once_in_the_backward() -> None:
    from recompute_time import timed_segments

    from planner import optimize

    torch.manual_seed(0)
    model = ResidualMLP(width=16, hidden=64, blocks=4).train()
    x = torch.randn(512, 16)
    unoptimized = optimize(model, (x,), budget_gb=1.0).plan.unoptimized_peak_bytes
    opt = optimize(model, (x,), budget_gb=0.5 * unoptimized / 2**30)
    assert opt.plan.segments
    with timed_segments() as calls:
        opt(x).sum().backward()
    phases = [phase for _, phase, _ in calls]
    assert phases.count("forward") == len(opt.plan.segments)
    # a segment that saved nothing for backward is never recomputed
    graph = opt.cost_graph
    saving = sum(1 for seg in opt.plan.segments if any(graph.node(n).saved_storages for n in seg.node_names))
    assert saving and phases.count("recompute") == saving
    assert all(t > 0 for _, _, t in calls)
    opt(x)  # the class is restored: no more calls recorded
    assert len(calls) == len(phases)


@pytest.mark.parametrize("builder", [gpt2, llama], ids=["gpt2", "llama"])
def test_every_layer_baseline_matches_huggingface_gradient_checkpointing(builder: Callable[..., Any]) -> None:
    """The quality bars compare against checkpoint-every-layer; the benchmarks' wrapper must peak
    exactly where HuggingFace's own ``gradient_checkpointing_enable()`` does, to the byte (at
    these sizes checkpointing every second layer peaks higher, so the comparison can tell)."""
    model, example = builder(batch=2, seq_len=64, layers=3, width=64, vocab=64, heads=2)
    inputs = StepInputs.from_example(example)
    huggingface = copy.deepcopy(model)
    kwargs = {"use_reentrant": False}
    if hasattr(huggingface, "activation_checkpointing_enable"):  # the new name (the old one is deprecated)
        huggingface.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        huggingface.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    huggingface.train()
    ours = measure_step_peak_bytes(checkpoint_every_k(model, 1), inputs)
    assert ours == measure_step_peak_bytes(huggingface, inputs)
    assert ours < measure_step_peak_bytes(model, inputs)


def test_the_save_matmuls_policy_recomputes_no_matmul_and_trains_as_the_model() -> None:
    model, example = gpt2(batch=2, seq_len=32, layers=2, width=64, vocab=512)
    inputs = StepInputs.from_example(example)
    every = checkpoint_every_k(model, 1)
    save_matmuls = checkpoint_every_k(model, 1, save_matmuls=True)
    base_flops = measure_step_flops(model, inputs)
    # every layer reruns its matmuls; the policy keeps their outputs, so it recomputes no FLOPs
    assert measure_step_flops(every, inputs) > base_flops
    assert measure_step_flops(save_matmuls, inputs) == base_flops
    grads = []
    for module in (model, save_matmuls):
        module.zero_grad(set_to_none=True)
        torch.manual_seed(0)
        module(**example).loss.backward()
        grads.append({n: p.grad.clone() for n, p in module.named_parameters()})
    assert grads[0].keys() == grads[1].keys()
    assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])


def test_isolated_profile_cache_points_the_default_cache_at_a_new_empty_folder(monkeypatch):
    from common import isolated_profile_cache
    from profiling.cache import AUTO_CACHE_DIR, CACHE_DIR_ENV, resolve_cache_dir

    monkeypatch.setenv(CACHE_DIR_ENV, "/somewhere/else")
    folder = isolated_profile_cache()
    assert resolve_cache_dir(AUTO_CACHE_DIR) == folder and folder.is_dir() and not any(folder.iterdir())
    assert isolated_profile_cache() != folder  # each call its own folder


def test_timed_phases_times_each_phase_once_and_restores_the_planner() -> None:
    import optimize_time

    import planner.budget_plan
    import planner.planning_steps

    solve_before = planner.planning_steps.plan_for_budget
    phases: dict[str, float] = {}
    from planner import optimize
    from profiling import measure_step_peak_bytes

    model = ResidualMLP(width=64, hidden=256, blocks=4).train()
    x = torch.randn(256, 64)
    budget_gb = 0.7 * measure_step_peak_bytes(model, StepInputs.from_example((x,))) / 2**30
    with optimize_time.timed_phases(phases):
        assert planner.planning_steps.plan_for_budget is not solve_before
        opt = optimize(model, (x,), budget_gb=budget_gb, timing_repeats=1, cache_dir=None)
    assert opt.plan.segments
    assert {"capture", "profile", "solve", "measure", "rewrite"} <= set(phases)
    assert all(s > 0 for s in phases.values())
    assert planner.planning_steps.plan_for_budget is solve_before
    assert planner.budget_plan.plan_for_budget.__module__ == "planner.budget_plan"
