"""PuLP's HiGHS interface as the planner runs it: one thread, no banner, a node limit, and a stuck
solve abandoned.

:class:`PlannerHiGHS` keeps HiGHS's start-up banner off standard output
(:mod:`planner.milp.quiet_highs`) and resets HiGHS's process-wide thread scheduler before each
solve. HiGHS sizes that scheduler once per process, from the first solve's ``threads``; a
later solve asking for another count is refused (PuLP then reports no solution). So a process
that had run HiGHS with its default threads (the user's own PuLP model, say) made every solve
of the planner, which runs one thread, fail with "found no feasible plan".

A solve that runs far past its time limit is abandoned: HiGHS 1.16.0 can loop for ever in its
presolve (``strengthenInequalities``, inside a RENS sub-MIP's presolve; no time limit reaches
it), holding one core at 100 % (docs/tuning.md#overrun_s). The solve runs on a
daemon thread; when it has not returned :data:`OVERRUN_S` seconds (plus a quarter of the limit)
after its time limit, :class:`HighsOverrunError` (a ``PulpSolverError``, so the planner solves
that model with CBC instead) is raised, and HiGHS is reported unavailable for the rest of the
process: the stuck thread still holds HiGHS's thread scheduler, which every later solve resets.
The stuck thread keeps one core busy until the process exits.

A search stopped by a node limit (the ``mip_max_nodes`` option, a limit on effort that gives
the same plan on every machine, unlike a time limit) reads like one stopped by a time limit:
the best plan found, if any, marked as feasible but not proven optimal (PuLP has no mapping
for that HiGHS status and would raise ``KeyError``).

Example:
    >>> import pulp
    >>> prob = pulp.LpProblem("p", pulp.LpMinimize)
    >>> x = prob.add_variable("x", cat="Binary")
    >>> y = prob.add_variable("y", lowBound=0)
    >>> prob += x + y
    >>> prob += x + y >= 1
    >>> if pulp.HiGHS(msg=False).available():
    ...     _ = prob.solve(PlannerHiGHS(msg=False, threads=1))  # the threads every solve here uses
    >>> round(pulp.value(prob.objective))
    1
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Any, ClassVar

import pulp

from planner.milp.quiet_highs import absorb_highs_banner

__all__ = ["HighsOverrunError", "PlannerHiGHS", "stopped_at_node_limit", "NO_PROBING", "OVERRUN_S"]

log = logging.getLogger(__name__)

#: HiGHS's ``presolve_rule_off`` bit for probing (``2 ** kPresolveRuleProbing``, the value its
#: own "time limit reached in probing" message names): the stage ILP's rows are long running
#: sums, which probing handles slowly (docs/tuning.md#no_probing)
NO_PROBING = {"presolve_rule_off": 1 << 15}
#: seconds past its time limit (plus a quarter of the limit) after which a HiGHS solve is
#: abandoned as stuck; HiGHS itself stops within about a second of its limit
OVERRUN_S = 10.0


class HighsOverrunError(pulp.PulpSolverError):  # type: ignore[misc, valid-type]
    """HiGHS ran far past its time limit and its solve was abandoned."""


class PlannerHiGHS(pulp.HiGHS):  # type: ignore[misc, valid-type]
    """:class:`pulp.HiGHS` with the banner absorbed, the thread scheduler reset to its own
    ``threads`` before each solve, a node limit read as a feasible, unproven solve, and a solve
    stuck past its time limit abandoned (:class:`HighsOverrunError`).

    ``overrun_s``: seconds past the time limit (plus a quarter of the limit) to wait for HiGHS
    before abandoning its solve (:data:`OVERRUN_S` by default; no limit when ``timeLimit`` is
    None)."""

    #: what abandoned a solve in this process (empty while none was): HiGHS is then unavailable
    abandoned: ClassVar[list[str]] = []

    def __init__(self, *args: Any, overrun_s: float | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.overrun_s = OVERRUN_S if overrun_s is None else overrun_s

    def available(self) -> bool:
        """Installed, and no solve in this process was abandoned."""
        return bool(super().available()) and not PlannerHiGHS.abandoned

    def callSolver(self, lp: Any) -> None:  # noqa: N802 (PuLP's name)
        if self.timeLimit is None:
            return super().callSolver(lp)
        wait_s = self.timeLimit * 1.25 + self.overrun_s
        failures: list[BaseException] = []

        def run() -> None:
            try:
                lp.solverModel.run()
            except BaseException as exc:  # re-raised on the calling thread
                failures.append(exc)

        solving = threading.Thread(target=run, name="HiGHS solve", daemon=True)
        started = time.perf_counter()
        solving.start()
        try:
            solving.join(wait_s)
        except BaseException:  # Ctrl-C: the solve goes on and holds the scheduler, as a stuck one
            PlannerHiGHS.abandoned.append("a HiGHS solve was interrupted")
            raise
        if failures:
            raise failures[0]
        if not solving.is_alive():
            return
        what = (f"HiGHS ran {time.perf_counter() - started:.0f} s on a {self.timeLimit:g} s time limit "
                f"({lp.numVariables()} variables, {lp.numConstraints()} constraints) and was abandoned")
        PlannerHiGHS.abandoned.append(what)
        lp.solverModel = None  # the stuck thread keeps its own reference
        log.warning("%s (HiGHS 1.16.0 can loop for ever in its presolve); the planner solves with CBC "
                    "for the rest of this process (slower), and the stuck solve keeps one core busy until "
                    "the process exits", what)
        raise HighsOverrunError(what)

    def actualSolve(self, lp: Any) -> Any:  # noqa: N802 (PuLP's name)
        absorb_highs_banner()  # made before PuLP's first Highs object, which would print it
        if self.threads is not None:
            import highspy

            highspy.Highs.resetGlobalScheduler(True)
        return super().actualSolve(lp)

    def findSolutionValues(self, lp: Any) -> tuple[int, int]:  # noqa: N802 (PuLP's name)
        try:
            return super().findSolutionValues(lp)
        except KeyError:
            # raised after the solution was read into the variables, for a status PuLP does
            # not know; the only one the planner causes is a node limit
            import highspy

            if lp.solverModel.getModelStatus() != highspy.HighsModelStatus.kSolutionLimit:
                raise
            if math.isfinite(lp.solverModel.getObjectiveValue()):
                return pulp.LpStatusOptimal, pulp.LpSolutionIntegerFeasible
            return pulp.LpStatusNotSolved, pulp.LpSolutionNoSolutionFound


def stopped_at_node_limit(prob: pulp.LpProblem) -> bool:
    """Whether HiGHS's last solve of ``prob`` ended at its node limit (an effort limit, not a
    time limit); False for any other solver."""
    model = getattr(prob, "solverModel", None)
    return model is not None and "SolutionLimit" in str(model.getModelStatus())
