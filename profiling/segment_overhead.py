"""What one checkpointed segment costs a training step beyond recomputing its nodes, measured.

A segment of the rewritten module runs its GraphModule's ``forward`` under non-reentrant
``torch.utils.checkpoint`` with the RNG state preserved (:mod:`rewrite.segments`). Besides its
nodes' time, each one pays for the checkpoint call in the forward (RNG state saved, hooks set
up), for its recompute in the backward (hooks on every saved tensor, the RNG state restored,
the exception that stops the recompute at its last saved tensor) and for the unpacking of what
it saved. Per segment that does not depend on the segment's size: on this project's 2-core CPU
about 0.1 ms, comparable to a small pointwise node, so a plan of many short segments
costs more than its nodes' times add up to (docs/tuning.md#segment_overhead_ms).
:func:`segment_overhead_ms` measures it on the device at hand: a chain of tiny captured
segments run forward and backward with and without checkpoint, interleaved, the difference of
the fastest steps per segment less the tiny segment's own forward. The planner charges it to
every segment that recomputes anything (:mod:`planner.core.rerun`).

Example:
    >>> import torch
    >>> segment_overhead_ms(torch.device("cpu"), segments=8, repeats=2) >= 0.0
    True
"""

from __future__ import annotations

import time

import torch
import torch.fx
from torch.utils.checkpoint import checkpoint

__all__ = ["segment_overhead_ms"]


class _TinySegment(torch.nn.Module):
    """Three ops that save tensors for backward, the last saving before it computes (so a
    recompute stops inside it, as most segments' recomputes do)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.sin(x)
        z = torch.cos(y)
        return z * y


def _step_s(forward, x: torch.Tensor, segments: int, checkpointed: bool) -> float:
    started = time.perf_counter()
    y = x
    for _ in range(segments):
        y = checkpoint(forward, y, use_reentrant=False, preserve_rng_state=True) if checkpointed else forward(y)
    y.sum().backward()
    if x.device.type == "cuda":
        torch.cuda.synchronize(x.device)
    return time.perf_counter() - started


def _forward_s(forward, x: torch.Tensor, segments: int) -> float:
    started = time.perf_counter()
    with torch.no_grad():
        y = x
        for _ in range(segments):
            y = forward(y)
    if x.device.type == "cuda":
        torch.cuda.synchronize(x.device)
    return time.perf_counter() - started


def segment_overhead_ms(device: torch.device, *, segments: int = 32, repeats: int = 7) -> float:
    """Extra milliseconds one checkpointed segment costs a training step beyond its nodes'
    forward time, measured on ``device`` (fastest of ``repeats`` interleaved steps each, after
    a warm-up; at least 0).

    Example:
        >>> import torch
        >>> segment_overhead_ms(torch.device("cpu"), segments=4, repeats=1) >= 0.0
        True
    """
    forward = torch.fx.symbolic_trace(_TinySegment()).to(device).forward
    x = torch.linspace(-1.0, 1.0, 16, device=device, requires_grad=True)  # leaves the RNG untouched
    with torch.enable_grad():
        _step_s(forward, x, segments, False), _step_s(forward, x, segments, True)  # warm-up
        plain_s, checkpointed_s, forward_s = [], [], []
        for _ in range(repeats):
            plain_s.append(_step_s(forward, x, segments, False))
            checkpointed_s.append(_step_s(forward, x, segments, True))
            forward_s.append(_forward_s(forward, x, segments))
    return max(0.0, (min(checkpointed_s) - min(plain_s) - min(forward_s)) * 1e3 / segments)
