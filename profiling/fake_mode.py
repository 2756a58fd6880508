"""Profiling on fake tensors: the real-to-fake converter and roofline times for the nodes.

Under ``FakeTensorMode`` nothing is allocated or run for real, so bytes come from tensor sizes
and each node's time from a FLOP and bytes roofline for a target device
(:mod:`profiling.roofline`).

Example:
    >>> import torch
    >>> to_fake, mode = fake_converter()
    >>> x = torch.ones(2, 3)
    >>> to_fake(x) is to_fake(x), tuple(to_fake(x).shape)
    (True, (2, 3))
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode

from profiling.interpreter import tensors_of
from profiling.roofline import estimate_ms

__all__ = ["fake_converter", "roofline_times"]


def fake_converter() -> tuple[Callable[[torch.Tensor], torch.Tensor], Any]:
    """A FakeTensorMode and a memoised real-to-fake converter (same real tensor, same fake)."""
    mode = FakeTensorMode()
    made: dict[int, torch.Tensor] = {}
    keep: list[torch.Tensor] = []

    def to_fake(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in made:
            made[id(t)] = mode.from_tensor(t, static_shapes=True)
            keep.append(t)  # the id stays this tensor's while the converter lives
        return made[id(t)]

    return to_fake, mode


def roofline_times(gm: torch.fx.GraphModule, records: dict[str, dict[str, Any]], target: str) -> None:
    """Replace the (meaningless) fake-tensor timings in ``records`` by roofline estimates for
    ``target``: the node's FLOPs and the bytes of the tensors it reads and makes."""
    for n in gm.graph.nodes:
        rec = records.get(n.name)
        if rec is None or n.op not in ("call_function", "call_method", "call_module"):
            continue
        moved = sum(t.numel() * t.element_size() for t in tensors_of(rec["result"]))
        for a in n.all_input_nodes:
            moved += sum(t.numel() * t.element_size() for t in tensors_of(records[a.name]["result"]))
        rec["time_ms"] = estimate_ms(rec["flops"], moved, target)
