"""The optimized module in real training: every case compares with the unoptimized model.

Each test guards one way checkpointing is known to break training (see docs/correctness.md):
random ops drawing fresh numbers on recompute, buffer mutations running twice, in-place ops
and views, tied weights, other input shapes, inference paying for recompute, autocast dtypes,
gradient accumulation, torch.compile, state_dict and deepcopy. Gradients are compared bitwise
(CPU); peaks are measured at the allocator.
"""

from __future__ import annotations

import collections
import copy
import io
import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from planner import InfeasibleBudgetError, PlannerError, optimize, simulate
from planner.core.costgraph import protect_reads_before_writes, shard_parameters
from planner.pipeline import PlanOptions, plan_for_budget
from planner.core.plan import Plan, Segment
from profiling import StepInputs, measure_step_peak_bytes, profile_graph, trace_module
from profiling.measure import loss_of
from rewrite.apply import CheckpointedModule, apply_plan

# --------------------------------------------------------------------------------------------
# helpers

#: Planning options that keep these tests quick (also used by every re-plan of the module).
FAST = {"timing_repeats": 1, "max_stages": 12}


def grads_of(module, owner, inputs, seed: int, *, backward: bool = True):
    """Loss, gradients (by parameter name) and the RNG state after one step from ``seed``."""
    owner.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    args = inputs if isinstance(inputs, tuple) else ()
    kwargs = inputs if isinstance(inputs, dict) else {}
    loss = loss_of(module(*args, **kwargs))
    loss.backward()
    grads = {n: p.grad.clone() for n, p in owner.named_parameters() if p.grad is not None}
    owner.zero_grad(set_to_none=True)
    return loss.detach(), grads, torch.get_rng_state()


def assert_same_step(model, opt, inputs, seed: int = 0) -> None:
    """Loss, every gradient and the RNG state after the step are bitwise equal."""
    loss_a, grads_a, rng_a = grads_of(model, model, inputs, seed)
    loss_b, grads_b, rng_b = grads_of(opt, model, inputs, seed)
    assert torch.equal(loss_a, loss_b), f"loss {loss_a} != {loss_b}"
    assert grads_a.keys() == grads_b.keys()
    different = [n for n in grads_a if not torch.equal(grads_a[n], grads_b[n])]
    assert not different, f"gradients differ: {different}"
    assert torch.equal(rng_a, rng_b), "the step left the global RNG in another state"


def recompute_everything(model, inputs, keep: bool = False) -> CheckpointedModule:
    """Checkpoint every run of recomputable nodes (the harshest plan), bypassing the solver but
    not the planner's rules (:func:`plan_for_budget` applies ``protect_reads_before_writes``).
    With ``keep``, every node the profiler marks keepable keeps its outputs (selective policy)."""
    gm = trace_module(model, inputs)
    graph = protect_reads_before_writes(profile_graph(gm, inputs, fake=True))
    runs: list[list[str]] = [[]]
    for node in graph.compute_nodes:
        if node.recomputable:
            runs[-1].append(node.name)
        elif runs[-1]:
            runs.append([])
    segments = tuple(Segment(tuple(run), 0.0, 0, tuple(n for n in run if keep and graph.node(n).selective_save))
                     for run in runs if run)
    peak = simulate(graph, segments).peak_bytes
    plan = Plan(peak, peak, simulate(graph).peak_bytes, segments, 0.0, 0.0, 0, "manual", 0.0)
    return CheckpointedModule(apply_plan(gm, plan), model, plan, cost_graph=graph, example_inputs=inputs)


def recomputed(opt) -> set[str]:
    return {name for seg in opt.plan.segments for name in seg.node_names}


def peak_of(module, inputs) -> int:
    return measure_step_peak_bytes(module, StepInputs.from_example(inputs))


class Block(nn.Module):
    def __init__(self, width: int, dropout: float = 0.2) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        return x + self.drop(self.down(F.gelu(self.up(self.norm(x)))))


