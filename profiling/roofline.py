"""Estimated op time from FLOPs and bytes moved, for planning without running on the device.

``time = max(flops / peak_flops, bytes_moved / bandwidth)``: a roofline that, unlike FLOPs
alone, charges pointwise ops for the memory traffic that dominates their cost.

Example:
    >>> round(estimate_ms(flops=2e12, bytes_moved=0, target="h100"), 3) > 0
    True
    >>> DEVICE_SPECS["h100"].memory_bytes / 2**30   # a budget_gb for planning on a CPU machine
    74.50580596923828
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.core.errors import PlannerError

__all__ = ["DeviceSpec", "DEVICE_SPECS", "estimate_ms"]


@dataclass(frozen=True)
class DeviceSpec:
    """Peak dense float32 FLOP/s (tensor-core TF32 where the device has it), memory bandwidth, and
    the device's memory in bytes (a natural ``budget_gb``: ``memory_bytes / 2**30``; 0 when not
    fixed)."""

    flops_per_s: float
    bytes_per_s: float
    memory_bytes: int = 0


# Public datasheet figures (SXM parts); "cpu" is a modest 2-core machine.
DEVICE_SPECS: dict[str, DeviceSpec] = {
    "cpu": DeviceSpec(flops_per_s=1.0e11, bytes_per_s=2.0e10),
    "l4": DeviceSpec(flops_per_s=60e12, bytes_per_s=0.3e12, memory_bytes=24 * 10**9),
    "a100": DeviceSpec(flops_per_s=156e12, bytes_per_s=1.555e12, memory_bytes=40 * 10**9),
    "a100-80gb": DeviceSpec(flops_per_s=156e12, bytes_per_s=2.039e12, memory_bytes=80 * 10**9),
    "h100": DeviceSpec(flops_per_s=494e12, bytes_per_s=3.35e12, memory_bytes=80 * 10**9),
    "h200": DeviceSpec(flops_per_s=494e12, bytes_per_s=4.8e12, memory_bytes=141 * 10**9),
}


def estimate_ms(flops: float, bytes_moved: float, target: str = "cpu") -> float:
    """Roofline time of one op on ``target`` (a key of :data:`DEVICE_SPECS`), in milliseconds.

    Example:
        >>> estimate_ms(flops=0, bytes_moved=3.35e9, target="h100")   # 1 ms of HBM traffic
        1.0
    """
    spec = DEVICE_SPECS.get(target.lower())
    if spec is None:
        raise PlannerError(f"unknown target device {target!r}; use one of {sorted(DEVICE_SPECS)}")
    return 1e3 * max(flops / spec.flops_per_s, bytes_moved / spec.bytes_per_s)
