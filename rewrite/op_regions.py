"""Checkpoint ranges of the ops an eager forward dispatches, whatever Python runs between them.

A model that cannot be captured as one graph (``.item()`` branches, ``nonzero`` routing, NumPy
calls, data-dependent loop counts) still dispatches a sequence of ATen ops. An
:class:`OpRegion` is a contiguous range of that sequence run under saved-tensor hooks: each
tensor autograd saves that an op of the range produced is replaced by a handle, and the first
backward use of a handle replays the range's recorded ops (the same ATen calls on the same
inputs, the RNG state of the range's start restored) up to the last op whose output a handle
needs. Inputs the range did not produce (parameters, tensors from before the range, tensors
made outside ATen such as ``torch.from_numpy``) are held by the record, as a checkpoint holds
its inputs.

The replay is exact where the range's inputs keep their values until the backward, and a range
where that cannot be shown (an op of the range writes a tensor it read or saved, a tensor read
was changed, an explicit ``generator``) keeps its saved tensors instead (no memory saved, same
values). Writes to tensors from outside the range (BatchNorm running statistics, counters) go
to copies on replay, so they happen once per step.

Example:
    >>> import torch
    >>> w = torch.randn(8, 8, requires_grad=True)
    >>> x = torch.randn(4, 8)
    >>> with RegionRunner(((0, 2),)):
    ...     y = torch.tanh(torch.tanh(x @ w)).sum()
    >>> y.backward()
    >>> g = w.grad.clone(); w.grad = None
    >>> torch.tanh(torch.tanh(x @ w)).sum().backward()
    >>> torch.equal(g, w.grad)
    True
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from profiling.op_counting import UNCOUNTED_OPS

__all__ = ["OpRegion", "RegionRunner", "BATCH_NORM_STAT_ARGS"]

log = logging.getLogger(__name__)

#: Ops that update running statistics in place without declaring it in their schema: the
#: argument positions written (copies of them are passed on replay).
BATCH_NORM_STAT_ARGS: dict[str, tuple[int, ...]] = {
    "native_batch_norm": (3, 4),
    "cudnn_batch_norm": (3, 4),
    "miopen_batch_norm": (3, 4),
    "_native_batch_norm_legit": (3, 4),
}

_PRODUCED, _EXTERNAL = "p", "e"


# The per-op facts below are read from the op's schema, a C++ object, on every op a range runs:
# cached per op (and argument count), they cost a dictionary lookup.

@functools.cache
def _written_positions(func: Any, n_args: int) -> frozenset[int]:
    """Positional arguments ``func`` writes in place (by schema, and BatchNorm's statistics)."""
    written = {i for i, arg in enumerate(func._schema.arguments[:n_args])
               if arg.alias_info is not None and arg.alias_info.is_write}
    written.update(i for i in BATCH_NORM_STAT_ARGS.get(func._schema.name.split("::")[-1], ()) if i < n_args)
    return frozenset(written)


@functools.cache
def _written_keywords(func: Any) -> frozenset[str]:
    """Names of the arguments ``func`` writes in place (an ``out=`` argument, passed by keyword)."""
    return frozenset(a.name for a in func._schema.arguments if a.alias_info is not None and a.alias_info.is_write)


@functools.cache
def _op_name(func: Any) -> str:
    """``str(func)`` (``aten.mm.default``), formatted once per op."""
    return str(func)


#: argument types pytree keeps as one leaf (the common ones; any other goes through ``tree_flatten``)
_ONE_LEAF = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)


def _leaf_count(arg: Any) -> int:
    """``len(tree_flatten(arg)[0])``, without pytree for a tensor, a scalar or a flat list of them."""
    if isinstance(arg, torch.Tensor) or type(arg) in _ONE_LEAF:
        return 1
    if type(arg) in (list, tuple) and all(_is_leaf(item) for item in arg):
        return len(arg)
    return len(tree_flatten(arg)[0])