class Net(nn.Module):
    def __init__(self, width: int = 64, blocks: int = 4, dropout: float = 0.2) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[Block(width, dropout) for _ in range(blocks)])
        self.scale = nn.Parameter(torch.ones(width))  # a parameter of the root module itself
        self.head = nn.Linear(width, 3)

    def forward(self, x):
        return self.head(self.blocks(x) * self.scale)


def make_net(batch: int = 512, **kwargs):
    torch.manual_seed(0)
    return Net(**kwargs).train(), (torch.randn(batch, 64),)


@pytest.fixture(scope="module")
def planned():
    """A Net planned at 65 % of its measured peak (segments recomputed), shared by several tests."""
    model, inputs = make_net()
    peak = peak_of(model, inputs)
    opt = optimize(model, inputs, budget_gb=0.65 * peak / 2**30, timing_repeats=1)
    assert opt.plan.segments
    return model, inputs, opt, peak


# --------------------------------------------------------------------------------------------
# random ops


class RandomNet(nn.Module):
    """Dropout, ``rand_like``, ``randn`` and ``bernoulli`` inside every block."""

    def __init__(self, width: int = 32, blocks: int = 3) -> None:
        super().__init__()
        self.lins = nn.ModuleList(nn.Linear(width, width) for _ in range(blocks))
        self.head = nn.Linear(width, 2)

    def forward(self, x):
        for lin in self.lins:
            h = torch.tanh(lin(x))
            h = F.dropout(h, 0.3, self.training)
            h = h * (1 + torch.rand_like(h)) + 0.1 * torch.randn(h.shape)
            h = h * torch.bernoulli(torch.full_like(h, 0.8))
            x = x + h
        return self.head(x)


def test_random_ops_draw_the_same_numbers_on_recompute():
    torch.manual_seed(0)
    model, inputs = RandomNet().train(), (torch.randn(64, 32),)
    opt = recompute_everything(model, inputs)
    random_nodes = {n.name for n in opt.cost_graph.compute_nodes if n.is_random}
    assert len(random_nodes) >= 12 and random_nodes <= recomputed(opt), "every random op is recomputed"
    for seed in (1, 2):
        assert_same_step(model, opt, inputs, seed)


def test_dropout_under_the_solver_plan_gives_bitwise_equal_gradients(planned):
    model, inputs, opt, _ = planned
    if not any(name.startswith("dropout") for name in recomputed(opt)):
        # which nodes a 65 % plan recomputes depends on measured times; at the smallest
        # feasible budget the dropouts are recomputed whatever the timings
        with pytest.raises(InfeasibleBudgetError) as info:
            optimize(model, inputs, budget_gb=1e-6, timing_repeats=1)
        opt = optimize(model, inputs, budget_gb=info.value.min_feasible_bytes / 2**30, timing_repeats=1)
    assert any(name.startswith("dropout") for name in recomputed(opt))
    assert_same_step(model, opt, inputs, seed=5)


# --------------------------------------------------------------------------------------------
# buffer mutations


