"""Typed exceptions raised across the pipeline.

All of them derive from :class:`PlannerError`, so ``except PlannerError`` catches every
failure this package raises on purpose.
"""

from __future__ import annotations

import math
from typing import Any
from planner.core.units import GIB

__all__ = ["PlannerError", "InputError", "InfeasibleBudgetError", "TraceError", "ProfileError", "SolverError",
           "check_max_stages", "check_time_limit"]


class PlannerError(Exception):
    """Base class of every error raised by the checkpoint planner."""


class InputError(PlannerError, ValueError):
    """An argument cannot be planned for: a bad budget, a model in eval mode or on the meta
    device, nothing to train, example inputs that do not fit ``forward``. The message says what
    to change."""


class InfeasibleBudgetError(PlannerError):
    """No plan the planner found keeps the simulated peak under the budget.

    ``min_feasible_bytes`` is the smallest budget found to work, so a user can retry with
    ``budget_gb`` at or above ``min_feasible_bytes / 2**30``; the message's GiB figure is
    rounded up, so it works too. ``unoptimized_peak_bytes`` (None where unknown) is the peak of
    the step with nothing recomputed, which the message names too. ``note`` (one sentence, may
    be empty) ends the message: another way to a lower floor, e.g. ``chunk_loss=True``.

    Example:
        >>> print(InfeasibleBudgetError(2**29, 3 * 2**29, unoptimized_peak_bytes=2**31))  # doctest: +ELLIPSIS
        budget 0.5000 GiB (536870912 bytes) is below the smallest peak the planner found (the unoptimized step peaks at 2.0000 GiB); the smallest feasible budget is 1.5000 GiB (1610612736 bytes): ...
    """

    def __init__(self, budget_bytes: int, min_feasible_bytes: int, note: str = "",
                 unoptimized_peak_bytes: int | None = None) -> None:
        self.budget_bytes = int(budget_bytes)
        self.min_feasible_bytes = int(min_feasible_bytes)
        self.note = note
        self.unoptimized_peak_bytes = None if unoptimized_peak_bytes is None else int(unoptimized_peak_bytes)
        min_feasible_gb = math.ceil(self.min_feasible_bytes / GIB * 1e4) / 1e4
        unoptimized = ("" if self.unoptimized_peak_bytes is None else
                       f" (the unoptimized step peaks at {self.unoptimized_peak_bytes / GIB:.4f} GiB)")
        super().__init__(
            f"budget {budget_bytes / GIB:.4f} GiB ({budget_bytes} bytes) is below the smallest peak "
            f"the planner found{unoptimized}; the smallest feasible budget is {min_feasible_gb:.4f} GiB "
            f"({min_feasible_bytes} bytes): raise budget_gb to at least that, or reduce the batch size "
            f"(a larger max_stages searches finer, slower, and may find a smaller one)" + (f"; {note}" if note else "")
        )

    def __reduce__(self) -> tuple[Any, ...]:
        # pickled with its fields (the message is made from them): rank 0's error sent to every rank
        return (type(self), (self.budget_bytes, self.min_feasible_bytes, self.note, self.unoptimized_peak_bytes))

    def with_unoptimized_peak(self, unoptimized_peak_bytes: int | None) -> "InfeasibleBudgetError":
        """This error naming ``unoptimized_peak_bytes`` too, where it names none yet (else itself)."""
        if self.unoptimized_peak_bytes is not None or unoptimized_peak_bytes is None:
            return self
        return InfeasibleBudgetError(self.budget_bytes, self.min_feasible_bytes, self.note, unoptimized_peak_bytes)


class TraceError(PlannerError):
    """The model could not be captured as an FX graph."""


class ProfileError(PlannerError):
    """Running a node of the captured graph failed while profiling it."""


class SolverError(PlannerError):
    """The integer linear program could not be solved (solver missing, crashed or timed out)."""


def check_max_stages(max_stages: int) -> None:
    """Raise :class:`InputError` unless ``max_stages`` is a positive integer.

    Example:
        >>> check_max_stages(32)
        >>> check_max_stages(0)
        Traceback (most recent call last):
        ...
        planner.core.errors.InputError: max_stages must be a positive integer (32 by default), got 0
    """
    if isinstance(max_stages, bool) or not isinstance(max_stages, int) or max_stages < 1:
        raise InputError(f"max_stages must be a positive integer (32 by default), got {max_stages!r}")


def check_time_limit(time_limit_s: float, name: str = "time_limit_s") -> None:
    """Raise :class:`InputError` unless ``time_limit_s`` is a positive, finite number of seconds.

    Example:
        >>> check_time_limit(10.0)
        >>> check_time_limit(0, "max_solve_s")
        Traceback (most recent call last):
        ...
        planner.core.errors.InputError: max_solve_s must be a positive number of seconds, got 0
    """
    if isinstance(time_limit_s, bool) or not isinstance(time_limit_s, (int, float)) or not time_limit_s > 0 \
            or not math.isfinite(time_limit_s):
        raise InputError(f"{name} must be a positive number of seconds, got {time_limit_s!r}")
