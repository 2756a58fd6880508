"""PuLP's HiGHS interface as the planner runs it: one thread, no banner, and a node limit.

:class:`PlannerHiGHS` keeps HiGHS's start-up banner off standard output
(:mod:`planner.quiet_highs`) and resets HiGHS's process-wide thread scheduler before each
solve. HiGHS sizes that scheduler once per process, from the first solve's ``threads``; a
later solve asking for another count is refused (PuLP then reports no solution). So a process
that had run HiGHS with its default threads (the user's own PuLP model, say) made every solve
of the planner, which runs one thread, fail with "found no feasible plan".

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

import math
from typing import Any

import pulp

from planner.quiet_highs import absorb_highs_banner

__all__ = ["PlannerHiGHS", "stopped_at_node_limit", "NO_PROBING"]

#: HiGHS's ``presolve_rule_off`` bit for probing (``2 ** kPresolveRuleProbing``, the value its
#: own "time limit reached in probing" message names). On the stage ILP of a 3,912-node graph
#: (1,642 columns, 38,091 nonzeros) probing took 13 of a 20 s solve; without it the same
#: optimum in 3.6 s (the stage ILP's rows are long running sums, which probing handles slowly)
NO_PROBING = {"presolve_rule_off": 1 << 15}


class PlannerHiGHS(pulp.HiGHS):  # type: ignore[misc, valid-type]
    """:class:`pulp.HiGHS` with the banner absorbed, the thread scheduler reset to its own
    ``threads`` before each solve, and a node limit read as a feasible, unproven solve."""

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
