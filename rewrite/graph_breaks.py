"""The graph-break path's rewrite: the user's forward runs as it is, its planned op ranges checkpointed.

:class:`BreakCheckpointedModule` is what ``optimize`` returns for a model planned over the ATen
ops its step dispatches (:mod:`profiling.graph_breaks`): each training forward runs the user's
own Python (branches, ``.item()``, NumPy, loops) under a :class:`rewrite.op_regions.RegionRunner`
that checkpoints the op ranges of the plan's segments. A segment may span the Python between two
graph breaks: its recompute replays the ops, not the Python. Where a forward dispatches other ops
than the planned one (a branch the example inputs did not take), a range whose first op is not
the planned one is not checkpointed; every range that runs is exact. Inputs of another shape are planned again on first use when the module was given a
``replan`` callable, otherwise run unplanned (a warning says so once).

Example:
    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    >>> opt = BreakCheckpointedModule(model, plan=None, regions=((1, 3),))
    >>> x = torch.randn(3, 4)
    >>> torch.equal(opt(x), model(x))
    True
    >>> list(opt.state_dict()) == list(model.state_dict())
    True
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from planner.core.costgraph import CostGraph
from planner.core.plan import Plan
from profiling.graph_breaks import op_node_index
from rewrite.op_regions import RegionRunner
from rewrite.held_output import WatchesHeldOutput
from rewrite.saving import SavesAsTheModel
from rewrite.signature import ForwardWithTheModelsSignature, signature_of
from rewrite.attach import share_module_state

__all__ = ["BreakCheckpointedModule", "segment_regions", "input_signature"]

log = logging.getLogger(__name__)

#: ``replan(args, kwargs) -> (plan, regions, cost_graph)`` for inputs of a signature not planned yet
Replan = Callable[[tuple[Any, ...], dict[str, Any]], tuple[Plan, tuple[tuple[int, int], ...], CostGraph]]


def segment_regions(plan: Plan) -> tuple[tuple[int, int], ...]:
    """The first and last op index of each of ``plan``'s segments.

    Example:
        >>> from planner.core.plan import Segment
        >>> p = Plan(1, 1, 1, (Segment(("op3_t", "op4_addmm"), 0.0, 0),), 0.0, 0.0, 0, "x", 0.0)
        >>> segment_regions(p)
        ((3, 4),)
    """
    regions = []
    for segment in plan.segments:
        indices = [op_node_index(name) for name in segment.node_names]
        if any(i is None for i in indices):
            raise ValueError(f"segment {segment.node_names[0]} .. {segment.node_names[-1]} holds nodes that are "
                             "not model ops: it is not a graph-break plan")
        regions.append((min(indices), max(indices)))  # type: ignore[type-var]
    return tuple(regions)


def input_signature(args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """Shapes and dtypes of the tensor inputs: inputs with another signature are planned again.

    Example:
        >>> input_signature((torch.ones(2, 3),), {})
        (('', (2, 3), torch.float32),)
    """
    items = [("", a) for a in args] + sorted(kwargs.items())
    return tuple((name, tuple(v.shape), v.dtype) for name, v in items if isinstance(v, torch.Tensor))


class BreakCheckpointedModule(SavesAsTheModel, WatchesHeldOutput, torch.nn.Module):
    """The user's module run with ``regions`` (op index ranges) checkpointed in training; in eval
    mode or under ``torch.no_grad()``, the user's module as it is. Its module tree *is* the
    user's (``state_dict()`` keys and parameter objects are the model's own). ``plan``
    (``plan.capture == "graph-breaks"``) and ``cost_graph`` are those of the example inputs'
    signature; ``expected_ops`` the op names the profiled forward dispatched.
    """

    def __init__(self, original: torch.nn.Module, plan: Plan | None, regions: Sequence[tuple[int, int]], *,
                 cost_graph: CostGraph | None = None, expected_ops: Sequence[str] | None = None,
                 signature: tuple[Any, ...] | None = None, replan: Replan | None = None) -> None:
        super().__init__()
        object.__setattr__(self, "original", original)
        object.__setattr__(self, "_forward_signature", signature_of(original))
        for first, last in regions:
            if not 0 <= first <= last:
                raise ValueError(f"an op region runs from its first to its last op index, got ({first}, {last})")
        share_module_state(self, original)
        self.plan = plan
        self.cost_graph = cost_graph
        self.regions = tuple(regions)
        self.expected_ops = tuple(expected_ops) if expected_ops is not None else None
        self._plans: dict[Any, tuple[Plan | None, tuple[tuple[int, int], ...], tuple[str, ...] | None]] = {}
        if signature is not None:
            self._plans[signature] = (plan, self.regions, self.expected_ops)
        self._replan = replan
        self._warned: set[Any] = set()
        self.last_runner: RegionRunner | None = None
        self.train(original.training)

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (``torch.save(opt)``) with its plans; a loaded module runs inputs of a signature
        it has no plan for without checkpoints (the re-planning closure does not pickle)."""
        state = dict(self.__dict__)
        state["_replan"] = None
        state["last_runner"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def train(self, mode: bool = True) -> "BreakCheckpointedModule":
        super().train(mode)
        self.original.train(mode)
        return self

    def _regions_for(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        if not self._plans:
            return self.regions, self.expected_ops
        signature = input_signature(args, kwargs)
        if signature not in self._plans:
            if self._replan is None:
                if signature not in self._warned:
                    self._warned.add(signature)
                    log.warning("inputs %s were not planned for: they run without checkpoints", signature)
                return (), None
            log.info("inputs %s: planning again", signature)
            plan, regions, graph = self._replan(args, kwargs)
            self._plans[signature] = (plan, regions, tuple(graph.metadata.get("op_names", ())) or None)
        _, regions, expected = self._plans[signature]
        return regions, expected

    @contextmanager
    def checkpoints_installed(self, *args: Any, **kwargs: Any) -> Iterator[None]:
        """The planned op ranges of a forward on ``args``/``kwargs`` checkpointed while the
        context lasts (one training call of the model: what this module's forward, and
        ``planner.enable``, run)."""
        regions, expected = self._regions_for(args, kwargs)
        if not regions:  # nothing to checkpoint: no dispatch mode counting every op
            self.last_runner = None
            yield
            return
        runner = RegionRunner(regions, expected)
        with runner:
            yield
        self.last_runner = runner

    def _checkpointed_forward(self, *args: Any, **kwargs: Any) -> Any:
        if not self.original.training or not torch.is_grad_enabled():
            return self.original(*args, **kwargs)
        self._check_the_caller()
        with self.checkpoints_installed(*args, **kwargs):
            output = self.original(*args, **kwargs)
        self.watch_output(output)
        return output

    forward = ForwardWithTheModelsSignature()
