"""Check a plan on the device before handing it over: measure its step, correct, solve again.

The simulator's prediction agrees with the allocator within a few percent, but a promise
("the budget holds") should not rest on a prediction where the step can be measured. Where
``optimize`` plans on the training device, :func:`measured_plan` has the graph rewritten with the
chosen plan and one training step measured at the allocator (``torch.profiler`` on CPU,
``max_memory_allocated`` on CUDA), the step the plan was made for, by a :class:`DeviceStep`
(:func:`planner.measured_fit.check_on_device` gives it one; this module imports no torch). Then:

- measured above the budget's room: the gap is held as extra bytes all step and the graph is
  solved again, up to :data:`MAX_MEASURED_RESOLVES` times; where that still measures above the
  room (or nothing is predicted to fit with the gap held), the plan of the smallest predicted
  peak is measured and taken if it fits;
- cheaper plans the prediction refused only by the margin (``alternatives``: hand-placed plans
  within :data:`planner.measured_fit.MEASURED_FIT_TOLERANCE` of the room) are measured, cheapest
  first, and the first whose step fits replaces the plan;
- measured below the prediction by more than the safety margin (the prediction wasted budget):
  the room is grown by the gap and the graph solved again, once; the new plan is kept only if
  its own measured step fits and it recomputes less.

The plan returned always has ``measured_peak_bytes`` set. The cost is one measured training
step for a plan that recomputes anything (a plan that recomputes nothing is the profiled step
itself, whose peak the profile measured), plus one per solve again (docs/memory.md).

Example:
    >>> import torch
    >>> from planner import optimize
    >>> model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh())
    ...                               for _ in range(8)]).train()
    >>> x = torch.randn(512, 64)
    >>> opt = optimize(model, (x,), budget_gb=1.0, timing_repeats=1)
    >>> opt.plan.measured_peak_bytes == opt.cost_graph.measured_peak_bytes   # nothing recomputed
    True
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any, Protocol

from planner.core.errors import InfeasibleBudgetError
from planner.core.plan import GIB, Plan
from planner.core.units import MIB

__all__ = ["MAX_MEASURED_RESOLVES", "DeviceStep", "measured_plan"]

log = logging.getLogger(__name__)

#: Solves again after a measured step above the budget: each holds the measured overshoot, so
#: one usually suffices; the second covers an overshoot that moved with the plan.
MAX_MEASURED_RESOLVES = 2

class DeviceStep(Protocol):
    """The device side of the loop: the graph a plan was solved on, measured and solved again."""

    def measure(self, plan: Plan) -> tuple[Any, int]:
        """The graph rewritten for ``plan`` and the peak bytes of its step, measured."""
        ...

    def resolve(self, held_bytes: int, extra_room_bytes: int) -> Plan:
        """The same graph solved again holding ``held_bytes`` more all step, with
        ``extra_room_bytes`` more room; raises :class:`InfeasibleBudgetError` where nothing fits."""
        ...

    def smallest(self) -> Plan:
        """The plan of the smallest predicted peak on the same graph."""
        ...


def measured_plan(plan: Plan, room_bytes: int, margin_bytes: int, device: DeviceStep,
                  unoptimized_measured_bytes: int | None, alternatives: Sequence[Plan] = ()) -> tuple[Any, Plan]:
    """The module and plan to return: ``plan`` measured on ``device``, corrected by solving again
    where the measurement says so (see module docs), with ``measured_peak_bytes`` set. The module is None
    for a plan that recomputes nothing, whose measured peak is the profile's own
    (``unoptimized_measured_bytes``): the caller rewrites as usual. Raises
    :class:`InfeasibleBudgetError` where every plan tried measured above ``room_bytes``."""

    def check(candidate: Plan) -> tuple[Any, int]:
        if not candidate.segments and unoptimized_measured_bytes is not None:
            return None, unoptimized_measured_bytes
        return device.measure(candidate)

    module, measured = check(plan)
    plan = dataclasses.replace(plan, measured_peak_bytes=measured)
    tried = {plan.segments}
    held = 0
    try:
        for attempt in range(MAX_MEASURED_RESOLVES):
            if measured <= room_bytes:
                break
            held += max(measured - room_bytes, measured - plan.predicted_peak_bytes, 1)
            log.warning("plan measured %.4f GiB, above the room of %.4f GiB (predicted %.4f GiB): solving again "
                        "with %.1f MiB held (%d of %d)", measured / GIB, room_bytes / GIB,
                        plan.predicted_peak_bytes / GIB, held / MIB, attempt + 1, MAX_MEASURED_RESOLVES)
            plan = device.resolve(held, 0)
            tried.add(plan.segments)
            module, measured = check(plan)
            plan = dataclasses.replace(plan, measured_peak_bytes=measured)
    except InfeasibleBudgetError:
        log.info("no plan predicted to fit with the overshoot held")
    if measured > room_bytes:
        # near the floor, the plan of the smallest predicted peak may fit where cheaper ones did not
        smallest = device.smallest()
        if smallest.segments not in tried:
            module, smallest_measured = check(smallest)
            log.info("the plan of the smallest predicted peak measured %.4f GiB", smallest_measured / GIB)
            if smallest_measured <= room_bytes:
                return module, dataclasses.replace(smallest, measured_peak_bytes=smallest_measured)
            measured = min(measured, smallest_measured)
        raise InfeasibleBudgetError(plan.budget_bytes, plan.budget_bytes + measured - room_bytes,
                                    note=f"the plan's measured step peaked at {measured / GIB:.4f} GiB, "
                                         f"{(measured - room_bytes) / MIB:.1f} MiB above the room")
    if held == 0:
        for alternative in alternatives:
            alternative_module, alternative_measured = check(alternative)
            log.info("%s, predicted %d bytes over the margin, measured %d bytes against a room of %d bytes",
                     alternative.solver, alternative.predicted_peak_bytes, alternative_measured,
                     room_bytes)
            if alternative_measured <= room_bytes:
                return alternative_module, dataclasses.replace(alternative, measured_peak_bytes=alternative_measured)
    wasted = plan.predicted_peak_bytes - measured
    if wasted > margin_bytes and plan.segments and held == 0:
        try:
            roomier = device.resolve(0, wasted)
        except InfeasibleBudgetError:
            return module, plan
        if roomier.segments != plan.segments and roomier.recompute_ms < plan.recompute_ms:
            roomier_module, roomier_measured = check(roomier)
            log.info("plan predicted %.4f GiB measured %.4f GiB: with the gap as room, a plan recomputing %.1f ms "
                     "instead of %.1f ms measured %.4f GiB", plan.predicted_peak_bytes / GIB, measured / GIB,
                     roomier.recompute_ms, plan.recompute_ms, roomier_measured / GIB)
            if roomier_measured <= room_bytes:
                return roomier_module, dataclasses.replace(roomier, measured_peak_bytes=roomier_measured)
    return module, plan
