"""What checkpointing itself costs on the device at hand, measured once per process.

A plan's time is its nodes' recompute time plus two overheads that do not depend on the nodes:
each checkpointed segment's call and recompute machinery (:mod:`profiling.segment_overhead`)
and each node run under a selective save policy (:mod:`profiling.selective_overhead`). Both
are measured on the device, about 0.14 s together on a CPU, and kept for the process: every
profile it makes (another batch shape planned during training, another model) charges the same
figures, so plans do not move with their noise.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from profiling.segment_overhead import segment_overhead_ms
from profiling.selective_overhead import selective_overhead_ms_per_node

__all__ = ["DeviceOverheads", "device_overheads_ms"]


class DeviceOverheads(NamedTuple):
    """What a checkpointed segment and a selective policy cost on a device beyond the nodes'
    own time (:mod:`profiling.segment_overhead`, :mod:`profiling.selective_overhead`)."""

    segment_ms: float
    selective_ms_per_node: float


def device_overheads_ms(device: torch.device) -> DeviceOverheads:
    """The device's segment and selective-policy overheads, measured once per process, device
    and thread count (about 0.14 s on a CPU): every profile of the process (another batch shape
    planned during training, another model) charges the same figures, so a plan does not move
    with their noise.

    Example:
        >>> import torch
        >>> first = device_overheads_ms(torch.device("cpu"))
        >>> device_overheads_ms(torch.device("cpu")) is first
        True
    """
    return _measured_overheads(str(device), torch.get_num_threads())


@functools.lru_cache(maxsize=None)
def _measured_overheads(device: str, threads: int) -> DeviceOverheads:
    where = torch.device(device)
    return DeviceOverheads(segment_overhead_ms(where), selective_overhead_ms_per_node(where))
