"""What each op of a checkpointed op range costs a training step beyond its own recompute, measured.

On the graph-break path a segment is a range of dispatched ops (:mod:`rewrite.op_regions`):
each op of the range is recorded as the forward dispatches it (its arguments flattened, its
inputs and outputs registered) and replayed in the backward through the same Python loop, so a
range costs, per op, more than the op's own time. On a small model's ops that is as much as the
op itself (about 15 microseconds on a 2-core CPU against a few for a small pointwise kernel),
and a plan of many ops in ranges steps slower than its nodes' times add up to.
:func:`range_overhead_ms_per_op` measures it on the device at hand: a chain of tiny ops run
forward and backward under a :class:`rewrite.op_regions.RegionRunner` with one range over all of
them and with none, interleaved; the difference of the fastest steps per op, less the op's own
forward time. The graph-break planner charges it to each node of a recomputed segment
(``CostGraph.range_overhead_ms_per_node``, :mod:`planner.core.rerun`).

Example:
    >>> import torch
    >>> range_overhead_ms_per_op(torch.device("cpu"), ops=30, repeats=2) >= 0.0
    True
"""

from __future__ import annotations

import functools
import time

import torch

from rewrite.op_regions import RegionRunner

__all__ = ["range_overhead_ms_per_op", "measured_range_overhead_ms_per_op"]


def _chain(x: torch.Tensor, ops: int) -> torch.Tensor:
    y = x
    for _ in range(ops // 3):  # three ops, each saving a tensor for backward
        y = torch.cos(torch.sin(y)) * y
    return y


def _sync(x: torch.Tensor) -> None:
    if x.device.type == "cuda":
        torch.cuda.synchronize(x.device)


def _step_s(x: torch.Tensor, ops: int, ranged: bool) -> float:
    started = time.perf_counter()
    with RegionRunner(((0, ops - 1),) if ranged else ()):
        loss = _chain(x, ops).sum()
    loss.backward()
    _sync(x)
    return time.perf_counter() - started


def _forward_s(x: torch.Tensor, ops: int) -> float:
    started = time.perf_counter()
    with torch.no_grad():
        _chain(x, ops)
    _sync(x)
    return time.perf_counter() - started


def range_overhead_ms_per_op(device: torch.device, *, ops: int = 300, repeats: int = 7) -> float:
    """Extra milliseconds one op in a checkpointed op range costs a training step beyond its own
    forward time, on ``device`` (fastest of ``repeats`` interleaved steps each, after a warm-up;
    at least 0). See the module example."""
    ops -= ops % 3
    x = torch.linspace(-1.0, 1.0, 16, device=device, requires_grad=True)  # leaves the RNG untouched
    with torch.enable_grad():
        _step_s(x, ops, False), _step_s(x, ops, True)  # warm-up
        plain_s, ranged_s, forward_s = [], [], []
        for _ in range(repeats):
            plain_s.append(_step_s(x, ops, False))
            ranged_s.append(_step_s(x, ops, True))
            forward_s.append(_forward_s(x, ops))
    return max(0.0, (min(ranged_s) - min(plain_s) - min(forward_s)) * 1e3 / ops)


def measured_range_overhead_ms_per_op(device: torch.device) -> float:
    """:func:`range_overhead_ms_per_op` on ``device``, measured once per process, device and
    thread count (about 0.1 s on a CPU): every graph-break plan of the process charges the same
    figure, so plans do not move with its noise.

    Example:
        >>> import torch
        >>> first = measured_range_overhead_ms_per_op(torch.device("cpu"))
        >>> measured_range_overhead_ms_per_op(torch.device("cpu")) == first
        True
    """
    return _measured(str(device), torch.get_num_threads())


@functools.lru_cache(maxsize=None)
def _measured(device: str, threads: int) -> float:
    return range_overhead_ms_per_op(torch.device(device))
