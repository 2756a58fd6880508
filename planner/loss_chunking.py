"""The chunked output head and loss as a choice of the plan (``optimize(..., chunk_loss=True)``).

On a language model the step's peak often sits in the backward of the loss, where the logits,
their log-softmax and both their gradients are alive at once; no checkpoint placement goes
below it. :mod:`rewrite.chunked_loss` computes that chain in row chunks under checkpoint, so
only one chunk's logits exist at a time, at the cost of running the chunks' forward again in
the backward and of another summation order (so it is opt-in). This module prices it like any
other choice: the chunked graph is profiled too, both graphs are solved for the budget, and the
chunked one is taken only where it is the only feasible one or its recompute (the solver's
plus the chunks' own) costs less. With ``chunk_loss`` off, an infeasible budget that chunking
would reach says so in the :class:`InfeasibleBudgetError` message, with the lower floor.

The choice captures, profiles and solves through a :class:`ChunkChoiceSteps`: ``optimize``'s
:class:`planner.planning_steps.PlanningSteps`, or the ``report`` command's own (a saved program,
profiled on fake tensors for a target device). It needs torch (through :mod:`profiling` and
:mod:`rewrite`), so the front doors that load without torch import it on first use.

Example:
    >>> import torch
    >>> from planner.capture_options import CaptureOptions
    >>> from planner.planning_steps import PlanningSteps
    >>> steps = PlanningSteps(torch.nn.Linear(4, 4).train(), (torch.randn(2, 4),), budget_gb=1.0,
    ...                       capture_options=CaptureOptions(chunk_loss=True))
    >>> gm = steps.capture()
    >>> gm, plan, graph = choose_loss_chunks(steps, gm, steps.profile(gm))   # no loss chain: as it is
    >>> plan.computation_changes
    ()
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Protocol

from planner.capture_options import CaptureOptions
from planner.core.costgraph import CostGraph
from planner.core.errors import InfeasibleBudgetError
from planner.core.options import PlanOptions
from planner.core.plan import GIB, Plan, format_ms
from planner.core.simulate import simulate
from profiling.loss_chain import find_loss_chain
from rewrite.chunked_loss import chunk_loss

__all__ = ["ChunkChoiceSteps", "choose_loss_chunks", "with_chunked_floor", "loss_chunk_floors", "is_chunked", "chunked_recompute_ms"]

log = logging.getLogger(__name__)

#: The name the rewrite gives the chunked node (the FX namespace may add a suffix).
_CHUNKED_NODE = "chunked_cross_entropy"


class ChunkChoiceSteps(Protocol):
    """What the choice does with the model: capture it again (the chunked graph is a second
    capture), profile a capture, solve a profile; with the options they run under."""

    @property
    def plan_options(self) -> PlanOptions:
        """The options every solve runs with (``reserve_gb``: the room no plan may use)."""
        ...

    @property
    def capture_options(self) -> CaptureOptions:
        """The capture options (``chunk_loss``: whether the chunked graph may be chosen)."""
        ...

    def capture(self) -> Any:
        """A new capture of the model."""
        ...

    def profile(self, gm: Any) -> CostGraph:
        """The profile of the capture ``gm``."""
        ...

    def plan(self, graph: CostGraph, budget_gb: float | None = None) -> Plan:
        """``graph`` solved for ``budget_gb`` in GiB, ``reserve_gb`` included (None: the
        budget asked for); :class:`InfeasibleBudgetError` where nothing fits."""
        ...


def is_chunked(graph: CostGraph) -> bool:
    """Whether ``graph`` profiles a graph whose output head and loss run in row chunks.

    Example:
        >>> from planner.core.costgraph import CostGraph
        >>> is_chunked(CostGraph((), ()))
        False
    """
    return any(n.name.startswith(_CHUNKED_NODE) and n.kind == "compute" for n in graph.nodes)


def chunked_recompute_ms(graph: CostGraph) -> float:
    """The time the chunked loss adds to a step: its chunks' forward, run again in the backward.

    Example:
        >>> from planner.core.costgraph import CostGraph, CostNode
        >>> chunked_recompute_ms(CostGraph((CostNode("chunked_cross_entropy", "f", time_ms=2.5),), ()))
        2.5
    """
    return sum(n.time_ms for n in graph.nodes if n.name.startswith(_CHUNKED_NODE) and n.kind == "compute")


def _labelled(graph: CostGraph) -> CostGraph:
    """``graph`` with its chunked-loss change saying what the chunks' recompute costs."""
    extra = f"; its chunks' forward runs again in the backward (+{format_ms(chunked_recompute_ms(graph))} a step)"
    changes = [c + extra if c.startswith("output head and cross-entropy") and extra not in c else c
               for c in graph.metadata.get("computation_changes", ())]
    return dataclasses.replace(graph, metadata={**graph.metadata, "computation_changes": changes})


def _floor_bytes(steps: ChunkChoiceSteps, graph: CostGraph) -> int:
    """The smallest feasible budget of ``graph`` in bytes (a solve at a budget nothing fits)."""
    try:
        found = steps.plan(graph, steps.plan_options.reserve_gb + 2**-20)  # 1 KiB above the reserve
    except InfeasibleBudgetError as exc:
        return exc.min_feasible_bytes
    return found.budget_bytes


