"""Where to aim an eager plan so that its compiled step peaks in the budget's room. Torch-free.

The profile is the eager step's, and a compiled step peaks lower: fused kernels keep fewer
temporaries, so compile saves a share of the activations while parameters, inputs and
gradients stay as they are. How much it saves shrinks as more is recomputed (less is left to
fuse away), so the saving measured on the unoptimized step is no fixed allowance. Each plan
compiled and measured gives a pair (its eager prediction, its compiled measurement); the next
eager target is read off the line through the last two pairs, and before any plan is measured,
off the line through the unoptimized pair and the bytes held all step (which compile does not
change). How well the line fits: docs/tuning.md#slope_range. A compiled peak can jump between
two plans (a plan a little lower in eager terms can compile much lower), so a target is also kept
between the highest eager prediction that fitted and the lowest that did not
(:func:`within_bracket`).

Example:
    >>> pairs = [PeakPair(eager_predicted_bytes=200, compiled_measured_bytes=140)]
    >>> eager_target_bytes(pairs, compiled_target_bytes=80, fixed_bytes=20)   # line through (20, 20) and (200, 140)
    110
    >>> pairs.append(PeakPair(110, 90))                  # the plan for 110 measured 90 compiled
    >>> eager_target_bytes(pairs, compiled_target_bytes=80, fixed_bytes=20)   # line through the last two
    92
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["PeakPair", "eager_target_bytes", "within_bracket"]

#: Slopes (compiled bytes per eager byte) a line through two measured pairs may take. Outside
#: it (two plans whose compiled peaks barely differ, or a floor the plans do not move) the next
#: target would land far off; the line through the held bytes is used instead
#: (docs/tuning.md#slope_range).
SLOPE_RANGE = (0.2, 2.0)


@dataclass(frozen=True)
class PeakPair:
    """One step's peak two ways: the simulator's prediction for the eager step, and the
    compiled step's peak measured at the allocator."""

    eager_predicted_bytes: int
    compiled_measured_bytes: int


def _slope(low: PeakPair, high: PeakPair) -> float | None:
    run = high.eager_predicted_bytes - low.eager_predicted_bytes
    if run == 0:
        return None
    slope = (high.compiled_measured_bytes - low.compiled_measured_bytes) / run
    return slope if SLOPE_RANGE[0] <= slope <= SLOPE_RANGE[1] else None


def eager_target_bytes(pairs: Sequence[PeakPair], compiled_target_bytes: int, fixed_bytes: int) -> int:
    """The eager peak to plan for so that the compiled step peaks at ``compiled_target_bytes``:
    on the line through the last two ``pairs``, or (one pair, or a slope outside
    :data:`SLOPE_RANGE`) through the last pair and ``(fixed_bytes, fixed_bytes)``, the bytes
    held all step; the last pair itself where neither line is usable. See the module example."""
    if not pairs:
        raise ValueError("eager_target_bytes needs at least one measured pair")
    last = pairs[-1]
    slope = _slope(pairs[-2], last) if len(pairs) > 1 else None
    if slope is None:
        slope = _slope(PeakPair(fixed_bytes, fixed_bytes), last)
    if slope is None:
        return last.eager_predicted_bytes
    return round(last.eager_predicted_bytes + (compiled_target_bytes - last.compiled_measured_bytes) / slope)


def within_bracket(target_bytes: int, pairs: Sequence[PeakPair], room_bytes: int) -> int:
    """``target_bytes`` where it lies strictly between the highest eager prediction whose compiled
    step measured within ``room_bytes`` and the lowest one above it that measured over; otherwise
    that bracket's midpoint. Without a measurement on both sides, ``target_bytes`` itself.

    Example:
        >>> pairs = [PeakPair(200, 150), PeakPair(160, 130), PeakPair(130, 90)]  # room 120
        >>> within_bracket(170, pairs, room_bytes=120)    # above the lowest that measured over
        145
        >>> within_bracket(150, pairs, room_bytes=120)
        150
    """
    fitted = [p.eager_predicted_bytes for p in pairs if p.compiled_measured_bytes <= room_bytes]
    if not fitted:
        return target_bytes
    low = max(fitted)
    over = [p.eager_predicted_bytes for p in pairs
            if p.compiled_measured_bytes > room_bytes and p.eager_predicted_bytes > low]
    if not over:
        return target_bytes
    high = min(over)
    return target_bytes if low < target_bytes < high else (low + high) // 2