class StatefulNet(nn.Module):
    """BatchNorm plus hand-written buffer mutations: a step counter and a running mean."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.inp = nn.Linear(width, 4 * width)
        self.bn = nn.BatchNorm1d(4 * width)
        self.mid = nn.Linear(4 * width, 4 * width)
        self.out = nn.Linear(4 * width, width)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.register_buffer("ema", torch.zeros(4 * width))

    def forward(self, x):
        self.steps += 1
        h = F.gelu(self.bn(self.inp(x)))
        self.ema.mul_(0.9).add_(h.detach().mean(0), alpha=0.1)
        h = F.gelu(self.mid(h))
        return self.out(h)


def test_batchnorm_and_buffer_mutations_happen_once_per_step():
    torch.manual_seed(0)
    model, inputs = StatefulNet().train(), (torch.randn(256, 64),)
    reference = copy.deepcopy(model)
    opt = recompute_everything(model, inputs)
    assert recomputed(opt), "the plan recomputes the pure ops around the mutations"
    for step in range(2):
        for module, owner in ((reference, reference), (opt, model)):
            owner.zero_grad(set_to_none=True)
            torch.manual_seed(step)
            loss_of(module(*inputs)).backward()
        for (name, a), b in zip(reference.named_parameters(), model.parameters()):
            assert torch.equal(a.grad, b.grad), name
    for name, buf in reference.named_buffers():
        assert torch.equal(buf, dict(model.named_buffers())[name]), f"buffer {name} updated differently"
    assert int(model.bn.num_batches_tracked) == 2 and int(model.steps) == 2
    model.zero_grad(set_to_none=True)


# --------------------------------------------------------------------------------------------
# in-place ops, views, aliasing


class AliasNet(nn.Module):
    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.a = nn.Linear(width, 2 * width)
        self.b = nn.Linear(width, width)
        self.c = nn.Linear(width, width)
        self.d = nn.Linear(width, width)

    def forward(self, x):
        g = self.d(x).add_(1.0)                         # in place on a fresh activation
        s = torch.tanh(g + 1.0)                         # reads g before it is written again
        g.mul_(2.0)                                     # legal in eager: nothing saved g
        x = s + g
        h = self.a(x)
        left, right = h.chunk(2, dim=-1)               # two views of one storage
        left = left.clone()
        left.mul_(torch.sigmoid(right))                 # in place on an activation
        t = left.t().contiguous().t()                   # transpose views
        y = t.view(-1, 4, t.shape[-1] // 4).transpose(1, 2).reshape_as(t)
        z = torch.relu_(self.b(y)) * 1.5               # in-place activation
        z[:, :4] += 1.0                                 # in place through a slice
        w = z.unsqueeze(0).expand(2, -1, -1).sum(0)     # broadcast view
        return self.c(w) + y.narrow(1, 0, y.shape[1])


def test_in_place_ops_views_and_aliasing_survive_recompute():
    torch.manual_seed(0)
    model, inputs = AliasNet().train(), (torch.randn(64, 32),)
    opt = recompute_everything(model, inputs)
    assert len(recomputed(opt)) >= 10
    assert_same_step(model, opt, inputs, seed=0)


def _inplace_targets(gm: torch.fx.GraphModule) -> list[str]:
    return sorted(str(n.target) for n in gm.graph.nodes
                  if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
                  and n.target._schema.is_mutable)


def test_in_place_ops_outside_recomputed_segments_run_in_place_again():
    torch.manual_seed(0)
    model, inputs = AliasNet().train(), (torch.randn(64, 32),)
    captured = collections.Counter(_inplace_targets(trace_module(model, inputs)))  # through a view: kept
    roomy = optimize(model, inputs, budget_gb=1.0, **FAST)
    assert not roomy.plan.segments
    # the writes whose tensor nothing else reads are the model's own in-place ops again;
    # ``g.mul_`` stays out of place: ``g + 1.0`` read ``g`` before it
    restored = collections.Counter(_inplace_targets(roomy.graph_module)) - captured
    assert sorted(restored.elements()) == ["aten.add_.Tensor", "aten.mul_.Tensor", "aten.relu_.default"]
    assert_same_step(model, roomy, inputs, seed=0)
    # recomputed, every write stays out of place, in the segments and around them
    gm = recompute_everything(model, inputs).graph_module
    segments = [getattr(gm, n.target).graph_module for n in gm.graph.nodes
                if n.op == "get_attr" and n.target.startswith("checkpoint_segment_")]
    written = collections.Counter(t for m in (gm, *segments) for t in _inplace_targets(m))
    assert segments and not written - captured


def _tiny_gpt2(batch: int, seq_len: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=512, n_positions=64, use_cache=False,
                        bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config).train()
    ids = torch.randint(0, config.vocab_size, (batch, seq_len))
    return model, {"input_ids": ids, "labels": ids}


@pytest.fixture(scope="module")
def gpt2_planned():
    model, inputs = _tiny_gpt2(4, 32)
    peak = peak_of(model, inputs)
    opt = optimize(model, inputs, budget_gb=0.7 * peak / 2**30, **FAST)
    return model, inputs, opt


@pytest.mark.parametrize("which", ["net", "gpt2"])
def test_every_node_marked_keepable_can_be_kept_with_identical_training(which):
    """The profiler's ``selective_save`` marks are what the op-level planner may keep: keeping
    all of them at once (dropout and attention excluded: random, and writing their own
    intermediates in place) runs under the selective policy and trains bitwise identically."""
    model, inputs = make_net(batch=64) if which == "net" else _tiny_gpt2(2, 16)
    opt = recompute_everything(model, inputs, keep=True)
    kept = {n for seg in opt.plan.segments for n in seg.kept_nodes}
    assert kept, "some nodes are keepable"
    ops = {opt.cost_graph.node(n).op for n in kept}
    assert not any("dropout" in op or "attention" in op for op in ops), ops
    assert_same_step(model, opt, inputs, seed=3)


def test_gpt2_tied_embedding_stays_tied_and_trains_identically(gpt2_planned):
    model, inputs, opt = gpt2_planned
    assert opt.plan.segments
    assert opt.lm_head.weight is opt.transformer.wte.weight is model.transformer.wte.weight
    twin = copy.deepcopy(model)
    loss_a, grads_a, _ = grads_of(model, model, inputs, seed=3)
    loss_b, grads_b, _ = grads_of(opt, model, inputs, seed=3)
    assert torch.equal(loss_a, loss_b)
    assert all(torch.equal(grads_a[n], grads_b[n]) for n in grads_a)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        sgd = torch.optim.SGD(model.parameters(), lr=0.1)
        sgd_twin = torch.optim.SGD(twin.parameters(), lr=0.1)
        for module, optim in ((opt, sgd), (twin, sgd_twin)):
            optim.zero_grad(set_to_none=True)
            torch.manual_seed(4)
            loss_of(module(**inputs)).backward()
            optim.step()
        assert model.lm_head.weight is model.transformer.wte.weight
        assert torch.equal(model.lm_head.weight, twin.lm_head.weight)
        assert not torch.equal(model.lm_head.weight, saved["lm_head.weight"])
    finally:
        model.load_state_dict(saved)
        model.zero_grad(set_to_none=True)


# --------------------------------------------------------------------------------------------
# other shapes


def test_other_batch_size_replans_once_with_a_log_line_and_stays_under_budget(planned, caplog):
    model, inputs, opt, _ = planned
    small = (torch.randn(128, 64),)
    with caplog.at_level(logging.INFO, logger="rewrite.checkpointed_module"):
        opt(*small)
        opt(*small)
    lines = [r.getMessage() for r in caplog.records if "re-planning" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "arg0=128x64 float32" in lines[0] and "planned for arg0=512x64 float32" in lines[0]
    measured = peak_of(opt, small)
    assert measured <= opt.plan.budget_bytes
    assert opt.plan_for(*small).predicted_peak_bytes == pytest.approx(measured, rel=0.05)
    assert_same_step(model, opt, small, seed=2)


def test_larger_batch_beyond_the_budget_is_a_clear_error(planned):
    _, _, opt, _ = planned
    with pytest.raises(InfeasibleBudgetError, match="smallest feasible budget"):
        opt(torch.randn(1024, 64))
    with pytest.raises(PlannerError, match="plan_for"), torch.profiler.profile():
        opt(torch.randn(96, 64))  # planning profiles a step: not inside the user's profiler session


def test_gpt2_other_sequence_length_replans_and_matches(gpt2_planned):
    model, _, opt = gpt2_planned
    _, short = _tiny_gpt2(4, 16)
    assert_same_step(model, opt, short, seed=1)
    assert peak_of(opt, short) <= opt.plan.budget_bytes


# --------------------------------------------------------------------------------------------
# inference


def test_eval_and_no_grad_pay_no_recompute(planned, monkeypatch):
    model, inputs, opt, _ = planned
    calls = []
    real = torch.utils.checkpoint.checkpoint

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint", counting)
    forward_flops = _forward_flops(model, inputs)
    with torch.no_grad():                      # training mode, autograd off: plain calls
        torch.manual_seed(0)
        out = opt(*inputs)
        torch.manual_seed(0)
        assert torch.equal(out, model(*inputs))
    assert _forward_flops(opt, inputs) == forward_flops
    assert not calls, "no checkpoint under no_grad"
    for switch in (opt, model):                # opt.eval() and the user's model.eval()
        switch.eval()
        try:
            assert torch.equal(opt(*inputs), opt(*inputs)), "dropout is off in eval mode"
            loss_of(opt(*inputs)).backward()   # eval with autograd: still the user's module
        finally:
            switch.train()
            model.zero_grad(set_to_none=True)
    assert not calls, "no checkpoint in eval mode"
    loss_of(opt(*inputs)).backward()
    model.zero_grad(set_to_none=True)
    assert len(calls) == len(opt.plan.segments), "training still checkpoints"


def _forward_flops(module, inputs) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with torch.no_grad(), counter:
        module(*inputs)
    return int(counter.get_total_flops())


# --------------------------------------------------------------------------------------------
# autocast and gradient accumulation


def test_autocast_bf16_recomputes_in_the_same_dtype_and_keeps_the_saving():
    model, inputs = make_net(batch=1024)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        peak = peak_of(model, inputs)
        opt = optimize(model, inputs, budget_gb=0.7 * peak / 2**30, **FAST)
        assert opt.plan.segments
        assert opt(*inputs).dtype == torch.bfloat16
        assert_same_step(model, opt, inputs, seed=7)
        measured = peak_of(opt, inputs)
    assert measured <= opt.plan.budget_bytes < peak
    assert_same_step(model, opt, inputs, seed=7)  # autocast off: re-planned in float32


class _Accumulate(nn.Module):
    """Runs micro-batches ``first`` (forward and backward) inside the forward, then returns the
    last micro-batch's output: one measured step covers the whole accumulation."""

    def __init__(self, inner: nn.Module, first: list[tuple[torch.Tensor, ...]]) -> None:
        super().__init__()
        self.inner = inner
        self.first = first

    def forward(self, x):
        for micro in self.first:
            loss_of(self.inner(*micro)).backward()
        return self.inner(x)