def _out_leaves(out: Any) -> list[Any]:
    """``tree_flatten(out)[0]``, without pytree for a tensor or a flat tuple or list of them."""
    if isinstance(out, torch.Tensor):
        return [out]
    if type(out) in (tuple, list) and all(isinstance(leaf, torch.Tensor) for leaf in out):
        return list(out)
    return tree_flatten(out)[0]


def _is_leaf(arg: Any) -> bool:
    return isinstance(arg, torch.Tensor) or type(arg) in _ONE_LEAF


class _FlatSpec(NamedTuple):
    """How :func:`_flatten` laid out an op's arguments: per positional argument None (one leaf)
    or its sequence type and length; then the keyword names, one leaf each."""

    args: tuple[tuple[type, int] | None, ...]
    keys: tuple[str, ...]


# An op's arguments are flattened as it is recorded and rebuilt as it is replayed, once per op
# in a range: pytree's generic walk costs tens of microseconds an op, as much as a small op's
# kernel. Flat arguments (tensors, scalars, flat lists of them: nearly every ATen call) take
# this path, in pytree's leaf order; anything else takes pytree's.

def _flatten(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[Any], Any]:
    """``tree_flatten((args, kwargs))``: the same leaves in the same order, and a spec
    :func:`_unflatten` takes.

    Example:
        >>> leaves, spec = _flatten((torch.ones(1), [2, 3]), {"alpha": 1.0})
        >>> len(leaves), _unflatten(leaves, spec)[0][1], _unflatten(leaves, spec)[1]
        (4, [2, 3], {'alpha': 1.0})
    """
    leaves: list[Any] = []
    layout: list[tuple[type, int] | None] = []
    for arg in args:
        if _is_leaf(arg):
            leaves.append(arg)
            layout.append(None)
        elif type(arg) in (list, tuple) and all(_is_leaf(item) for item in arg):
            leaves.extend(arg)
            layout.append((type(arg), len(arg)))
        else:
            return tree_flatten((args, kwargs))
    for value in kwargs.values():
        if not _is_leaf(value):
            return tree_flatten((args, kwargs))
        leaves.append(value)
    return leaves, _FlatSpec(tuple(layout), tuple(kwargs))


