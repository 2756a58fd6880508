"""What every start of a solve reads: the graph, the budget, the options and the clock.

:func:`planner.solvers.solve.solve` makes one :class:`SolveContext` and hands it to each start
(:mod:`planner.solvers.starts`); the first stage model's plans (:class:`FirstModel`) are put on it
for the starts that build on them.

Example:
    >>> from planner.core.costgraph import CostGraph, CostNode, Storage
    >>> g = CostGraph((CostNode("x", "placeholder", kind="input", output_storages=(0,)),),
    ...               (Storage(0, 2**20, True),), ("x",))
    >>> ctx = SolveContext.begin(g, 2**21, SolveOptions())
    >>> ctx.unoptimized_bytes, ctx.by_chain_dp
    (1048576, True)
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from planner.core.costgraph import CostGraph
from planner.core.options import SolveOptions
from planner.core.plan import Plan, Segment
from planner.core.simulate import simulate
from planner.core.stages import Stage
from planner.solvers.deadline import SolveDeadline
from planner.solvers.stage_ilp import IlpResult
from planner.solvers.stage_model import StageModel
from planner.solvers.stage_plans import to_plan

__all__ = ["SolveContext", "FirstModel", "Start", "checked_budget_bytes", "cheapest"]


def checked_budget_bytes(budget_bytes: int | float) -> int:
    """``budget_bytes`` as a positive int, or ``ValueError``.

    Example:
        >>> checked_budget_bytes(2.0**20)
        1048576
    """
    if not isinstance(budget_bytes, int) or isinstance(budget_bytes, bool):
        if not (isinstance(budget_bytes, float) and math.isfinite(budget_bytes)):
            raise ValueError(f"budget_bytes must be a finite number, got {budget_bytes!r}")
        budget_bytes = int(budget_bytes)
    if budget_bytes <= 0:
        raise ValueError(f"budget_bytes must be positive, got {budget_bytes}")
    return budget_bytes


@dataclass(frozen=True)
class FirstModel:
    """The stage model on ``max_stages`` stages and its plans, which the other starts build on:
    ``plan`` at the budget (None when it found none) and ``raised``, the chain DP's plan at
    targets raised above the budget that still fits it (``plan`` itself where that finds
    nothing cheaper or the DP does not solve the model)."""

    stages: list[Stage]
    model: StageModel
    plan: Plan | None
    raised: Plan | None


@dataclass
class SolveContext:
    """One solve's inputs and clock. ``unoptimized_bytes``: the simulated peak with nothing
    recomputed; ``first``: set once the first stage model is solved."""

    graph: CostGraph
    budget_bytes: int
    options: SolveOptions
    started: float
    deadline: SolveDeadline
    unoptimized_bytes: int
    first: FirstModel | None = None

    @classmethod
    def begin(cls, graph: CostGraph, budget_bytes: int, options: SolveOptions) -> SolveContext:
        """A context whose clock starts now."""
        started = time.perf_counter()
        return cls(graph, budget_bytes, options, started, SolveDeadline(started, options.max_solve_s),
                   simulate(graph).peak_bytes)

    @property
    def by_chain_dp(self) -> bool:
        """Whether stage models are solved by the chain DP: no ILP solver was named."""
        return self.options.solver is None

    @property
    def finer_limit_s(self) -> float:
        """Seconds one start's ILP, and separately its finer rounds, may take."""
        return min(self.options.finer_s, self.options.time_limit_s)

    def elapsed_s(self) -> float:
        return time.perf_counter() - self.started

    def plan_of(self, segments: Sequence[Segment], peak_bytes: int, solver: str,
                result: IlpResult | None = None) -> Plan:
        """``segments`` as a plan of this solve (its budget, its unoptimized peak, its time so far)."""
        return to_plan(self.graph, list(segments), self.budget_bytes, self.unoptimized_bytes, peak_bytes, solver,
                       self.elapsed_s(), result)


@dataclass(frozen=True)
class Start:
    """One way to a plan: ``run`` returns its plan for the context's budget, or None.
    ``on_stages``: its plans come from stage models, so the cost search after the choice only
    polishes them (``options.polish``); a plan from elsewhere gets the full ``refine_s``."""

    name: str
    run: Callable[[SolveContext], Plan | None]
    on_stages: bool = True


def cheapest(plans: Sequence[Plan | None]) -> Plan | None:
    """The plan of least recompute time; among equals the earliest (the order of the starts
    is their precedence).

    Example:
        >>> cheapest([None]) is None
        True
    """
    found = [plan for plan in plans if plan is not None]
    return min(found, key=lambda plan: plan.recompute_ms) if found else None