def test_gradient_accumulation_matches_and_stays_under_budget():
    torch.manual_seed(0)
    model = Net(width=64, blocks=4).train()
    micro = [(torch.randn(256, 64),) for _ in range(3)]
    peak = peak_of(_Accumulate(model, micro[:-1]), micro[-1])
    opt = optimize(model, micro[0], budget_gb=0.7 * peak / 2**30, **FAST)
    grads = []
    for module in (model, opt):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        for batch in micro:
            loss_of(module(*batch)).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    model.zero_grad(set_to_none=True)
    assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])
    assert any("grads held" in key for key in opt.plans), "later micro-batches have their own plan"
    measured = peak_of(_Accumulate(opt, micro[:-1]), micro[-1])
    assert measured <= opt.plan.budget_bytes < peak


# --------------------------------------------------------------------------------------------
# state_dict and deepcopy


def test_state_dict_round_trips_into_the_original_class(planned):
    model, inputs, opt, _ = planned
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    fresh = Net()
    fresh.load_state_dict(torch.load(buffer), strict=True)
    assert list(fresh.state_dict()) == list(model.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))
    # and back: loading into the optimized module updates what the graph computes with
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        torch.manual_seed(9)
        other = Net().train()
        opt.load_state_dict(other.state_dict())
        assert all(p is q for p, q in zip(opt.parameters(), model.parameters()))
        loss_a, grads_a, _ = grads_of(other, other, inputs, seed=2)
        loss_b, grads_b, _ = grads_of(opt, model, inputs, seed=2)
        assert torch.equal(loss_a, loss_b)
        assert all(torch.equal(grads_a[n], grads_b[n]) for n in grads_a)
        # assign=True swaps the parameter objects (as FSDP does): the graph follows the user's modules
        opt.load_state_dict({k: v.clone() for k, v in saved.items()}, assign=True)
        assert opt.head.weight is model.head.weight
        loss_c, _, _ = grads_of(opt, model, inputs, seed=2)
        torch.manual_seed(2)
        assert torch.equal(loss_c, loss_of(model(*inputs)).detach())
    finally:
        model.load_state_dict(saved)


