"""The module path's rewrite: chosen submodule calls run under ``torch.utils.checkpoint``.

:class:`ModuleCheckpointedModule` is what ``optimize`` returns for a model it could not capture
(or with ``trace_method="modules"``). During its training forward it gives each planned
submodule an instance ``forward`` that calls the module's own forward through non-reentrant
``torch.utils.checkpoint`` with the RNG state preserved (dropout draws the same mask on
recompute), and removes it when the forward returns: the user's modules are untouched outside
that call. A recompute restores the unit's buffers afterwards, so BatchNorm running statistics
(and any other buffer the forward writes) are updated once per step.

Example:
    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    >>> opt = ModuleCheckpointedModule(model, plan=None, checkpointed=("1",))
    >>> x = torch.randn(3, 4)
    >>> torch.equal(opt(x), model(x))
    True
    >>> list(opt.state_dict()) == list(model.state_dict())
    True
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.utils.checkpoint

from planner.core.costgraph import CostGraph
from planner.core.plan import Plan
from rewrite.held_output import WatchesHeldOutput
from rewrite.saving import SavesAsTheModel
from rewrite.signature import ForwardWithTheModelsSignature, signature_of
from rewrite.attach import share_module_state

__all__ = ["ModuleCheckpointedModule", "checkpointed_forward"]


def checkpointed_forward(module: torch.nn.Module, forward: Callable[..., Any]) -> Callable[..., Any]:
    """``forward`` run under non-reentrant ``torch.utils.checkpoint`` with the RNG state kept;
    on recompute, ``module``'s buffers are restored afterwards (running statistics updated once).

    Example:
        >>> bn = torch.nn.BatchNorm1d(2)
        >>> run = checkpointed_forward(bn, bn.forward)
        >>> run(torch.randn(4, 2, requires_grad=True)).sum().backward()
        >>> int(bn.num_batches_tracked)
        1
    """

    def call(*args: Any, **kwargs: Any) -> Any:
        ran = [False]

        def run(*a: Any, **k: Any) -> Any:
            if not ran[0]:
                ran[0] = True
                return forward(*a, **k)
            with _buffers_restored(module):
                return forward(*a, **k)

        return torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)

    return call


@contextmanager
def _buffers_restored(module: torch.nn.Module) -> Iterator[None]:
    saved = [(b, b.detach().clone()) for b in module.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in saved:
                buffer.copy_(value)


class ModuleCheckpointedModule(SavesAsTheModel, WatchesHeldOutput, torch.nn.Module):
    """The user's module with the submodules at ``checkpointed`` (module paths) run under
    ``torch.utils.checkpoint`` in training, and each run ``run:<first>..<last>``
    (:mod:`profiling.module_runs`) from its first call's start to its last call's end as a range
    of the ops it dispatches (:mod:`rewrite.op_regions`); in eval mode, the user's module as it is.

    Its module tree *is* the user's (``state_dict()`` keys and parameter objects are the
    model's own). ``plan`` is the plan the paths came from (``plan.capture == "modules"``),
    ``cost_graph`` the module-level profile it was solved on. It saves as the model does
    (:mod:`rewrite.saving`).
    """

    def __init__(self, original: torch.nn.Module, plan: Plan | None, checkpointed: tuple[str, ...],
                 *, cost_graph: CostGraph | None = None) -> None:
        super().__init__()
        object.__setattr__(self, "original", original)
        object.__setattr__(self, "_forward_signature", signature_of(original))
        for path in checkpointed:
            for part in (path.split("..") if path.startswith("run:") else (path,)):
                original.get_submodule(part.removeprefix("run:"))  # a wrong path fails here, not in the first step
        share_module_state(self, original)
        self.plan = plan
        self.cost_graph = cost_graph
        self.checkpointed = tuple(checkpointed)
        self.train(original.training)

    def train(self, mode: bool = True) -> "ModuleCheckpointedModule":
        super().train(mode)
        self.original.train(mode)
        return self

    @contextmanager
    def checkpoints_installed(self) -> Iterator[None]:
        """Each planned submodule's instance ``forward`` checkpointed while the context lasts (one
        training call of the model: what this module's forward, and ``planner.enable``, run)."""
        from profiling.module_runs import run_span
        from rewrite.op_regions import RegionRunner

        patched: list[tuple[torch.nn.Module, Any]] = []
        runs = [span for path in self.checkpointed if (span := run_span(path)) is not None]
        runner = RegionRunner(())
        hooks = [hook for first, last in runs for hook in (
            self.original.get_submodule(first).register_forward_pre_hook(lambda *_: runner.open_region()),
            self.original.get_submodule(last).register_forward_hook(lambda *_: runner.close_region()))]
        try:
            if runs:
                runner.__enter__()
            for path in self.checkpointed:
                if run_span(path) is not None:
                    continue
                module = self.original.get_submodule(path)
                own = module.__dict__.get("forward")
                patched.append((module, own))
                module.forward = checkpointed_forward(module, own if own is not None else type(module).forward.__get__(module))
            yield
        finally:
            if runs:
                runner.__exit__(None, None, None)
            for hook in hooks:
                hook.remove()
            for module, own in reversed(patched):
                if own is None:
                    del module.__dict__["forward"]
                else:
                    module.forward = own

    def _checkpointed_forward(self, *args: Any, **kwargs: Any) -> Any:
        if not self.original.training or not torch.is_grad_enabled():
            return self.original(*args, **kwargs)
        self._check_the_caller()
        with self.checkpoints_installed():
            output = self.original(*args, **kwargs)
        self.watch_output(output)
        return output

    forward = ForwardWithTheModelsSignature()
