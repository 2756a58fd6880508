"""What is left of a whole solve's time bound (``max_solve_s`` of :func:`planner.solvers.solve.solve`).

The phases that only improve a plan already found ask it whether they may start and how long
they may run; it remembers whether any was skipped or cut.

Example:
    >>> import time
    >>> unbounded = SolveDeadline(time.perf_counter(), None)
    >>> unbounded.cut(5.0), unbounded.allows("the finer rounds"), unbounded.reached()
    (5.0, True, False)
    >>> spent = SolveDeadline(time.perf_counter() - 10.0, 2.0)
    >>> spent.allows("the finer rounds"), spent.reached()
    (False, True)
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

__all__ = ["MIN_PHASE_S", "SolveDeadline"]

log = logging.getLogger(__name__)

#: a phase is not started with less than this many seconds left: an ILP stopped that early
#: rarely has a plan, let alone a cheaper one
MIN_PHASE_S = 0.5


@dataclass
class SolveDeadline:
    """``max_solve_s`` seconds from ``started`` (``time.perf_counter()``); None: no bound."""

    started: float
    max_solve_s: float | None
    #: a phase was skipped because too little time was left
    skipped: bool = False

    def left_s(self) -> float:
        """Seconds left (``inf`` without a bound; negative once past it)."""
        if self.max_solve_s is None:
            return math.inf
        return self.started + self.max_solve_s - time.perf_counter()

    def left_s_or_none(self) -> float | None:
        """What is left, as a ``max_solve_s`` for a nested solve (None without a bound)."""
        return None if self.max_solve_s is None else max(self.left_s(), 1e-3)

    def cut(self, limit_s: float) -> float:
        """``limit_s``, or what is left when that is less."""
        return min(limit_s, max(self.left_s(), 1e-3))

    def allows(self, phase: str) -> bool:
        """Whether ``phase`` may start: at least :data:`MIN_PHASE_S` is left (always without a
        bound). A phase refused is logged."""
        left_s = self.left_s()
        if left_s >= MIN_PHASE_S:
            return True
        log.info("max_solve_s=%g s: %s skipped (%.1f s left)", self.max_solve_s, phase, max(left_s, 0.0))
        self.skipped = True
        return False

    def reached(self) -> bool:
        """Whether the bound cut the solve short: a phase was skipped, or the time is spent."""
        return self.skipped or self.left_s() <= 0