def choose_loss_chunks(steps: ChunkChoiceSteps, gm: Any, graph: CostGraph) -> tuple[Any, Plan, CostGraph]:
    """Plan ``gm`` (profiled as ``graph``), with its output head and loss in row chunks where
    ``steps.capture_options.chunk_loss`` and that pays; returns the graph module, the plan and
    the profile chosen. A ``graph`` that already profiles the chunked chain (a re-plan) keeps it.
    The module's example runs it.

    Raises:
        InfeasibleBudgetError: no plan fits (:func:`with_chunked_floor` adds, with ``chunk_loss``
            off, the lower floor ``chunk_loss=True`` would reach: a second capture, profile and
            solve, so a caller that may still recover from the refusal adds it only once it
            cannot).
    """
    if is_chunked(graph):
        chunk_loss(gm)
        graph = _labelled(graph)
        return gm, steps.plan(graph), graph
    if find_loss_chain(gm) is None:
        return gm, steps.plan(graph), graph
    if not steps.capture_options.chunk_loss:
        return gm, steps.plan(graph), graph
    plain: Plan | None = None
    plain_floor = 0
    try:
        plain = steps.plan(graph)
    except InfeasibleBudgetError as exc:
        plain_floor = exc.min_feasible_bytes
    if plain is not None and plain.recompute_ms <= 0:
        return gm, plain, graph  # nothing recomputed: the chunks' own recompute cannot cost less
    chunked = steps.capture()
    chunk_loss(chunked)
    chunked_graph = _labelled(steps.profile(chunked))
    extra_ms = chunked_recompute_ms(chunked_graph)
    try:
        chunked_plan = steps.plan(chunked_graph)
    except InfeasibleBudgetError as exc:
        if plain is not None:
            return gm, plain, graph
        raise InfeasibleBudgetError(exc.budget_bytes, min(exc.min_feasible_bytes, plain_floor),
                                    unoptimized_peak_bytes=exc.unoptimized_peak_bytes) from None
    if plain is not None and plain.recompute_ms <= chunked_plan.recompute_ms + extra_ms:
        log.info("loss chunks not used: %s of recompute without them, %s with them (%s of it the chunks')",
                 format_ms(plain.recompute_ms), format_ms(chunked_plan.recompute_ms + extra_ms), format_ms(extra_ms))
        return gm, plain, graph
    log.info("loss chunks used: %s", "the only feasible way" if plain is None else
             f"{format_ms(chunked_plan.recompute_ms + extra_ms)} of recompute against {format_ms(plain.recompute_ms)}")
    # "unoptimized" stays the user's own step, which the chunked graph no longer is
    chunked_plan = dataclasses.replace(chunked_plan, unoptimized_peak_bytes=simulate(graph).peak_bytes,
                                       measured_unoptimized_peak_bytes=graph.measured_peak_bytes, step_ms=graph.step_ms)
    return chunked, chunked_plan, chunked_graph


def with_chunked_floor(steps: ChunkChoiceSteps, gm: Any, refusal: InfeasibleBudgetError) -> InfeasibleBudgetError:
    """``refusal`` (what :func:`choose_loss_chunks` raised for ``gm``) with a note naming the
    lower floor the output head and loss in row chunks reach, where ``chunk_loss`` is off, ``gm``
    has such a chain and the chunked floor is lower; else ``refusal`` itself.

    Example:
        >>> import torch
        >>> from planner.planning_steps import PlanningSteps
        >>> steps = PlanningSteps(torch.nn.Linear(4, 4).train(), (torch.randn(2, 4),), budget_gb=1e-9)
        >>> refusal = InfeasibleBudgetError(1, 2**20)
        >>> with_chunked_floor(steps, steps.capture(), refusal) is refusal   # no output head and loss chain
        True
    """
    if steps.capture_options.chunk_loss or find_loss_chain(gm) is None:
        return refusal
    chunked = steps.capture()
    chunk_loss(chunked)
    floor = _floor_bytes(steps, steps.profile(chunked))
    if floor >= refusal.min_feasible_bytes:
        return refusal
    return InfeasibleBudgetError(refusal.budget_bytes, refusal.min_feasible_bytes, note=(
        f"chunk_loss=True (--chunk-loss) reaches a lower floor, {floor / GIB:.4f} GiB ({floor} bytes), by "
        f"computing the output head and loss in row chunks (other summation order)"),
        unoptimized_peak_bytes=refusal.unoptimized_peak_bytes)


def loss_chunk_floors(steps: ChunkChoiceSteps, gm: Any, graph: CostGraph) -> tuple[int, int] | None:
    """The smallest feasible budgets in bytes without and with the output head and loss in row
    chunks, for the report; None when ``gm`` (profiled as ``graph``) has no such chain or is
    chunked already. Arguments as :func:`choose_loss_chunks`.

    Example:
        >>> import torch
        >>> from planner.planning_steps import PlanningSteps
        >>> steps = PlanningSteps(torch.nn.Linear(4, 4).train(), (torch.randn(2, 4),), budget_gb=1.0)
        >>> gm = steps.capture()
        >>> loss_chunk_floors(steps, gm, steps.profile(gm)) is None   # no output head and loss chain
        True
    """
    if is_chunked(graph) or find_loss_chain(gm) is None:
        return None
    chunked = steps.capture()
    chunk_loss(chunked)
    return _floor_bytes(steps, graph), _floor_bytes(steps, steps.profile(chunked))
