"""The saved-tensor hooks that move marked storages to host memory (:mod:`rewrite.offload`): pack
then unpack gives every saved tensor back bit for bit, on CPU here and on CUDA where one is present
(tests marked ``cuda``, with the device peak lowered and the prefetch's event order checked);
``optimize(offload=True)`` is refused with one line on CPU."""

from __future__ import annotations

import pytest
import torch

from planner.core.errors import InputError
from rewrite.offload import HostOffload


class _Blocks(torch.nn.Module):
    """Residual MLP blocks whose hidden activations are what a plan offloads."""

    def __init__(self, width: int = 32, blocks: int = 3) -> None:
        super().__init__()
        self.ups = torch.nn.ModuleList(torch.nn.Linear(width, 4 * width) for _ in range(blocks))
        self.downs = torch.nn.ModuleList(torch.nn.Linear(4 * width, width) for _ in range(blocks))

    def forward(self, x: torch.Tensor, offload: HostOffload | None = None) -> torch.Tensor:
        for k, (up, down) in enumerate(zip(self.ups, self.downs)):
            hidden = torch.nn.functional.gelu(up(x))
            if offload is not None:
                hidden = offload.mark(hidden, f"hidden{k}")
                if k > 0:
                    x = offload.fetch_when_grad_reaches(x, (f"hidden{k - 1}",))
            x = x + down(hidden)
        return x


def _grads(model: torch.nn.Module, x: torch.Tensor, offload: HostOffload | None) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    if offload is None:
        loss = model(x).square().mean()
    else:
        with offload.hooks():
            loss = model(x, offload).square().mean()
    loss.backward()
    return [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]


def _device_test(device: torch.device) -> HostOffload:
    torch.manual_seed(0)
    model = _Blocks().to(device)
    x = torch.randn(64, 32, device=device)
    plain = _grads(model, x, None)
    offload = HostOffload(device)
    for _ in range(2):  # the second step reuses the pool's buffers
        offloaded = _grads(model, x, offload)
        assert all(torch.equal(a, b) for a, b in zip(plain, offloaded))
    return offload


def test_pack_then_unpack_gives_the_saved_tensors_back_bit_for_bit_on_cpu():
    offload = _device_test(torch.device("cpu"))
    # gelu saves its input (not marked); the down projection saves the marked hidden output
    assert offload.packed_bytes == 3 * 64 * 128 * 4
    assert offload.pool.allocated_bytes == 3 * 64 * 128 * 4  # reused on the second step, not grown


def test_a_full_pool_keeps_tensors_on_the_device_and_the_gradients_unchanged():
    torch.manual_seed(0)
    model = _Blocks()
    x = torch.randn(64, 32)
    plain = _grads(model, x, None)
    offload = HostOffload(torch.device("cpu"), pinned_host_bytes=64 * 128 * 4)  # room for one
    assert all(torch.equal(a, b) for a, b in zip(plain, _grads(model, x, offload)))
    assert offload.packed_bytes == 64 * 128 * 4


def test_a_tensor_saved_before_it_is_marked_is_offloaded_and_saved_twice_copied_once():
    offload = HostOffload(torch.device("cpu"))
    x = torch.randn(16, requires_grad=True)
    with offload.hooks():
        y = offload.mark(x.exp(), "exp")  # exp saved its output before the mark
        loss = (y * y).sum()  # both inputs of mul: the same tensor
    assert offload.packed_bytes == 16 * 4
    loss.backward()
    assert torch.equal(x.grad, 2 * x.exp() ** 2)


class _Layer(torch.nn.Module):
    def __init__(self, width: int, checkpointed: bool) -> None:
        super().__init__()
        self.up, self.down, self.checkpointed = torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width), \
            checkpointed

    def _body(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpointed:
            return torch.utils.checkpoint.checkpoint(self._body, x, use_reentrant=False)
        return self._body(x)


@pytest.mark.parametrize("checkpointed", [False, True])
def test_offloading_what_modules_save_checkpointed_or_not_keeps_the_gradients_bit_for_bit(checkpointed):
    torch.manual_seed(0)
    layers = torch.nn.Sequential(*(_Layer(16, checkpointed) for _ in range(3)))
    x = torch.randn(8, 16)
    plain = _grads(layers, x, None)
    offload = HostOffload(torch.device("cpu"))
    handles = offload.offload_modules([(str(k), layer) for k, layer in enumerate(layers)])
    for _ in range(2):
        layers.zero_grad(set_to_none=True)
        x_in = x.clone().requires_grad_(True)
        with offload.hooks():
            loss = layers(x_in).square().mean()
        loss.backward()
        grads = [p.grad for p in layers.parameters()] + [x_in.grad]
        assert all(torch.equal(a, b) for a, b in zip(plain, grads))
    # checkpointed: each layer's input (the checkpoint saves it outside its frame); otherwise
    # also up's output (gelu's input) and gelu's output (down's input)
    per_layer = 8 * 16 * 4 if checkpointed else 8 * 16 * 4 + 2 * 8 * 64 * 4
    assert offload.packed_bytes == 3 * per_layer
    for handle in handles:
        handle.remove()


def test_optimize_refuses_offload_on_cpu_with_one_line_that_says_what_to_do():
    from planner import optimize

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1)).train()
    with pytest.raises(InputError) as info:
        optimize(model, (torch.randn(2, 4),), budget_gb=1.0, offload=True)
    message = str(info.value)
    assert "\n" not in message and "CUDA" in message and "leave offload off" in message




