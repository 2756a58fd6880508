"""What running a segment under a selective checkpoint policy costs per node, measured.

A selective policy (``torch.utils.checkpoint.create_selective_checkpoint_contexts``, what a
plan with kept outputs runs) passes every op of its segment through a Python dispatch mode, in
the forward and again in the recompute. That cost does not depend on the op's size: on this
project's 2-core CPU it measured about 20 us per node, which is more than a small pointwise op
saves by being kept. :func:`selective_overhead_ms_per_node` measures it on the device at hand:
a chain of tiny ops run forward and backward under plain non-reentrant checkpoint and under a
selective policy that recomputes everything, interleaved, the difference of the two fastest
steps per node (load from other processes only adds time, so the fastest steps are the least
disturbed; the median of paired differences came out at zero under a parallel test run). The
planner charges it to every node of a segment that keeps outputs (:mod:`planner.solvers.keep`).

On a GPU the figure is the CPU time the mode adds per node; with kernels long enough to keep
the GPU busy it is hidden, so there it is an upper bound.

Example:
    >>> import torch
    >>> overhead_ms = selective_overhead_ms_per_node(torch.device("cpu"), nodes=16, repeats=3)
    >>> overhead_ms >= 0.0
    True
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

__all__ = ["selective_overhead_ms_per_node"]


def _recompute_all(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.PREFER_RECOMPUTE


def _chain(x: torch.Tensor, nodes: int) -> torch.Tensor:
    for _ in range(nodes):
        x = torch.sin(x)
    return x


def _step_s(x: torch.Tensor, nodes: int, selective: bool) -> float:
    started = time.perf_counter()
    if selective:
        y = checkpoint(_chain, x, nodes, use_reentrant=False, preserve_rng_state=True,
                       context_fn=lambda: create_selective_checkpoint_contexts(_recompute_all))
    else:
        y = checkpoint(_chain, x, nodes, use_reentrant=False, preserve_rng_state=True)
    y.sum().backward()
    if x.device.type == "cuda":
        torch.cuda.synchronize(x.device)
    return time.perf_counter() - started


def selective_overhead_ms_per_node(device: torch.device, *, nodes: int = 64, repeats: int = 9) -> float:
    """Extra milliseconds one node of a checkpointed segment costs over a training step
    (forward plus recompute) when the segment runs under a selective policy, measured on
    ``device`` (fastest of ``repeats`` interleaved steps each, after a warm-up pair; at least 0).

    Example:
        >>> import torch
        >>> selective_overhead_ms_per_node(torch.device("cpu"), nodes=8, repeats=1) >= 0.0
        True
    """
    x = torch.linspace(-1.0, 1.0, 16, device=device, requires_grad=True)  # leaves the RNG untouched
    with torch.enable_grad():
        _step_s(x, nodes, False), _step_s(x, nodes, True)  # warm-up
        plain_s, selective_s = [], []
        for _ in range(repeats):
            plain_s.append(_step_s(x, nodes, False))
            selective_s.append(_step_s(x, nodes, True))
    return max(0.0, (min(selective_s) - min(plain_s)) * 1e3 / nodes)