def _unflatten(leaves: list[Any], spec: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` back from :func:`_flatten`'s leaves and spec."""
    if not isinstance(spec, _FlatSpec):
        return tree_unflatten(leaves, spec)
    args: list[Any] = []
    i = 0
    for entry in spec.args:
        if entry is None:
            args.append(leaves[i])
            i += 1
        else:
            kind, n = entry
            args.append(kind(leaves[i:i + n]))
            i += n
    return tuple(args), dict(zip(spec.keys, leaves[i:]))


class _Handle:
    """What autograd holds instead of a tensor the region produced."""

    __slots__ = ("region", "key")

    def __init__(self, region: "OpRegion", key: tuple[int, int]) -> None:
        self.region = region
        self.key = key


class OpRegion:
    """The record of one range of dispatched ops, and its replay.

    Example:
        >>> region = OpRegion()
        >>> region.replayed_ops
        0
    """

    def __init__(self) -> None:
        self.ops: list[tuple[Any, list[Any], Any, set[int]]] = []
        self.externals: list[torch.Tensor] = []
        self._external_ids: dict[int, int] = {}
        self._read_versions: list[tuple[int, int]] = []
        self._produced: dict[int, tuple[weakref.ref[torch.Tensor], tuple[int, int]]] = {}
        self._pending: list[tuple[torch.Tensor, int]] = []
        self._written: set[int] = set()
        self._needed: dict[tuple[int, int], int] = {}
        self._cache: dict[tuple[int, int], torch.Tensor] = {}
        self._unpacked: dict[tuple[int, int], int] = {}
        self.held: dict[tuple[int, int], torch.Tensor] | None = None
        self.hold_reason = ""
        self.rng_state: torch.Tensor | None = torch.get_rng_state()
        self.cuda_rng_state: list[torch.Tensor] | None = (torch.cuda.get_rng_state_all() if torch.cuda.is_initialized()
                                                          else None)
        self.replayed_ops = 0
        self._remaining = 0
        self._released = False
        self._replayed = False

    def _external(self, tensor: torch.Tensor) -> int:
        index = self._external_ids.get(id(tensor))
        if index is None or self.externals[index] is not tensor:
            index = len(self.externals)
            self.externals.append(tensor)
            self._external_ids[id(tensor)] = index
        return index

    def snapshots(self, func: Any, args: tuple[Any, ...]) -> dict[int, torch.Tensor]:
        """Copies, taken before ``func`` runs, of the tensors from outside the range it writes in
        place: the replay starts from the values the forward started from."""
        return {i: args[i].detach().clone() for i in _written_positions(func, len(args))
                if isinstance(args[i], torch.Tensor) and not self._made_here(args[i])}

    def _made_here(self, tensor: torch.Tensor) -> bool:
        entry = self._produced.get(id(tensor))
        return entry is not None and entry[0]() is tensor

    def record(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any,
               versions: list[int | None], snapshots: dict[int, torch.Tensor] | None = None,
               flat: tuple[list[Any], Any] | None = None) -> None:
        """Add one op that ran (``versions``: its tensor arguments' versions before it ran;
        ``snapshots``: :meth:`snapshots` taken before it ran; ``flat``: ``tree_flatten((args,
        kwargs))`` where the caller has it)."""
        snapshots = snapshots or {}
        leaves, spec = flat if flat is not None else _flatten(args, kwargs)
        arg_of = [i for i, arg in enumerate(args) for _ in range(_leaf_count(arg))]
        arg_of += [-1] * (len(leaves) - len(arg_of))
        written_args = _written_positions(func, len(args))
        if any(not isinstance(args[i], torch.Tensor) for i in written_args) or (
                kwargs and not _written_keywords(func).isdisjoint(kwargs)):
            self._hold(f"{func} writes a list or an out= argument in place")
        written = {position for position, i in enumerate(arg_of) if i in written_args}
        refs: list[Any] = []
        for position, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Generator):
                self._hold("an explicit generator")
            if not isinstance(leaf, torch.Tensor):
                refs.append(leaf)
                continue
            entry = self._produced.get(id(leaf))
            is_written = position in written
            if entry is not None and entry[0]() is leaf:
                refs.append((_PRODUCED, entry[1]))
            elif is_written and arg_of[position] in snapshots:
                self.externals.append(snapshots[arg_of[position]])
                refs.append((_EXTERNAL, len(self.externals) - 1))
            else:
                index = self._external(leaf)
                refs.append((_EXTERNAL, index))
                if is_written:
                    self._written.add(id(leaf))
                    continue
                if id(leaf) in self._written:
                    self._hold(f"{func} reads a tensor from outside the range that the range wrote")
                elif versions[position] is not None:
                    self._read_versions.append((index, versions[position]))
        self.ops.append((func, refs, spec, written))
        op_index = len(self.ops) - 1
        for j, leaf in enumerate(_out_leaves(out)):
            if isinstance(leaf, torch.Tensor):
                self._produced[id(leaf)] = (weakref.ref(leaf), (op_index, j))

    def alias(self, out: Any, source: Any) -> None:
        """``out`` (an uncounted op's result, such as ``detach``) stands for ``source``'s value."""
        entry = self._produced.get(id(source))
        if isinstance(out, torch.Tensor) and entry is not None and entry[0]() is source:
            self._produced[id(out)] = (weakref.ref(out), entry[1])

    def _hold(self, reason: str) -> None:
        if not self.hold_reason:
            self.hold_reason = reason

    def pack(self, tensor: torch.Tensor) -> Any:
        """The handle autograd keeps for ``tensor`` (the tensor itself when the range did not make it)."""
        entry = self._produced.get(id(tensor))
        if entry is None or entry[0]() is not tensor:
            return tensor
        self._pending.append((tensor, tensor._version))
        self._needed[entry[1]] = self._needed.get(entry[1], 0) + 1
        return _Handle(self, entry[1])

    def close(self) -> None:
        """End of the range's forward: drop what the handles stand for, unless the range must keep it."""
        if any(t._version != v for t, v in self._pending):
            self._hold("an op wrote a tensor after autograd saved it")
        if any(self.externals[i]._version != v for i, v in self._read_versions):
            self._hold("a tensor the range read was written inside it")
        if self.hold_reason:
            log.debug("op region of %d ops keeps its saved tensors: %s", len(self.ops), self.hold_reason)
            self.held = {self._produced[id(t)][1]: t for t, _ in self._pending}
        self._pending = []
        self._produced = {}
        self._external_ids = {}
        if not any(torch.Tag.nondeterministic_seeded in func.tags for func, _, _, _ in self.ops):
            self.rng_state = self.cuda_rng_state = None  # nothing random to replay

    def unpack(self, handle: _Handle) -> torch.Tensor:
        """The value ``handle`` stands for: held, or from a replay of the range. Once every
        handle was unpacked (one backward), the record and its inputs are released, as a
        checkpoint releases its inputs: a second backward through the range is refused."""
        key = handle.key
        if self.held is not None:
            return self.held[key]
        if key not in self._cache:
            if self._released or self._replayed:
                raise RuntimeError("backward through a checkpointed op region a second time: its inputs were released "
                                   "after the first backward (retain_graph=True is not supported on the graph-break path)")
            self._replay()
            self._replayed = True
            self._remaining = sum(self._needed.values())
        value = self._cache[key]
        self._unpacked[key] = self._unpacked.get(key, 0) + 1
        self._remaining -= 1
        if self._unpacked[key] >= self._needed[key]:
            del self._cache[key]
        if self._remaining <= 0 and not self._cache:
            self.ops, self.externals, self._read_versions, self._released = [], [], [], True
        return value

    def _replay(self) -> None:
        for index, version in self._read_versions:
            if self.externals[index]._version != version:
                raise RuntimeError(f"a tensor a checkpointed op region read (external input {index}) was written "
                                   "in place before the backward: its recompute would not be exact")
        last = max(i for i, _ in self._needed)
        last_use: dict[tuple[int, int], int] = {}
        for i, (_, refs, _, _) in enumerate(self.ops[:last + 1]):
            for ref in refs:
                if isinstance(ref, tuple) and len(ref) == 2 and ref[0] == _PRODUCED:
                    last_use[ref[1]] = i
        values: dict[tuple[int, int], torch.Tensor] = {}
        devices = [torch.device("cuda", i) for i in range(len(self.cuda_rng_state))] if self.cuda_rng_state else []
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            if self.rng_state is not None:
                torch.set_rng_state(self.rng_state)
            if self.cuda_rng_state:
                torch.cuda.set_rng_state_all(self.cuda_rng_state)
            for i, (func, refs, spec, written) in enumerate(self.ops[:last + 1]):
                leaves = []
                for position, ref in enumerate(refs):
                    if isinstance(ref, tuple) and len(ref) == 2 and ref[0] == _PRODUCED:
                        leaves.append(values[ref[1]])
                    elif isinstance(ref, tuple) and len(ref) == 2 and ref[0] == _EXTERNAL:
                        tensor = self.externals[ref[1]]
                        leaves.append(tensor.clone() if position in written else tensor.detach())
                    else:
                        leaves.append(ref)
                args, kwargs = _unflatten(leaves, spec)
                out = func(*args, **kwargs)
                self.replayed_ops += 1
                for j, leaf in enumerate(_out_leaves(out)):
                    key = (i, j)
                    if isinstance(leaf, torch.Tensor) and (key in last_use and last_use[key] > i or key in self._needed):
                        values[key] = leaf
                for ref in refs:
                    if isinstance(ref, tuple) and len(ref) == 2 and ref[0] == _PRODUCED and last_use.get(ref[1]) == i \
                            and ref[1] not in self._needed:
                        values.pop(ref[1], None)
        self._cache = {key: values[key] for key in self._needed if key in values}
        self.rng_state = self.cuda_rng_state = None  # replayed: the state is not needed again


class RegionRunner(TorchDispatchMode):
    """Counts the ops a forward dispatches and runs the ranges ``regions`` (pairs of first and
    last op index, inclusive, in order) as :class:`OpRegion` s. ``expected_ops`` (the op names
    the profiled forward dispatched) guards the plan: a range whose first op is not the planned
    one (another branch shifted the ops) is not opened, and that part runs as the model does.
    Every range opened is exact whatever it holds: its replay runs the ops it recorded.

    Example:
        >>> with RegionRunner(()) as runner:
        ...     _ = torch.ones(2) + 1
        >>> runner.op_count
        2
    """

    def __init__(self, regions: Sequence[tuple[int, int]], expected_ops: Sequence[str] | None = None) -> None:
        super().__init__()
        self.regions = sorted(regions)
        self.expected_ops = expected_ops
        self.op_count = 0
        #: the first op index where this forward's op differs from the planned one's
        self.diverged_at: int | None = None
        self.mismatched = 0
        #: ranges not opened because their first op is not the planned one (another branch)
        self.skipped = 0
        self.opened: list[OpRegion] = []
        self._next = 0
        #: the range holding the last op dispatched (open until the next op lies beyond it)
        self._open: OpRegion | None = None
        self._open_end = -1

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = _op_name(func)
        if name in UNCOUNTED_OPS:
            out = func(*args, **kwargs)
            if self._open is not None and args:
                self._open.alias(out, args[0])
            return out
        index = self.op_count
        self.op_count += 1
        if self._open is not None and index > self._open_end:
            self._finish()
        matches = self.expected_ops is None or (index < len(self.expected_ops) and self.expected_ops[index] == name)
        if not matches:
            self.mismatched += 1
            if self.diverged_at is None:
                self.diverged_at = index
                log.debug("op %d of this forward (%s) is not the planned forward's", index, func)
        if self._open is None:
            while self._next < len(self.regions) and self.regions[self._next][0] < index:
                self._next += 1
            if self._next < len(self.regions) and self.regions[self._next][0] == index:
                if matches:
                    self._open, self._open_end = OpRegion(), self.regions[self._next][1]
                    self.opened.append(self._open)
                else:
                    self.skipped += 1
                self._next += 1
        region = self._open
        if region is None:
            return func(*args, **kwargs)
        flat = _flatten(args, kwargs)
        versions = [leaf._version if isinstance(leaf, torch.Tensor) and not leaf.is_inference() else None
                    for leaf in flat[0]]
        snapshots = region.snapshots(func, args)
        out = func(*args, **kwargs)
        region.record(func, args, kwargs, out, versions, snapshots, flat)
        return out

    def _pack(self, tensor: torch.Tensor) -> Any:
        """A save between two ops of the open range becomes a handle when the range made the
        tensor. A save after the range's last op (that op's output saved, or the next op's input:
        autograd saves both between the two dispatches) stays a tensor: it is the range's
        output, which the ops after it hold anyway, and a handle would replay the range early."""
        region = self._open
        if region is None or self.op_count > self._open_end:
            return tensor
        return region.pack(tensor)

    def open_region(self) -> None:
        """Start a range at the next op, whatever its index (a range delimited by events, such
        as a module's forward hooks, rather than op indices)."""
        if self._open is None:
            self._open, self._open_end = OpRegion(), 2**62
            self.opened.append(self._open)

    def close_region(self) -> None:
        """End the range :meth:`open_region` started, after the last op dispatched."""
        if self._open is not None:
            self._finish()

    def _finish(self) -> None:
        assert self._open is not None
        self._open.close()
        self._open = None

    def __enter__(self) -> "RegionRunner":
        torch._C._autograd._push_saved_tensors_default_hooks(self._pack, _unpack)
        try:
            return super().__enter__()
        except BaseException:
            torch._C._autograd._pop_saved_tensors_default_hooks()
            raise

    def __exit__(self, *exc: Any) -> Any:
        if self._open is not None:
            self._finish()
        try:
            return super().__exit__(*exc)
        finally:
            torch._C._autograd._pop_saved_tensors_default_hooks()


def _unpack(saved: Any) -> Any:
    return saved.region.unpack(saved) if isinstance(saved, _Handle) else saved
