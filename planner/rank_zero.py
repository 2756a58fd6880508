"""The same plan on every rank: under ``torch.distributed``, rank 0 plans and broadcasts.

Node times are measured, and they vary by 10 to 65 % between runs on a busy machine, so ranks
that profile and solve on their own can choose different plans: each rank then has its own
peak and step time, and the slowest sets the pace. :func:`planned_on_rank_zero` runs the
planning on rank 0 only and broadcasts its plan and profile (``broadcast_object_list``); every
other rank rewrites its own capture of the model with that plan. An error on rank 0 reaches
every rank as the same error, so no rank waits on a broadcast that never comes.

Every rank must call it at the same point (``optimize`` on every rank, as a data-parallel
script does). Without an initialised process group, or with one rank, it plans here.

Example:
    >>> planned_on_rank_zero(lambda: ("module", "plan", "profile"), lambda plan, graph: None)
    ('module', 'plan', 'profile')
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

from planner.core.errors import PlannerError

__all__ = ["planned_on_rank_zero", "shared_from_rank_zero", "distributed_rank"]

log = logging.getLogger(__name__)

T = TypeVar("T")


def distributed_rank() -> tuple[int, int] | None:
    """``(rank, world_size)`` under an initialised process group of two ranks or more, else None."""
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch without distributed
        return None
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    return int(dist.get_rank()), int(dist.get_world_size())


def _shareable(exc: BaseException) -> PlannerError:
    """``exc`` as an error every rank can raise: a planner error as it is, anything else
    named in a :class:`PlannerError`."""
    if isinstance(exc, PlannerError):
        return exc
    return PlannerError(f"rank 0 could not plan: {type(exc).__name__}: {exc}")


def _broadcast(box: list[Any]) -> None:
    import torch.distributed as dist

    dist.broadcast_object_list(box, src=0)


def shared_from_rank_zero(compute: Callable[[], T]) -> T:
    """``compute()`` on rank 0, its result (picklable) broadcast to every rank; ``compute()``
    here where there is no process group."""
    if distributed_rank() is None:
        return compute()
    box: list[Any] = [None]
    if distributed_rank()[0] == 0:  # type: ignore[index]
        try:
            result = compute()
        except BaseException as exc:
            box[0] = ("error", _shareable(exc))
            _broadcast(box)
            raise
        box[0] = ("result", result)
        _broadcast(box)
        return result
    _broadcast(box)
    kind, value = box[0]
    if kind == "error":
        raise value
    return value


def planned_on_rank_zero(plan_here: Callable[[], tuple[Any, Any, Any]],
                         apply_received: Callable[[Any, Any], Any]) -> tuple[Any, Any, Any]:
    """``(module, plan, profile)`` from ``plan_here()`` on rank 0; on every other rank, rank 0's
    plan and profile with ``apply_received(plan, profile)`` as the module (the rank's own
    capture rewritten with that plan). Without a process group: ``plan_here()``."""
    ranks = distributed_rank()
    if ranks is None:
        return plan_here()
    if ranks[0] == 0:
        found: list[tuple[Any, Any, Any]] = []

        def plan_and_keep() -> tuple[Any, Any]:
            found.append(plan_here())
            return found[0][1], found[0][2]

        shared_from_rank_zero(plan_and_keep)
        log.info("plan made on rank 0 and sent to %d ranks", ranks[1] - 1)
        return found[0]
    plan, graph = shared_from_rank_zero(lambda: (None, None))  # rank 0's
    log.info("rank %d runs rank 0's plan (%d segments)", ranks[0], len(getattr(plan, "segments", ())))
    return apply_received(plan, graph), plan, graph
