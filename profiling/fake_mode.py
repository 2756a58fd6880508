"""Profiling on fake tensors: the real-to-fake converter and roofline times for the nodes.

Under ``FakeTensorMode`` nothing is allocated or run for real, so bytes come from tensor sizes
and each node's time from a FLOP and bytes roofline for a target device
(:mod:`profiling.roofline`).

Example:
    >>> import torch
    >>> to_fake, mode = fake_converter()
    >>> x = torch.ones(2, 3)
    >>> to_fake(x) is to_fake(x), tuple(to_fake(x).shape)
    (True, (2, 3))
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from planner.core.costgraph import Storage
from profiling.gpu_rules import GpuKernels, is_gpu_target, kernel_scratch_bytes, round_block_bytes
from profiling.interpreter import tensors_of
from profiling.roofline import calibrated_ms, op_class
from profiling.temporaries import FakeAllocationTracker

__all__ = ["fake_converter", "roofline_times", "target_kernels", "target_storages"]


def fake_converter() -> tuple[Callable[[torch.Tensor], torch.Tensor], Any]:
    """A FakeTensorMode and a memoised real-to-fake converter (same real tensor, same fake)."""
    mode = FakeTensorMode()
    made: dict[int, torch.Tensor] = {}
    keep: list[torch.Tensor] = []

    def to_fake(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in made:
            made[id(t)] = mode.from_tensor(t, static_shapes=True)
            keep.append(t)  # the id stays this tensor's while the converter lives
        return made[id(t)]

    return to_fake, mode


def roofline_times(gm: torch.fx.GraphModule, records: dict[str, dict[str, Any]], target: str) -> None:
    """Replace the (meaningless) fake-tensor timings in ``records`` by roofline estimates for
    ``target``: the node's FLOPs and the bytes of the tensors it reads and makes, calibrated per
    op class on a GPU (:func:`profiling.roofline.calibrated_ms`; a node whose outputs all alias
    its inputs runs no kernel; float32 matmuls count as TF32 where this process lets torch use it,
    ``torch.get_float32_matmul_precision() != "highest"``)."""
    tf32 = torch.get_float32_matmul_precision() != "highest"
    for n in gm.graph.nodes:
        rec = records.get(n.name)
        if rec is None or n.op not in ("call_function", "call_method", "call_module"):
            continue
        outputs = tensors_of(rec["result"])
        moved = sum(t.numel() * t.element_size() for t in outputs)
        inputs = [t for a in n.all_input_nodes for t in tensors_of(records[a.name]["result"])]
        moved += sum(t.numel() * t.element_size() for t in inputs)
        read = {t.untyped_storage()._cdata for t in inputs}
        is_view = bool(outputs) and all(t.untyped_storage()._cdata in read for t in outputs)
        floating = [t.dtype for t in (*inputs, *outputs) if t.is_floating_point()]
        dtype = str(floating[0]).removeprefix("torch.") if floating else "float32"
        rec["time_ms"] = calibrated_ms(rec["flops"], moved, target, op_class(str(n.target), is_view), dtype, tf32)


def target_kernels(target: str) -> contextlib.AbstractContextManager[Any]:
    """The context a fake-tensor forward runs in for ``target``: on a GPU, attention and dropout
    called as CUDA calls them (:class:`profiling.gpu_rules.GpuKernels`); on ``"cpu"``, nothing.

    For a GPU, each :class:`profiling.temporaries.FakeAllocationTracker` active when this is
    called also counts, from then on, the scratch ``target``'s kernels take inside an op
    (:func:`profiling.gpu_rules.kernel_scratch_bytes`): the backward, which runs after this
    context has closed, allocates most of it (a bias gradient's reduction).

    Example:
        >>> type(target_kernels("h100")).__name__, type(target_kernels("cpu")).__name__
        ('GpuKernels', 'nullcontext')
    """
    if not is_gpu_target(target):
        return contextlib.nullcontext()
    for mode in _get_current_dispatch_mode_stack():
        if isinstance(mode, FakeAllocationTracker):
            mode.kernel_scratch = functools.partial(kernel_scratch_bytes, target=target)
    return GpuKernels()


def target_storages(storages: Iterable[Storage], target: str) -> tuple[Storage, ...]:
    """The storages as ``target``'s allocator counts them: on a GPU, every storage the step
    allocates rounded up to CUDA's 512-byte blocks (:func:`profiling.gpu_rules.round_block_bytes`);
    persistent ones (parameters, buffers, inputs) stay exact, as the measured peak counts them.

    Example:
        >>> [s.size_bytes for s in target_storages([Storage(0, 8, False), Storage(1, 8, True)], "h100")]
        [512, 8]
    """
    if not is_gpu_target(target):
        return tuple(storages)
    return tuple(s if s.persistent else dataclasses.replace(s, size_bytes=round_block_bytes(s.size_bytes))
                 for s in storages)
