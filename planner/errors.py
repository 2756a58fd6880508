"""Typed exceptions raised across the pipeline.

All of them derive from :class:`PlannerError`, so ``except PlannerError`` catches every
failure this package raises on purpose.
"""

from __future__ import annotations

import math

__all__ = ["PlannerError", "InputError", "InfeasibleBudgetError", "TraceError", "ProfileError", "SolverError"]


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
    rounded up, so it works too.
    """

    def __init__(self, budget_bytes: int, min_feasible_bytes: int) -> None:
        self.budget_bytes = int(budget_bytes)
        self.min_feasible_bytes = int(min_feasible_bytes)
        min_feasible_gb = math.ceil(self.min_feasible_bytes / 2**30 * 1e4) / 1e4
        super().__init__(
            f"budget {budget_bytes / 2**30:.4f} GiB ({budget_bytes} bytes) is below the smallest peak "
            f"the planner found; the smallest feasible budget is {min_feasible_gb:.4f} GiB "
            f"({min_feasible_bytes} bytes): raise budget_gb to at least that, or reduce the batch size "
            f"(a larger max_stages searches finer, slower, and may find a smaller one)"
        )


class TraceError(PlannerError):
    """The model could not be captured as an FX graph."""


class ProfileError(PlannerError):
    """Running a node of the captured graph failed while profiling it."""


class SolverError(PlannerError):
    """The integer linear program could not be solved (solver missing, crashed or timed out)."""