@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_pack_then_unpack_is_bit_for_bit_with_copies_on_side_streams():
    offload = _device_test(torch.device("cuda"))
    assert offload.pool.pin and offload.packed_bytes == 3 * 64 * 128 * 4


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_offloading_the_hidden_activations_lowers_the_measured_peak():
    device = torch.device("cuda")
    torch.manual_seed(0)
    model = _Blocks(width=1024, blocks=4).to(device)
    x = torch.randn(4096, 1024, device=device)
    peaks = []
    for offload in (None, HostOffload(device)):
        _grads(model, x, offload)  # warm the pool and the allocator
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        _grads(model, x, offload)
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated())
    hidden_bytes = 4096 * 4096 * 4
    assert peaks[1] <= peaks[0] - hidden_bytes, peaks


@pytest.mark.slow
def test_the_gpu_offload_benchmark_runs_on_cpu_on_small_models_with_the_gradients_unchanged(tmp_path, capsys):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import offload_gpu

    assert offload_gpu.main(["--device", "cpu", "--tiny", "--repeats", "1", "--models", "gpt2"]) == 0
    table = capsys.readouterr().out
    rows = [line.split(" | ") for line in table.splitlines() if line.startswith("| gpt2")]
    hand = {row[1]: float(row[3]) for row in rows if len(row) == 6}
    planned = {row[1]: row for row in rows if len(row) == 9}
    assert all(row[-1] == "allclose |" for row in rows) and len(hand) == 4
    assert hand["keep all"] == 0 and 0 < hand["every layer, inputs offloaded"] < hand[
        "first half offloaded, rest every layer"]
    # the offload plan's row is there where the start found a cheaper plan on this CPU's timings
    assert list(planned)[:2] == ["nothing recomputed", "recompute only"] and len(planned) in (2, 3)

def test_an_offload_plan_applied_to_the_captured_graph_moves_what_it_planned_and_keeps_the_gradients():
    from examples.models import residual_mlp
    from planner.core.costgraph import protect_reads_before_writes
    from planner.core.offload import HOST_LINKS
    from planner.core.plan import Plan
    from planner.core.simulate import simulate
    from planner.solvers.hand_policies import hand_placed_plans
    from planner.solvers.offload import offload_plan
    from profiling import profile_graph, trace_module
    from rewrite.apply import apply_plan
    from rewrite.offload import apply_offload

    model, inputs = residual_mlp(batch=256)
    gm = trace_module(model, inputs)
    graph = protect_reads_before_writes(profile_graph(gm, inputs))
    every = next(p for p in hand_placed_plans(graph) if p.name == "every layer")
    budget = simulate(graph, every.segments).peak_bytes
    base = Plan(budget, budget, simulate(graph).peak_bytes, every.segments, graph.forward_ms, graph.step_ms,
                graph.forward_flops, "every layer", 0.0)
    plan = offload_plan(graph, budget, base, HOST_LINKS["h100"])
    assert plan is not None and plan.offloaded and len(plan.segments) < len(every.segments)
    offload = HostOffload(torch.device("cpu"))
    rewritten = apply_plan(apply_offload(gm, plan, offload), plan)
    grads = []
    for module in (model, rewritten):
        torch.manual_seed(0)
        model.zero_grad(set_to_none=True)
        module(*inputs).sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    assert offload.packed_bytes == plan.offloaded_bytes  # what the plan moves, and nothing else


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_an_applied_offload_plan_fits_its_budget_and_keeps_the_gradients():
    from examples.models import residual_mlp
    from planner.core.costgraph import protect_reads_before_writes
    from planner.core.offload import HOST_LINKS
    from planner.core.simulate import simulate
    from planner.solvers.hand_policies import hand_placed_plans
    from planner.solvers.offload import offload_plan
    from planner.solvers.solve import solve
    from profiling import StepInputs, profile_graph, trace_module
    from profiling.measure import measure_step_peak_bytes
    from rewrite.apply import CheckpointedModule, apply_plan
    from rewrite.offload import apply_offload

    device = torch.device("cuda")
    model, inputs = residual_mlp(batch=8192)
    model = model.to(device)
    inputs = tuple(t.to(device) for t in inputs)
    graph = protect_reads_before_writes(profile_graph(trace_module(model, inputs), inputs))
    every = next(p for p in hand_placed_plans(graph) if p.name == "every layer")
    budget = simulate(graph, every.segments).peak_bytes
    plan = offload_plan(graph, budget, solve(graph, budget), HOST_LINKS["h100"])
    if plan is None:
        pytest.skip("the offload start found nothing cheaper on this GPU's timings")
    offload = HostOffload(device)
    gm = apply_plan(apply_offload(trace_module(model, inputs), plan, offload), plan)
    opt = CheckpointedModule(gm, model, plan)
    grads = []
    for module in (model, opt):
        torch.manual_seed(0)
        model.zero_grad(set_to_none=True)
        module(*inputs).sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    assert offload.packed_bytes == plan.offloaded_bytes
    assert measure_step_peak_bytes(opt, StepInputs.from_example(inputs)) <= budget