def test_deepcopy_gives_an_independent_module_that_trains_the_same(planned):
    model, inputs, opt, _ = planned
    twin = copy.deepcopy(opt)
    assert isinstance(twin, CheckpointedModule) and twin.plan == opt.plan
    assert not any(p is q for p, q in zip(twin.parameters(), model.parameters()))
    assert list(twin.state_dict()) == list(model.state_dict())
    loss_a, grads_a, _ = grads_of(opt, model, inputs, seed=4)
    loss_b, grads_b, _ = grads_of(twin, twin, inputs, seed=4)
    assert torch.equal(loss_a, loss_b) and all(torch.equal(grads_a[n], grads_b[n]) for n in grads_a)
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(0.5)                        # the copy's graph reads the copy's parameters
    loss_c, _, _ = grads_of(twin, twin, inputs, seed=4)
    loss_d, _, _ = grads_of(opt, model, inputs, seed=4)
    assert not torch.equal(loss_c, loss_a) and torch.equal(loss_d, loss_a)
    # the copy's graph reads through the copy's own modules: swapped parameters are seen
    twin.load_state_dict(model.state_dict(), assign=True)
    loss_e, _, _ = grads_of(twin, twin, inputs, seed=4)
    assert torch.equal(loss_e, loss_a)


# --------------------------------------------------------------------------------------------
# torch.compile


