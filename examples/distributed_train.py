"""Train an optimized module under DDP or FSDP2 (``fully_shard``), one process per rank.

    torchrun --nproc-per-node 2 examples/distributed_train.py --mode ddp
    torchrun --nproc-per-node 2 examples/distributed_train.py --mode fsdp --steps 5

CPU processes talk over gloo (NCCL when every rank has a GPU). Each rank plans its own step
(its share of the global batch) with ``optimize``, then wraps the optimized module:

* DDP: ``DistributedDataParallel(opt)``; gradients are averaged across ranks in backward.
* FSDP2: ``fully_shard(opt, mesh=...)`` on the optimized module itself (the root). The
  rewritten graph does not call submodules, so ``fully_shard`` on submodules is refused with
  a ``PlannerError``: their hooks would never run.

Plan every batch shape before wrapping: profiling a new shape runs a backward, which DDP and
FSDP hooks must not see, so an unplanned shape under ``torch.distributed`` raises. With
``--out DIR`` rank 0 writes the trained parameters (``params.pt``), the first step's averaged
gradients (``grads.pt``) and a JSON summary, which the tests compare with one process.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from models import ResidualMLP  # examples/models.py, next to this script

log = logging.getLogger("distributed_train")


def build(width: int = 64, hidden: int = 256, blocks: int = 4, dropout: float = 0.0,
          seed: int = 0) -> ResidualMLP:
    """The model every rank (and a single-process reference) starts from: residual blocks and
    a one-output regression head."""
    torch.manual_seed(seed)
    return ResidualMLP(width, hidden, blocks, classes=1, dropout=dropout).train()


def batches(steps: int, global_batch: int, width: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The same global batches on every rank: inputs and regression targets."""
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(global_batch, width, generator=gen), torch.randn(global_batch, 1, generator=gen))
            for _ in range(steps)]


