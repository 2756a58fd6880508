"""Saved tensors moved to pinned host memory in the forward and fetched back for the backward.

:class:`HostOffload` is a pair of ``torch.autograd.graph.saved_tensors_hooks``: a tensor autograd
saves whose storage was marked (:meth:`HostOffload.mark`, by the name of the node or module that
made it) is copied to a pinned host buffer on a side stream instead of being held on the
device. The copy is ordered by events: the side stream waits for the compute stream where the
tensor was saved, and the caching allocator is told that the side stream still reads the
tensor (``record_stream``), so the forward never waits on the host and the device memory is
reused as soon as the copy lands. In the backward, :meth:`HostOffload.prefetch` (called from a
gradient hook the plan places: :meth:`HostOffload.fetch_when_grad_reaches`) copies a name's
tensors back on a second side stream; the unpack hook makes the compute stream wait for that
copy's event, or fetches there where no prefetch ran. Pinned buffers are pooled by size and
dtype and reused from step to step: a fresh pinned allocation per copy moves a fifth of the
bytes a second (docs/tuning.md#host_links). Beyond ``pinned_host_bytes`` tensors stay on the
device.

Checkpointed segments save through their own hooks inside the segment; their inputs are saved
outside it (``torch.utils.checkpoint``'s non-reentrant frame saves them as an autograd
function would), so a segment's inputs are offloaded like any other saved tensor.

On a CPU device the same hooks copy to ordinary host tensors with no stream (used by tests:
pack then unpack gives the tensor back bit for bit); planning with ``offload=True`` is refused
there (:func:`planner.core.options.PlanOptions`), since copies pay off only behind GPU compute.

Example:
    >>> import torch
    >>> offload = HostOffload(torch.device("cpu"))
    >>> x = torch.randn(4, requires_grad=True)
    >>> with offload.hooks():
    ...     y = offload.mark(x.exp(), "exp")
    ...     loss = (y * y).sum()
    >>> loss.backward()
    >>> torch.equal(x.grad, 2 * x.exp() ** 2), offload.packed_bytes   # y once, for exp and mul
    (True, 16)
"""

from __future__ import annotations

import contextlib
import logging
import warnings
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx

__all__ = ["HostOffload", "PinnedPool", "apply_offload"]

log = logging.getLogger(__name__)


class PinnedPool:
    """Host buffers by ``(numel, dtype)``, pinned on a CUDA device, handed out again once the
    copy back from them has completed (its event), up to ``capacity_bytes`` in all.

    Example:
        >>> import torch
        >>> pool = PinnedPool(capacity_bytes=64, pin=False)
        >>> a = pool.take(8, torch.float32); pool.give_back(a, None); pool.take(8, torch.float32) is a
        True
        >>> pool.take(100, torch.float32) is None   # beyond the capacity
        True
    """

    def __init__(self, capacity_bytes: int, pin: bool) -> None:
        self.capacity_bytes = capacity_bytes
        self.pin = pin
        self.allocated_bytes = 0
        self.free: dict[tuple[int, torch.dtype], list[tuple[torch.Tensor, Any]]] = {}

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor | None:
        """A buffer of ``numel`` elements, or None where a new one would pass the capacity."""
        for k, (buffer, event) in enumerate(self.free.get((numel, dtype), [])):
            if event is None or event.query():
                del self.free[(numel, dtype)][k]
                return buffer
        size_bytes = numel * torch.empty((), dtype=dtype).element_size()
        if self.allocated_bytes + size_bytes > self.capacity_bytes:
            return None
        self.allocated_bytes += size_bytes
        return torch.empty(numel, dtype=dtype, pin_memory=self.pin)

    def give_back(self, buffer: torch.Tensor, event: Any) -> None:
        """Return ``buffer``, free once ``event`` (a CUDA event, or None) has completed."""
        self.free.setdefault((buffer.numel(), buffer.dtype), []).append((buffer, event))