@pytest.mark.slow
def test_torch_compile_runs_with_the_same_randomness_and_no_higher_peak():
    import torch._inductor.config as inductor_config

    torch._dynamo.reset()
    model, inputs = make_net(batch=512, blocks=2)
    opt = optimize(model, inputs, budget_gb=0.7 * peak_of(model, inputs) / 2**30, **FAST)
    assert opt.plan.segments
    with inductor_config.patch(fallback_random=True):  # eager RNG: comparable dropout masks
        compiled = torch.compile(opt)
        loss_a, grads_a, _ = grads_of(model, model, inputs, seed=3)
        loss_b, grads_b, _ = grads_of(compiled, model, inputs, seed=3)
        assert torch.allclose(loss_a, loss_b, rtol=1e-5)
        for name in grads_a:
            torch.testing.assert_close(grads_b[name], grads_a[name], rtol=1e-4, atol=1e-5, msg=name)
        eager_peak = peak_of(opt, inputs)
        compiled_peak = peak_of(compiled, inputs)
    assert compiled_peak <= eager_peak <= opt.plan.budget_bytes
    torch._dynamo.reset()


# --------------------------------------------------------------------------------------------
# the per-rank memory model


def test_world_size_shards_parameters_and_their_gradients_in_the_memory_model():
    model, inputs = make_net(batch=64)
    graph = profile_graph(trace_module(model, inputs), inputs, fake=True)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    one = simulate(graph).peak_bytes
    two = simulate(shard_parameters(graph, 2)).peak_bytes
    assert shard_parameters(graph, 2).persistent_bytes == graph.persistent_bytes - param_bytes // 2
    assert param_bytes // 2 <= one - two <= param_bytes  # half of the parameters, up to half of the grads
    budget_gb = 1.001 * two / 2**30  # the sharded step fits as it is; the unsharded one does not
    assert plan_for_budget(graph, budget_gb, PlanOptions(safety_margin=0.0, world_size=2)).segments == ()
    # unsharded, not even recomputing everything fits (exact=False: the smallest peak named
    # without the exact search's bisection, 1 s instead of 30; the same bytes on this graph)
    with pytest.raises(InfeasibleBudgetError) as unsharded:
        plan_for_budget(graph, budget_gb, PlanOptions(safety_margin=0.0, exact=False))
    assert two < budget_gb * 2**30 < unsharded.value.min_feasible_bytes < one
    with pytest.raises(PlannerError, match="world_size"):
        optimize(model, inputs, budget_gb=1.0, world_size=0)
