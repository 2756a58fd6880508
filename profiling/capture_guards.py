"""What a capture must hold steady around ``torch.export``: the key/value cache off for the
training step, stderr free of the partial graph a failed export prints (custom
``torch.autograd.Function`` calls: :mod:`profiling.custom_functions`), and no Python stack
recorded per node.
"""

from __future__ import annotations

import contextlib
import io
import logging
import sys
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["training_step_without_kv_cache", "partial_graph_kept_off_stderr", "no_node_stack_traces"]

log = logging.getLogger(__name__)


@contextlib.contextmanager
def training_step_without_kv_cache(model: torch.nn.Module) -> Iterator[int]:
    """Within the context, every HuggingFace-style ``config`` of ``model`` and its submodules
    that has ``use_cache=True`` (the default of every HF config) says ``use_cache=False``; the
    context yields how many it changed and restores them on exit. A training step needs no
    key/value cache, and a ``DynamicCache`` in the output is a type ``torch.export`` cannot
    flatten. Inputs that pass ``use_cache=True`` themselves still ask for the cache.

    Example:
        >>> import types
        >>> model = torch.nn.Linear(2, 2)
        >>> model.config = types.SimpleNamespace(use_cache=True)
        >>> with training_step_without_kv_cache(model) as changed:
        ...     changed, model.config.use_cache
        (1, False)
        >>> model.config.use_cache
        True
    """
    configs = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if getattr(config, "use_cache", None) is True:
            configs[id(config)] = config
    try:
        for config in configs.values():
            config.use_cache = False
        yield len(configs)
    finally:
        for config in configs.values():
            config.use_cache = True


@contextlib.contextmanager
def partial_graph_kept_off_stderr() -> Iterator[None]:
    """Within the context, stderr is held; on exit it is written out as it came, less the
    partial graph ``torch.export`` prints there (once per nested export call) when it fails (``exc.partial_fx_graph``: dozens
    of lines of generated code ahead of the capture error's one line), which is logged at DEBUG
    instead. Warnings and other text written meanwhile reach stderr when the context ends.

    Example:
        >>> class Failed(Exception):
        ...     partial_fx_graph = "def forward(self, x): ..."
        >>> try:
        ...     with partial_graph_kept_off_stderr():
        ...         print(Failed.partial_fx_graph, file=sys.stderr)
        ...         raise Failed()
        ... except Failed:
        ...     pass
    """
    real = sys.stderr
    held = io.StringIO()
    sys.stderr = held
    try:
        yield
    except BaseException as exc:
        partial = getattr(exc, "partial_fx_graph", None)
        printed = f"{partial}\n"
        if partial is not None and printed in held.getvalue():
            text = held.getvalue().replace(printed, "")
            held = io.StringIO(text)
            log.debug("partial graph of the failed export:\n%s", partial)
        raise
    finally:
        sys.stderr = real
        if held.getvalue():
            real.write(held.getvalue())


@contextlib.contextmanager
def no_node_stack_traces() -> Iterator[None]:
    """Within the context, FX records no Python stack trace per captured node
    (``torch.fx.config.do_not_emit_stack_traces``; restored on exit). The traces are a
    debugging aid the planner does not read (its errors name a node's module path), and
    recording them is a tenth of a capture (docs/tuning.md#node-stack-traces).

    Example:
        >>> import torch.fx.config
        >>> with no_node_stack_traces():
        ...     torch.fx.config.do_not_emit_stack_traces
        True
    """
    import torch.fx.config as fx_config

    before = fx_config.do_not_emit_stack_traces
    fx_config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        fx_config.do_not_emit_stack_traces = before
