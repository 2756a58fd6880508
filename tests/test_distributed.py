"""The optimized module under DDP and FSDP2 (``fully_shard``): two CPU processes on gloo.

``examples/distributed_train.py`` runs under ``torchrun --nproc-per-node 2`` on localhost; its
averaged gradients and trained parameters must equal one process training on the whole
batch. What cannot work (``fully_shard`` on submodules, unplanned shapes under
``torch.distributed``) must be a clear ``PlannerError`` on every rank.
"""

from __future__ import annotations

import json
import os
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
        "--dropout", "0", "--budget-fraction", "0.7", "--lr", "0.05"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def env() -> dict[str, str]:
    out = dict(os.environ)
    out["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "examples"), out.get("PYTHONPATH", "")])
    out["OMP_NUM_THREADS"] = "1"
    return out


def torchrun(mode: str, out: Path) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), str(EXAMPLE), "--mode", mode, "--out", str(out), *ARGS]
    proc = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
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
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_two_ranks_train_like_one_process(mode, tmp_path, reference):
    summary = torchrun(mode, tmp_path)
    assert summary["world_size"] == 2 and summary["segments"] > 0, summary
    assert summary["wrapper"] == ("DistributedDataParallel" if mode == "ddp" else "FSDPCheckpointedModule")
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
    """Each rank: fully_shard on a submodule and an unplanned shape under DDP raise PlannerError."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from distributed_train import build
    from planner import PlannerError, optimize

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        x = torch.randn(64, 64)
        opt = optimize(build(64, 256, 2, 0.0), (x,), budget_gb=1.0)
        fully_shard(opt.blocks[0], mesh=init_device_mesh("cpu", (world_size,)))
        fully_shard(opt, mesh=init_device_mesh("cpu", (world_size,)))
        try:
            opt(x)
        except PlannerError as exc:
            assert "fully_shard was applied to submodules" in str(exc) and "blocks.0" in str(exc), exc
        else:
            raise AssertionError("fully_shard on a submodule must be refused")

        opt = optimize(build(64, 256, 2, 0.0), (x,), budget_gb=1.0)
        opt.plan_for(torch.randn(32, 64))  # planned ahead: fine under DDP
        ddp = torch.nn.parallel.DistributedDataParallel(opt)
        ddp(torch.randn(32, 64)).sum().backward()
        try:
            ddp(torch.randn(16, 64))
        except PlannerError as exc:
            assert "under torch.distributed" in str(exc) and "plan_for" in str(exc), exc
        else:
            raise AssertionError("an unplanned shape under DDP must be refused")
    finally:
        dist.destroy_process_group()


def test_what_cannot_work_is_a_clear_error_on_every_rank():
    import torch.multiprocessing as mp

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if str(ROOT / "examples") not in sys.path:
        sys.path.insert(0, str(ROOT / "examples"))
    mp.spawn(_errors_worker, args=(2, free_port()), nprocs=2, join=True)