@dataclass(eq=False)
class _Packed:
    """One saved tensor: on the device until its storage is marked, then in ``host``."""

    shape: torch.Size
    dtype: torch.dtype
    on_device: torch.Tensor | None = None
    name: str = ""
    host: torch.Tensor | None = None
    copied: Any = None  # the D2H copy's CUDA event
    device_copy: torch.Tensor | None = None
    fetched: Any = None  # the H2D copy's CUDA event
    users: int = 0  # saves not yet unpacked


@dataclass
class _Step:
    #: marked storages by address, with the marked tensor (weakly: while it lives, no other
    #: storage can take its address)
    by_storage: dict[int, tuple[str, weakref.ref[torch.Tensor]]] = field(default_factory=dict)
    #: saved tensors of storages not marked (yet): a node saves its own output before the
    #: rewritten graph can mark it
    unmarked: dict[int, list[_Packed]] = field(default_factory=dict)
    #: the tensor objects packed in this forward (weakly), so one saved twice is copied once
    by_tensor: dict[int, tuple[weakref.ref[torch.Tensor], _Packed]] = field(default_factory=dict)
    packed: dict[str, list[_Packed]] = field(default_factory=dict)


class HostOffload:
    """Saved-tensor hooks that move the marked storages to host memory (module docstring)."""

    def __init__(self, device: torch.device, pinned_host_bytes: int = 32 * 2**30) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.pool = PinnedPool(pinned_host_bytes, pin=self.cuda)
        self.d2h = torch.cuda.Stream(self.device) if self.cuda else None
        self.h2d = torch.cuda.Stream(self.device) if self.cuda else None
        self.step = _Step()
        self.packed_bytes = 0
        self._warned_full = False
        self._inside: str | None = None
        #: storages of the offloaded modules' parameters and buffers: on the device all step
        self._resident: set[int] = set()

    def mark(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        """Offload ``tensor``'s storage, under ``name``, wherever autograd saves it (saves made
        before the mark included); returns ``tensor``."""
        if isinstance(tensor, torch.Tensor) and tensor.device == self.device:
            storage = tensor.untyped_storage().data_ptr()
            self.step.by_storage[storage] = (name, weakref.ref(tensor))
            for packed in self.step.unmarked.pop(storage, ()):
                self._copy_out(packed, name)
        return tensor

    def fetch_when_grad_reaches(self, tensor: torch.Tensor, names: tuple[str, ...]) -> torch.Tensor:
        """Prefetch ``names`` when the backward reaches ``tensor`` (its gradient arrives)."""
        if isinstance(tensor, torch.Tensor) and tensor.requires_grad and names:
            def fetch(grad: torch.Tensor) -> None:
                for name in names:
                    self.prefetch(name)

            tensor.register_hook(fetch)
        return tensor

    def offload_modules(self, modules: Sequence[tuple[str, torch.nn.Module]]) -> list[Any]:
        """Offload everything autograd saves while each named module runs (outside the
        checkpoints inside it: a checkpointed module's inputs), fetched when the backward reaches
        the next module's output (one module ahead). Returns the hook handles (``.remove()``).

        Example:
            >>> import torch
            >>> layers = [(f"l{k}", torch.nn.Linear(8, 8)) for k in range(3)]
            >>> offload = HostOffload(torch.device("cpu"))
            >>> handles = offload.offload_modules(layers)
            >>> x = torch.randn(2, 8, requires_grad=True)
            >>> with offload.hooks():
            ...     y = x
            ...     for _, layer in layers:
            ...         y = torch.tanh(layer(y))
            >>> y.sum().backward(); offload.packed_bytes   # each linear's input (2 x 8 floats)
            192
        """
        handles: list[Any] = []
        names = [name for name, _ in modules]
        for _, module in modules:
            self._resident.update(t.untyped_storage().data_ptr() for t in (*module.parameters(), *module.buffers()))
        for k, (name, module) in enumerate(modules):
            def enter(_module: Any, _args: Any, name: str = name) -> None:
                self._inside = name

            def leave(_module: Any, _args: Any, output: Any, k: int = k) -> Any:
                self._inside = None
                if k > 0:
                    tensor = output[0] if isinstance(output, tuple) else output
                    self.fetch_when_grad_reaches(tensor, (names[k - 1],))
                return output

            handles.append(module.register_forward_pre_hook(enter))
            handles.append(module.register_forward_hook(leave))
        return handles

    @contextlib.contextmanager
    def hooks(self) -> Iterator[None]:
        """The forward under this context packs what was marked. A new forward starts a new step:
        host buffers the last step's backward did not unpack go back to the pool."""
        for packs in self.step.packed.values():
            for packed in packs:
                self._release(packed)
        self.step = _Step()
        self.packed_bytes = 0
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            # only autograd's references keep what stayed on the device alive from here on
            self.step.unmarked.clear()
            self.step.by_tensor.clear()

    def _release(self, packed: _Packed) -> None:
        if packed.host is not None:  # free again once its last copy (back, else out) has completed
            self.pool.give_back(packed.host, packed.fetched if packed.fetched is not None else packed.copied)
        packed.host = packed.device_copy = packed.on_device = None

    def _pack(self, tensor: torch.Tensor) -> Any:
        if tensor.device != self.device or tensor.layout != torch.strided:
            return tensor
        storage = tensor.untyped_storage().data_ptr()
        marked = self.step.by_storage.get(storage)
        name = marked[0] if marked is not None and marked[1]() is not None else (
            None if storage in self._resident else self._inside)
        seen = self.step.by_tensor.get(id(tensor))
        if seen is not None and seen[0]() is tensor and (seen[1].host is not None or seen[1].on_device is not None):
            # saved again (both inputs of ``y * y``): one copy, made now if only this save offloads it
            packed = seen[1]
            packed.users += 1
            if name is not None and packed.host is None:
                waiting = self.step.unmarked.get(storage, [])
                if packed in waiting:
                    waiting.remove(packed)
                self._copy_out(packed, name)
            return packed
        packed = _Packed(tensor.shape, tensor.dtype, on_device=tensor, users=1)
        self.step.by_tensor[id(tensor)] = (weakref.ref(tensor), packed)
        if name is None:
            self.step.unmarked.setdefault(storage, []).append(packed)
        else:
            self._copy_out(packed, name)
        return packed

    def _copy_out(self, packed: _Packed, name: str) -> None:
        tensor = packed.on_device
        assert tensor is not None
        host = self.pool.take(tensor.numel(), tensor.dtype)
        if host is None:
            if not self._warned_full:
                log.warning("pinned host pool full (%d bytes): saved tensors beyond it stay on the device",
                            self.pool.capacity_bytes)
                self._warned_full = True
            return
        if self.cuda:
            assert self.d2h is not None
            self.d2h.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.d2h):
                host.view(tensor.shape).copy_(tensor, non_blocking=True)
                packed.copied = torch.cuda.Event()
                packed.copied.record(self.d2h)
            tensor.record_stream(self.d2h)
        else:
            host.view(tensor.shape).copy_(tensor)
        packed.name, packed.host, packed.on_device = name, host, None
        self.step.packed.setdefault(name, []).append(packed)
        self.packed_bytes += tensor.numel() * tensor.element_size()

    def prefetch(self, name: str) -> None:
        """Start copying ``name``'s tensors back to the device (no wait on the compute stream)."""
        for packed in self.step.packed.get(name, ()):
            if packed.device_copy is not None or packed.host is None:
                continue
            if self.cuda:
                assert self.h2d is not None
                with torch.cuda.stream(self.h2d):
                    self.h2d.wait_event(packed.copied)
                    packed.device_copy = torch.empty(packed.shape, dtype=packed.dtype, device=self.device)
                    packed.device_copy.copy_(packed.host.view(packed.shape), non_blocking=True)
                    packed.fetched = torch.cuda.Event()
                    packed.fetched.record(self.h2d)
            else:
                packed.device_copy = packed.host.view(packed.shape).clone()

    def _unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Packed):
            return packed
        packed.users -= 1
        if packed.on_device is not None:  # never marked: it stayed
            tensor = packed.on_device
        else:
            if packed.host is None:
                raise RuntimeError("a saved tensor offloaded to host memory was unpacked after its step ended "
                                   "(a second backward through the same graph: use retain_graph=False)")
            self.prefetch(packed.name)
            tensor = packed.device_copy
            assert tensor is not None
            if self.cuda:
                current = torch.cuda.current_stream(self.device)
                current.wait_event(packed.fetched)
                tensor.record_stream(current)
        if packed.users <= 0:
            self._release(packed)
        return tensor


