"""What checkpointing itself costs on the device at hand, measured once per machine.

A plan's time is its nodes' recompute time plus two overheads that do not depend on the nodes:
each checkpointed segment's call and recompute machinery (:mod:`profiling.segment_overhead`)
and each node run under a selective save policy (:mod:`profiling.selective_overhead`). Both
are measured on the device, 0.1 to 0.3 s together on a CPU, and kept: for the process, and
where a profile cache is set, in a file beside the profiles
(:func:`profiling.cache.device_overheads_path`). Every profile made on the machine (another batch
shape planned during training, another model, another run) then charges the same figures, so
plans do not move with their noise, and only the machine's first profile pays the measurement.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import NamedTuple

import torch

from profiling.segment_overhead import segment_overhead_ms
from profiling.selective_overhead import selective_overhead_ms_per_node

__all__ = ["DeviceOverheads", "device_overheads_ms"]

log = logging.getLogger(__name__)


class DeviceOverheads(NamedTuple):
    """What a checkpointed segment and a selective policy cost on a device beyond the nodes'
    own time (:mod:`profiling.segment_overhead`, :mod:`profiling.selective_overhead`)."""

    segment_ms: float
    selective_ms_per_node: float


def device_overheads_ms(device: torch.device, stored_at: Path | None = None) -> DeviceOverheads:
    """The device's segment and selective-policy overheads, measured once per process, device
    and thread count; with ``stored_at`` (a file naming this machine, device and thread count),
    the figures that file holds, else the measured ones, written there for the next process.
    A file that cannot be read is measured again and replaced; one that cannot be written leaves
    the figures to this process.

    Example:
        >>> import tempfile
        >>> from pathlib import Path
        >>> first = device_overheads_ms(torch.device("cpu"))
        >>> device_overheads_ms(torch.device("cpu")) is first
        True
        >>> with tempfile.TemporaryDirectory() as d:
        ...     path = Path(d) / "overheads.json"
        ...     _ = path.write_text('{"segment_ms": 0.25, "selective_ms_per_node": 0.02}')
        ...     device_overheads_ms(torch.device("cpu"), path)   # another process's measurement
        DeviceOverheads(segment_ms=0.25, selective_ms_per_node=0.02)
    """
    if stored_at is not None:
        stored = _read(stored_at)
        if stored is not None:
            return stored
    measured = _measured_overheads(str(device), torch.get_num_threads())
    if stored_at is not None:
        _write(stored_at, measured)
    return measured


@functools.lru_cache(maxsize=None)
def _measured_overheads(device: str, threads: int) -> DeviceOverheads:
    where = torch.device(device)
    return DeviceOverheads(segment_overhead_ms(where), selective_overhead_ms_per_node(where))


def _read(path: Path) -> DeviceOverheads | None:
    """The figures ``path`` holds, or None where it is missing or not such a file."""
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        found = DeviceOverheads(float(data["segment_ms"]), float(data["selective_ms_per_node"]))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("could not read the device overheads %s (%s: %s); measuring them again", path,
                    type(exc).__name__, exc)
        return None
    if min(found) < 0.0:
        log.warning("the device overheads %s hold a negative time; measuring them again", path)
        return None
    return found


def _write(path: Path, overheads: DeviceOverheads) -> None:
    """Store ``overheads`` at ``path`` atomically (a reader never sees half a file)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as fh:
                json.dump(overheads._asdict(), fh)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as exc:
        log.debug("device overheads not kept at %s: %s", path, exc)
