"""Byte units, declared once: ``MIB`` and ``GIB`` (budgets are in GiB, 2**30 bytes).

Example:
    >>> format_bytes(3 * MIB), format_bytes(GIB + GIB // 2)
    ('3.0 MiB', '1.500 GiB')
"""

from __future__ import annotations

__all__ = ["MIB", "GIB", "format_bytes"]

MIB = 2**20
GIB = 2**30


def format_bytes(size_bytes: float) -> str:
    """``size_bytes`` in GiB from one GiB up, else in MiB."""
    return f"{size_bytes / GIB:.3f} GiB" if size_bytes >= GIB else f"{size_bytes / MIB:.1f} MiB"