class _Holder:
    """The :class:`HostOffload` a rewritten graph calls, as a plain attribute (not a submodule)."""

    __slots__ = ("offload", "stack")

    def __init__(self, offload: HostOffload) -> None:
        self.offload = offload
        self.stack: contextlib.ExitStack | None = None


def _begin(holder: _Holder) -> None:
    if holder.stack is not None:  # the last forward raised before its end
        holder.stack.close()
    holder.stack = contextlib.ExitStack()
    holder.stack.enter_context(holder.offload.hooks())


def _end(holder: _Holder, value: Any) -> Any:
    if holder.stack is not None:
        holder.stack.close()
        holder.stack = None
    return value


def _mark(holder: _Holder, value: Any, name: str) -> None:
    for tensor in value if isinstance(value, (tuple, list)) else (value,):
        if isinstance(tensor, torch.Tensor):
            holder.offload.mark(tensor, name)


def _fetch_when(holder: _Holder, value: Any, names: tuple[str, ...]) -> None:
    tensor = value[0] if isinstance(value, (tuple, list)) and value else value
    if isinstance(tensor, torch.Tensor):
        holder.offload.fetch_when_grad_reaches(tensor, names)


def apply_offload(gm: torch.fx.GraphModule, plan: Any, offload: HostOffload) -> torch.fx.GraphModule:
    """Rewrite ``gm`` (the captured graph ``plan`` was made from, before
    :func:`rewrite.segments.apply_plan`) in place so its forward runs under ``offload``'s hooks,
    marks each of ``plan.offloaded`` where its value is first available outside a segment, and
    fetches it when the backward reaches its trigger (``plan.offload_triggers``); returns ``gm``.

    Example:
        >>> from planner.core.plan import Plan
        >>> from profiling.trace import trace_module
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        >>> gm = trace_module(model, (torch.randn(2, 4),))
        >>> names = [n.name for n in gm.graph.nodes if n.op == "call_function"]
        >>> plan = Plan(0, 0, 0, (), 0.0, 0.0, 0, "test", 0.0, offloaded=(names[-2],),
        ...             offload_triggers=(names[-1],))
        >>> offload = HostOffload(torch.device("cpu"))
        >>> apply_offload(gm, plan, offload)(torch.randn(2, 4)).sum().backward()
        >>> offload.packed_bytes   # tanh's output, 2 x 8 floats (saved by tanh and the linear)
        64
    """
    graph = gm.graph
    by_name = {n.name: n for n in graph.nodes}
    unknown = [n for n in (*plan.offloaded, *plan.offload_triggers) if n not in by_name]
    if unknown:
        raise ValueError(f"offloaded or trigger nodes not in the graph: {unknown[:3]}; re-plan on this graph")
    segment_end = {name: seg.node_names[-1] for seg in plan.segments for name in seg.node_names}
    gm.offload_holder = _Holder(offload)  # type: ignore[assignment]
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    with graph.inserting_after(placeholders[-1]) if placeholders else graph.inserting_before(None), \
            warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Attempted to insert a get_attr Node")
        holder = graph.get_attr("offload_holder")
    with graph.inserting_after(holder):
        graph.call_function(_begin, (holder,))
    for name in plan.offloaded:
        with graph.inserting_after(by_name[segment_end.get(name, name)]):
            graph.call_function(_mark, (holder, by_name[name], name))
    by_trigger: dict[str, list[str]] = {}
    for name, trigger in zip(plan.offloaded, plan.offload_triggers):
        by_trigger.setdefault(trigger, []).append(name)
    for trigger, names in by_trigger.items():
        with graph.inserting_after(by_name[trigger]):
            graph.call_function(_fetch_when, (holder, by_name[trigger], tuple(names)))
    output = next(n for n in graph.nodes if n.op == "output")
    with graph.inserting_before(output):
        ended = graph.call_function(_end, (holder, output.args[0]))
    output.args = (ended,)
    graph.lint()
    gm.recompile()
    return gm
