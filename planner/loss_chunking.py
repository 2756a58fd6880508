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

It needs torch (through :mod:`profiling` and :mod:`rewrite`), so only :mod:`planner.pipeline`
imports it, on first use.

Example:
    >>> import torch
    >>> from planner.pipeline import Replanner, CaptureOptions
    >>> replan = Replanner(budget_gb=1.0, capture=CaptureOptions(chunk_loss=True))
    >>> gm, plan, graph = replan(torch.nn.Linear(4, 4), (torch.randn(2, 4),))  # no loss chain
    >>> plan.computation_changes
    ()
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable

from planner.core.costgraph import CostGraph
from planner.core.errors import InfeasibleBudgetError
from planner.core.plan import GIB, Plan, format_ms
from planner.core.simulate import simulate
from profiling.loss_chain import find_loss_chain
from rewrite.chunked_loss import chunk_loss

__all__ = ["plan_choosing_loss_chunks", "loss_chunk_floors", "is_chunked", "chunked_recompute_ms"]

log = logging.getLogger(__name__)

#: The name the rewrite gives the chunked node (the FX namespace may add a suffix).
_CHUNKED_NODE = "chunked_cross_entropy"


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


def _floor_bytes(plan: Callable[[CostGraph, float | None], Plan], graph: CostGraph) -> int:
    """The smallest feasible budget of ``graph`` in bytes (a solve at a budget nothing fits)."""
    try:
        found = plan(graph, 2**-20)  # 1 KiB above the reserve
    except InfeasibleBudgetError as exc:
        return exc.min_feasible_bytes
    return found.budget_bytes


def plan_choosing_loss_chunks(gm: Any, graph: CostGraph, *, chunk_loss_on: bool,
                              trace: Callable[[], Any], profile: Callable[[Any], CostGraph],
                              plan: Callable[[CostGraph, float | None], Plan]) -> tuple[Any, Plan, CostGraph]:
    """Plan ``gm`` (profiled as ``graph``), with its output head and loss in row chunks where
    ``chunk_loss_on`` and that pays; returns the graph module, the plan and the profile chosen.

    ``trace()`` captures the model again (the chunked graph is a second capture), ``profile(gm)``
    profiles a capture, ``plan(graph, budget_gb)`` solves at the budget (``None``) or another.
    A ``graph`` that already profiles the chunked chain (a re-plan) keeps it.

    Raises:
        InfeasibleBudgetError: no plan fits; with ``chunk_loss_on`` off, the message names the
            lower floor ``chunk_loss=True`` reaches, where it does.
    """
    if is_chunked(graph):
        chunk_loss(gm)
        graph = _labelled(graph)
        return gm, plan(graph, None), graph
    if find_loss_chain(gm) is None:
        return gm, plan(graph, None), graph
    if not chunk_loss_on:
        try:
            return gm, plan(graph, None), graph
        except InfeasibleBudgetError as exc:
            chunked = trace()
            chunk_loss(chunked)
            floor = _floor_bytes(plan, profile(chunked))
            if floor >= exc.min_feasible_bytes:
                raise
            raise InfeasibleBudgetError(exc.budget_bytes, exc.min_feasible_bytes, note=(
                f"chunk_loss=True (--chunk-loss) reaches a lower floor, {floor / GIB:.4f} GiB ({floor} bytes), by "
                f"computing the output head and loss in row chunks (other summation order)"),
                unoptimized_peak_bytes=exc.unoptimized_peak_bytes) from None
    plain: Plan | None = None
    plain_floor = 0
    try:
        plain = plan(graph, None)
    except InfeasibleBudgetError as exc:
        plain_floor = exc.min_feasible_bytes
    if plain is not None and plain.recompute_ms <= 0:
        return gm, plain, graph  # nothing recomputed: the chunks' own recompute cannot cost less
    chunked = trace()
    chunk_loss(chunked)
    chunked_graph = _labelled(profile(chunked))
    extra_ms = chunked_recompute_ms(chunked_graph)
    try:
        chunked_plan = plan(chunked_graph, None)
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


def loss_chunk_floors(gm: Any, graph: CostGraph, *, trace: Callable[[], Any], profile: Callable[[Any], CostGraph],
                      plan: Callable[[CostGraph, float | None], Plan]) -> tuple[int, int] | None:
    """The smallest feasible budgets in bytes without and with the output head and loss in row
    chunks, for the report; None when ``gm`` (profiled as ``graph``) has no such chain or is
    chunked already. Arguments as :func:`plan_choosing_loss_chunks`.
    """
    if is_chunked(graph) or find_loss_chain(gm) is None:
        return None
    chunked = trace()
    chunk_loss(chunked)
    return _floor_bytes(plan, graph), _floor_bytes(plan, profile(chunked))
