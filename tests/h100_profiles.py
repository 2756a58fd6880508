"""Where the tests find the profiles measured on an NVIDIA H100: ``tests/data/h100/`` (its README
says how they were measured)."""

from __future__ import annotations

from pathlib import Path

H100_PROFILES = Path(__file__).resolve().parent / "data" / "h100"