def local_shard(t: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    return t.chunk(world_size)[rank].contiguous()


def full(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor from a parameter or gradient that may be an FSDP2 ``DTensor`` shard."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def running_peak_bytes(fn) -> int:
    """Bytes ``fn`` adds at its high point on this rank, from the CPU profiler's memory events
    (``profiling.measure``'s method; on CUDA, ``max_memory_allocated`` minus the start)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        start = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - start
    from profiling.measure import _running_peak_bytes

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return _running_peak_bytes(prof)


def held_bytes(module: nn.Module, *tensors: torch.Tensor) -> int:
    """This rank's bytes of parameters (local shards under FSDP), buffers and inputs."""
    seen: dict[int, int] = {}
    for t in (*module.parameters(), *module.buffers(), *tensors):
        local = t.to_local() if hasattr(t, "to_local") else t
        seen[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
    return sum(seen.values())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=("ddp", "fsdp", "fsdp-blocks"), default="ddp",
                        help="fsdp: fully_shard on the optimized module; fsdp-blocks: on every block, then on it")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--global-batch", type=int, default=1024)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--budget-fraction", type=float, default=0.8,
                        help="budget as a fraction of this rank's measured unoptimized peak")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--out", type=Path, help="rank 0 writes params.pt, grads.pt and summary.json here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    for noisy in ("profiling", "planner", "rewrite"):
        logging.getLogger(noisy).setLevel(logging.WARNING)

    from planner import optimize
    from profiling import StepInputs, measure_step_peak_bytes

    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    try:
        if args.global_batch % world_size:
            raise SystemExit(f"--global-batch {args.global_batch} is not divisible by {world_size} ranks")
        data = [(local_shard(x, rank, world_size).to(device), local_shard(y, rank, world_size).to(device))
                for x, y in batches(args.steps, args.global_batch, args.width)]
        model = build(args.width, args.hidden, args.blocks, args.dropout).to(device)
        example = (data[0][0],)
        peak_bytes = measure_step_peak_bytes(model, StepInputs.from_example(example))
        # Every rank must reach the same decision; each plans its own (identical) local step.
        sharded = args.mode == "fsdp-blocks"
        # What the wrapper holds besides the model's step, set aside with reserve_gb: DDP keeps a
        # gradient bucket per parameter byte all step; root-only fully_shard gathers every
        # parameter (measured about 1.2x the parameter bytes). Per-block fully_shard is in the
        # memory model itself (world_size: shards plus the units in flight).
        param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        reserve_bytes = {"ddp": 1.0, "fsdp": 1.5, "fsdp-blocks": 0.0}[args.mode] * param_bytes
        # exact=False: the chain DP alone, no MILP in the ranks; a MILP solver stuck in one rank
        # (HiGHS 1.16's presolve loop, docs/tuning.md OVERRUN_S) would hold the others at the barrier
        opt = optimize(model, example, budget_gb=args.budget_fraction * peak_bytes / 2**30,
                       reserve_gb=reserve_bytes / 2**30, world_size=world_size if sharded else 1, exact=False)
        plan = opt.plan
        if args.mode == "ddp":
            wrapped: nn.Module = nn.parallel.DistributedDataParallel(opt)
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh(device.type, (world_size,))
            if sharded:  # each block gathers its parameters only while it runs
                for block in opt.blocks:
                    fully_shard(block, mesh=mesh)
            wrapped = fully_shard(opt, mesh=mesh)
        sgd = torch.optim.SGD(wrapped.parameters(), lr=args.lr)
        torch.manual_seed(100 + rank)  # dropout masks differ per rank, as in real data parallelism
        losses, first_grads = [], {}
        measured_peak = 0
        for step, (x, y) in enumerate(data):
            sgd.zero_grad(set_to_none=True)
            losses_now: list[torch.Tensor] = []

            def forward_backward() -> None:
                loss = nn.functional.mse_loss(wrapped(x), y)
                loss.backward()
                losses_now.append(loss.detach())

            if step == 1:  # the first step re-plans for FSDP units; measure the next one
                measured_peak = held_bytes(wrapped, x, y) + running_peak_bytes(forward_backward)
            else:
                forward_backward()
            loss = losses_now[0]
            if step == 0:
                first_grads = {name: full(p.grad).detach().cpu().clone() for name, p in opt.named_parameters()}
            sgd.step()
            total = loss.detach().clone()
            dist.all_reduce(total)
            losses.append(float(total) / world_size)
            if rank == 0:
                log.info("step %d: mean loss %.5f", step, losses[-1])
        params = {name: full(p).detach().cpu().clone() for name, p in opt.named_parameters()}
        sgd.zero_grad(set_to_none=True)
        plan = opt.plan_for(*example)  # the plan in use (re-solved for FSDP units when sharded)
        wrapped.eval()  # eval runs the user's own module, reading the same (gathered) parameters
        with torch.no_grad():
            eval_loss = nn.functional.mse_loss(wrapped(data[0][0]), data[0][1])
        dist.all_reduce(eval_loss)
        eval_loss = float(eval_loss) / world_size
        if rank == 0:
            log.info("eval loss on the first batch after training: %.5f", eval_loss)
        if rank == 0:
            log.info("%s on %d ranks: unoptimized peak %.1f MiB per rank (one process, its batch share), "
                     "budget %.1f MiB, predicted %.1f MiB, measured %.1f MiB (step 1, rank 0), %d segments",
                     args.mode, world_size, peak_bytes / 2**20, plan.budget_bytes / 2**20,
                     plan.predicted_peak_bytes / 2**20, measured_peak / 2**20, len(plan.segments))
        if rank == 0 and args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            torch.save(params, args.out / "params.pt")
            torch.save(first_grads, args.out / "grads.pt")
            summary = {
                "mode": args.mode, "world_size": world_size, "losses": losses, "eval_loss": eval_loss,
                "segments": len(plan.segments),
                "unoptimized_peak_bytes": peak_bytes, "budget_bytes": plan.budget_bytes,
                "predicted_peak_bytes": plan.predicted_peak_bytes, "measured_peak_bytes": measured_peak,
                "wrapper": type(wrapped).__name__,
            }
            (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
        dist.barrier()  # leave together: a rank tearing gloo down while another still talks aborts
    finally:
        dist.destroy_process_group()
    # Every rank has finished and destroyed its process group. Leave from here, before this
    # frame's locals are freed, and without C++ static destructors: DDP and FSDP keep their gloo
    # process group, and its threads, alive after destroy_process_group (torch 2.13: three gloo
    # threads per rank at exit, also for a plain DDP model). Freeing the DDP wrapper then destroys
    # that group, whose destructor joins those threads; in CI a rank hung there for good once the
    # other had left (its stack: Reducer -> ProcessGroupGloo destructor -> thread join), and a
    # finished run aborted at exit once ("terminate called without an active exception"). An
    # error above exits the usual way.
    _exit_now()


def _exit_now() -> None:
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
