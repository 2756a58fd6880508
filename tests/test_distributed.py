"""The optimized module under DDP and FSDP2 (``fully_shard``): two CPU processes on gloo.

``examples/distributed_train.py`` runs under ``torchrun --nproc-per-node 2`` on localhost with
DDP, with ``fully_shard`` on the optimized module, and with ``fully_shard`` on every block then
on the module (planned with ``world_size=2``). Its averaged gradients, trained parameters and
eval loss must equal one process training on the whole batch, and each rank's measured peak
must stay within the budget. What cannot work (an unplanned shape under ``torch.distributed``,
a sharded module whose ops are not contiguous) must be a clear ``PlannerError``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "distributed_train.py"

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason="needs torch.distributed with gloo",
)

STEPS = 3
ARGS = ["--steps", str(STEPS), "--global-batch", "512", "--width", "64", "--hidden", "256", "--blocks", "4",
        "--dropout", "0", "--budget-fraction", "0.8", "--lr", "0.05"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def env() -> dict[str, str]:
    out = dict(os.environ)
    out["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "examples"), out.get("PYTHONPATH", "")])
    out["OMP_NUM_THREADS"] = "1"
    out["PYTHONFAULTHANDLER"] = "1"  # a rank that crashes prints every thread's Python stack
    return out


#: Seconds one torchrun of the example may take (about 10 s on a 2-core CPU).
TORCHRUN_TIMEOUT_S = 300


def torchrun(mode: str, out: Path) -> dict:
    # --standalone: the rendezvous binds its own free port, so two runs on parallel test
    # workers cannot pick the same one between a probe and the bind
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(EXAMPLE), "--mode", mode, "--out", str(out), *ARGS]
    proc = subprocess.Popen(cmd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=TORCHRUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        # every process of the run prints its Python stacks on SIGABRT (PYTHONFAULTHANDLER)
        os.killpg(proc.pid, signal.SIGABRT)
        try:
            stdout, stderr = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
        pytest.fail(f"torchrun --mode {mode} ran past {TORCHRUN_TIMEOUT_S} s; its output and stacks:\n"
                    + stdout[-3000:] + stderr[-12000:])
    assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
    return json.loads((out / "summary.json").read_text())


def single_process_reference():
    """One process, the whole batch, the unoptimized model: first gradients and final parameters."""
    sys.path.insert(0, str(ROOT / "examples"))
    from distributed_train import batches, build

    model = build(64, 256, 4, 0.0)
    sgd = torch.optim.SGD(model.parameters(), lr=0.05)
    first = {}
    for step, (x, y) in enumerate(batches(STEPS, 512, 64)):
        sgd.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(model(x), y).backward()
        if step == 0:
            first = {n: p.grad.clone() for n, p in model.named_parameters()}
        sgd.step()
    model.eval()
    with torch.no_grad():
        x, y = batches(STEPS, 512, 64)[0]
        eval_loss = float(torch.nn.functional.mse_loss(model(x), y))
    return first, dict(model.named_parameters()), eval_loss


@pytest.fixture(scope="module")
def reference():
    return single_process_reference()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "fsdp", "fsdp-blocks"])
def test_two_ranks_train_like_one_process_within_the_budget(mode, tmp_path, reference):
    summary = torchrun(mode, tmp_path)
    assert summary["world_size"] == 2 and summary["segments"] > 0, summary
    assert summary["wrapper"] == ("DistributedDataParallel" if mode == "ddp" else "FSDPCheckpointedModule")
    assert summary["measured_peak_bytes"] <= summary["budget_bytes"], summary
    first_ref, params_ref, eval_ref = reference
    grads = torch.load(tmp_path / "grads.pt")
    params = torch.load(tmp_path / "params.pt")
    assert grads.keys() == first_ref.keys() and params.keys() == params_ref.keys()
    for name in first_ref:  # averaged over ranks: equal up to the order of the sums
        torch.testing.assert_close(grads[name], first_ref[name], rtol=1e-5, atol=1e-6, msg=name)
    for name in params_ref:
        torch.testing.assert_close(params[name], params_ref[name].detach(), rtol=1e-5, atol=1e-6, msg=name)
    assert summary["eval_loss"] == pytest.approx(eval_ref, rel=1e-5), "eval reads the trained parameters"


def _errors_worker(rank: int, world_size: int, port: int) -> None:
    """Each rank: a shape planned ahead trains under DDP; an unplanned one raises PlannerError."""
    import torch.distributed as dist

    from distributed_train import build
    from planner import PlannerError, optimize

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        x = torch.randn(64, 64)
        opt = optimize(build(64, 256, 2, 0.0), (x,), budget_gb=1.0, timing_repeats=1)
        opt.plan_for(torch.randn(32, 64))  # planned ahead: fine under DDP
        ddp = torch.nn.parallel.DistributedDataParallel(opt)
        ddp(torch.randn(32, 64)).sum().backward()
        ddp(torch.randn(32, 64)).sum().backward()  # gradients held: re-solved, not re-profiled
        try:
            ddp(torch.randn(16, 64))
        except PlannerError as exc:
            assert "under torch.distributed" in str(exc) and "plan_for" in str(exc), exc
        else:
            raise AssertionError("an unplanned shape under DDP must be refused")
    finally:
        dist.destroy_process_group()
    # reached only when every check above passed: leave without C++ static destructors, which
    # sometimes abort this worker at exit ("terminate called without an active exception")
    os._exit(0)


def test_unplanned_shape_under_ddp_is_a_clear_error_on_every_rank():
    import torch.multiprocessing as mp

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if str(ROOT / "examples") not in sys.path:
        sys.path.insert(0, str(ROOT / "examples"))
    mp.spawn(_errors_worker, args=(2, free_port()), nprocs=2, join=True)


def _same_plan_worker(rank: int, world_size: int, port: int, out: str, share_plan: bool) -> None:
    """Each rank plans the same model with node times skewed on rank 1 (its linears 30 times
    slower: a busy machine's noise, exaggerated), writes its plan's segments, and runs one DDP
    step with it."""
    import dataclasses

    import torch.distributed as dist

    import planner.planning_steps
    from distributed_train import build
    from planner import optimize
    from profiling.measure import StepInputs, measure_step_peak_bytes

    profile = planner.planning_steps.cached_profile_graph

    def skewed(*args, **kwargs):
        graph = profile(*args, **kwargs)
        if rank != 1:
            return graph
        return dataclasses.replace(graph, nodes=tuple(
            dataclasses.replace(n, time_ms=n.time_ms * 30) if "linear" in n.op or "addmm" in n.op else n
            for n in graph.nodes))

    planner.planning_steps.cached_profile_graph = skewed
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        model, x = build(64, 256, 4, 0.0), torch.randn(256, 64, generator=torch.Generator().manual_seed(3))
        peak = measure_step_peak_bytes(model, StepInputs.from_example((x,)))
        opt = optimize(model, (x,), budget_gb=0.7 * peak / 2**30, timing_repeats=1, exact=False,
                       share_plan=share_plan)
        ddp = torch.nn.parallel.DistributedDataParallel(opt)
        ddp(x).sum().backward()
        grads = [float(p.grad.abs().sum()) for p in model.parameters()]
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump({"segments": [list(seg.node_names) for seg in opt.plan.segments], "grads": grads}, f)
    finally:
        dist.destroy_process_group()
    os._exit(0)  # as _errors_worker: no C++ static destructors at exit


@pytest.mark.parametrize("share_plan", [True, False])
def test_ranks_with_different_timings_run_rank_zeros_plan(share_plan, tmp_path):
    """Under torch.distributed rank 0 plans and every rank runs its plan; with ``share_plan``
    off, the skewed timings give rank 1 another plan (so the injection is what the shared
    plan overrides). DDP's gradients are the same on both ranks either way."""
    import torch.multiprocessing as mp

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if str(ROOT / "examples") not in sys.path:
        sys.path.insert(0, str(ROOT / "examples"))
    mp.spawn(_same_plan_worker, args=(2, free_port(), str(tmp_path), share_plan), nprocs=2, join=True)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["segments"], "the budget needs recompute"
    assert (ranks[0]["segments"] == ranks[1]["segments"]) is share_plan, ranks
    assert ranks[0]["grads"] == pytest.approx(ranks[1]["grads"], rel=1e-6)


class _Twice(torch.nn.Module):
    """``reused`` runs twice with another op between: its ops are not one contiguous piece."""

    def __init__(self) -> None:
        super().__init__()
        self.reused = torch.nn.Linear(8, 8)
        self.other = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.reused(self.other(self.reused(x)))


def test_fsdp_unit_hooks_run_around_a_block_and_refuse_split_modules():
    from planner import PlannerError
    from profiling import trace_module
    from rewrite.units import barrier_nodes, insert_unit_hooks

    sys.path.insert(0, str(ROOT / "examples"))
    from distributed_train import build

    model = build(16, 32, 2, 0.0)
    x = torch.randn(4, 16)
    gm = trace_module(model, (x,))
    assert len(barrier_nodes(gm.graph, ("blocks.0", "blocks.1"))) == 3  # each block's start, then the head
    seen = []
    model.blocks[1].register_forward_pre_hook(lambda module, args: seen.append(("enter", args[0].shape)))
    model.blocks[1].register_forward_hook(lambda module, args, out: seen.append(("exit", out[0].shape)))
    insert_unit_hooks(gm, model, ("blocks.1",))
    torch.testing.assert_close(gm(x), model(x))
    assert seen[:2] == [("enter", (4, 16)), ("exit", (4, 16))]

    twice = _Twice()
    gm = trace_module(twice, (torch.randn(2, 8),))
    with pytest.raises(PlannerError, match="interleaved"):
        insert_unit_hooks(gm, twice, ("reused",))


def test_segments_never_span_two_fsdp_units_and_hooks_run_once(monkeypatch):
    """The unit machinery without processes: plain hooks on four blocks stand in for FSDP's."""
    import rewrite.checkpointed_module as checkpointed_module
    from planner import simulate
    from planner.pipeline import CaptureOptions, Replanner
    from planner.core.plan import Plan, Segment
    from profiling import profile_graph, trace_module
    from profiling.measure import loss_of
    from rewrite.apply import CheckpointedModule, apply_plan

    sys.path.insert(0, str(ROOT / "examples"))
    from distributed_train import build

    model, x = build(64, 256, 4, 0.1), torch.randn(512, 64)
    # Before sharding: one segment recomputing everything recomputable, across all blocks.
    gm = trace_module(model, (x,))
    graph = profile_graph(gm, (x,), fake=True)  # roofline times: the re-solve is deterministic
    everything = Segment(tuple(n.name for n in graph.compute_nodes if n.recomputable), 0.0, 0)
    unoptimized = simulate(graph).peak_bytes
    plan = Plan(unoptimized, simulate(graph, [everything]).peak_bytes, unoptimized, (everything,), 0.0, 0.0, 0,
                "manual", 0.0)
    replan = Replanner(budget_gb=0.8 * unoptimized / 2**30, capture=CaptureOptions(timing_repeats=1))
    opt = CheckpointedModule(apply_plan(gm, plan), model, plan, cost_graph=graph, example_inputs=(x,),
                             replan=replan)
    units = tuple(f"blocks.{i}" for i in range(4))
    unit_of = {n.name: ".".join(n.module.split(".")[:2]) for n in graph.nodes}
    monkeypatch.setattr(checkpointed_module, "fsdp_unit_paths", lambda module: units)
    monkeypatch.setattr(checkpointed_module, "_distributed_world_size", lambda: 2)
    calls: list[str] = []
    for i, block in enumerate(model.blocks):
        block.register_forward_pre_hook(lambda module, args, i=i: calls.append(f"enter {i}"))
        block.register_forward_hook(lambda module, args, out, i=i: calls.append(f"exit {i}"))
    plan = opt.plan_for(x)
    assert plan.segments
    for seg in plan.segments:
        assert len({unit_of[name] for name in seg.node_names}) == 1, seg.node_names
    grads = []
    for module in (model, opt):
        model.zero_grad(set_to_none=True)
        calls.clear()
        torch.manual_seed(1)
        loss_of(module(x)).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        assert calls == [f"{what} {i}" for i in range(4) for what in ("enter", "exit")], calls
    model.zero_grad(set_to_none=True)
    assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])
