"""The profile of one training step, as plain data: the input of every solver.

A :class:`CostGraph` lists the nodes of the captured FX graph in execution order, with what
the profiler observed for each (the storages it produced, the storages autograd saved while
it ran, its time and FLOPs). It imports only the standard library; ``to_frame`` imports
pandas lazily.

Example:
    >>> g = CostGraph(
    ...     nodes=(
    ...         CostNode(name="x", op="placeholder", kind="input", output_storages=(1,)),
    ...         CostNode(name="relu", op="aten.relu.default", input_names=("x",),
    ...                  output_storages=(2,), saved_storages=(2,), output_bytes=400,
    ...                  requires_grad=True, time_ms=0.1),
    ...     ),
    ...     storages=(Storage(1, 400, persistent=True), Storage(2, 400)),
    ...     output_names=("relu",),
    ... )
    >>> g.persistent_bytes
    400
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import TYPE_CHECKING, Any

from planner.core.replay_facts import ReplayFacts, replay_facts
from planner.core.units import MIB

if TYPE_CHECKING:  # pragma: no cover
    import pandas

__all__ = ["MIB", "Storage", "CostNode", "CostGraph", "NODE_KINDS", "shard_parameters", "hold_parameter_grads",
           "protect_reads_before_writes", "with_held_bytes"]

#: Bytes in a mebibyte: the unit of the stage models' memory account and of log lines.
#: ``compute`` nodes run an op; the others hold step-long tensors.
NODE_KINDS = ("compute", "input", "param", "buffer", "constant")


@dataclass(frozen=True)
class Storage:
    """One block of memory. ``persistent`` storages (parameters, buffers, inputs) live all step."""

    key: int
    size_bytes: int
    persistent: bool = False


@dataclass(frozen=True)
class CostNode:
    """What the profiler observed for one FX node.

    Attributes:
        name: the FX node name, the join key across all stages.
        op: the op it runs (``aten.addmm.default``, ``placeholder``, ...).
        kind: one of :data:`NODE_KINDS`.
        input_names: names of the nodes whose values this node reads.
        output_storages: keys of the storages its output tensors live in (new or aliased).
        saved_storages: keys of the storages autograd saved for backward while it ran,
            deduplicated; may include storages internal to the op.
        output_bytes: ``numel * element_size`` summed over its tensor outputs (its gradient size).
        requires_grad: whether any output requires grad.
        is_alias: the output shares storage with an input (view, getitem, in-place op).
        time_ms: forward compute time of the node.
        flops: FLOPs of the node's forward as ``FlopCounterMode`` counts them.
        recomputable: False for ops that must run exactly once (buffer mutation, I/O).
        is_random: the op draws random numbers (its recompute needs the RNG state replayed).
        module: the user's module the node came from, when known.
        forward_peak_bytes: measured bytes the node's forward allocates at its high point,
            temporaries included (0 when unknown: the simulator then uses tensor sizes alone).
        backward_peak_bytes: the same for the node's backward.
        backward_late_scratch_bytes: the part of ``backward_peak_bytes`` reached only after the
            node's backward function has returned: CUDA's scratch for reducing a broadcast
            gradient (a bias's) to its input's shape, which autograd runs on the function's
            outputs. Outside a checkpoint the node's saved tensors are still held then; inside a
            non-reentrant checkpoint the recomputed ones the function unpacked are already
            released, so the simulator adds this part after releasing them. ``backward_peak_bytes``
            minus it is the high point while the function runs. 0: none, or not known.
        selective_save: a selective checkpoint policy can keep this node's outputs from the
            forward instead of recomputing them (a function call that aliases no input, writes
            nothing in place and draws no random numbers); :mod:`planner.solvers.keep` decides which.
        viewed_storages: storages of its inputs that ops inside the node return views of (a
            linear reshapes its input): a selective policy keeping the node holds them too.
        after_last_save_fraction: the share of the node's forward (FLOPs, or dispatched ops for
            a node without FLOPs) that runs after autograd saved its last tensor for backward. A
            checkpoint recompute stops there when the node is the last of its segment to save
            anything (a linear saves its inputs before its matmul: 1.0; a relu saves its output
            after: 0.0). None when
            not measured: :mod:`planner.core.rerun` then infers it from the saved storages.
        after_last_save_time_fraction: the same share of the node's forward time, measured in
            the warm timing passes for nodes with a share strictly between 0 and 1 (CPU
            attention: half its FLOPs but less of its time come after it saves its softmax).
            None: the time share is taken to be ``after_last_save_fraction``.
        grad_shared_inputs: the inputs whose gradient is this node's output gradient itself,
            no new buffer: the operands of an add of the output's shape and dtype (its backward
            passes the gradient on), the input of a full ``sum`` or ``mean`` that nothing else
            reads (an expanded view of the scalar's gradient). The simulator holds one buffer
            for them until the last one's gradient is used.
    """

    name: str
    op: str
    kind: str = "compute"
    input_names: tuple[str, ...] = ()
    output_storages: tuple[int, ...] = ()
    saved_storages: tuple[int, ...] = ()
    output_bytes: int = 0
    requires_grad: bool = False
    is_alias: bool = False
    time_ms: float = 0.0
    flops: int = 0
    recomputable: bool = True
    is_random: bool = False
    module: str = ""
    forward_peak_bytes: int = 0
    backward_peak_bytes: int = 0
    selective_save: bool = False
    viewed_storages: tuple[int, ...] = ()
    after_last_save_fraction: float | None = None
    after_last_save_time_fraction: float | None = None
    backward_late_scratch_bytes: int = 0
    grad_shared_inputs: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for field_name in ("after_last_save_fraction", "after_last_save_time_fraction"):
            value = getattr(self, field_name)
            if value is not None and not 0.0 <= value <= 1.0:
                raise ValueError(f"node {self.name!r}: {field_name} must be in [0, 1], got {value!r}")
        if not 0 <= self.backward_late_scratch_bytes <= max(0, self.backward_peak_bytes):
            raise ValueError(f"node {self.name!r}: backward_late_scratch_bytes must be in [0, backward_peak_bytes], "
                             f"got {self.backward_late_scratch_bytes!r}")
        if self.kind not in NODE_KINDS:
            raise ValueError(f"node {self.name!r}: kind must be one of {NODE_KINDS}, got {self.kind!r}")
        if not set(self.grad_shared_inputs) <= set(self.input_names):
            raise ValueError(f"node {self.name!r}: grad_shared_inputs must be among its input_names, "
                             f"got {self.grad_shared_inputs!r}")


#: the cached properties of :class:`CostGraph`, derived from its fields and never pickled
_DERIVED = ("index", "storage_by_key", "replay_facts")


@dataclass(frozen=True)
class CostGraph:
    """A profiled training step: nodes in execution order plus the storages they touch.

    ``output_names`` are the values the module returns, and the criterion node when the loss
    is taken outside the module (:mod:`profiling.criterion`); ``loss_names`` the ones backward
    starts from (all differentiable outputs when empty). ``output_held`` says whether the
    caller holds the outputs through the backward (a loop that keeps ``out`` alive); when
    False the outputs live to the end of the forward and are then dropped, the loss alone held,
    as in ``criterion(model(x), y).backward()`` (:attr:`held_output_names`).
    ``segment_overhead_bytes`` is what each checkpointed segment keeps from its forward to its
    backward besides tensors of the graph (the saved RNG state).
    ``selective_overhead_ms_per_node`` is the time a selective checkpoint policy adds to each
    node of a segment that keeps outputs, forward plus recompute (measured by
    :mod:`profiling.selective_overhead`; 0 when unknown). ``segment_overhead_ms`` is the time
    each segment that recomputes anything adds beyond its nodes' (the checkpoint call, its
    hooks and the RNG state; measured by :mod:`profiling.segment_overhead`; 0 when unknown).
    ``range_overhead_ms_per_node`` is the time each node of such a segment adds beyond its own
    recompute where segments run as recorded op ranges (the graph-break path: recording the op
    in the forward, dispatching its replay; measured by :mod:`rewrite.region_overhead`; 0 on a
    captured graph, whose segments rerun their nodes as the forward does).
    ``range_end_saves_held``: where segments run as recorded op ranges, what is saved after a
    segment's last op dispatched (its outputs saved for its own backward, and the same tensors
    saved by the next op, which the profile counts as the last node's saves) stays saved as
    tensors: the range cannot tell the two apart, and the next op's must stay tensors.
    :func:`planner.core.simulate.simulate` holds them until their backward. The inputs the last op
    saves are saved before it runs, inside the range, and are recomputed like the rest.
    """

    nodes: tuple[CostNode, ...]
    storages: tuple[Storage, ...]
    output_names: tuple[str, ...] = ()
    loss_names: tuple[str, ...] = ()
    step_ms: float = 0.0
    segment_overhead_bytes: int = 0
    selective_overhead_ms_per_node: float = 0.0
    segment_overhead_ms: float = 0.0
    range_overhead_ms_per_node: float = 0.0
    range_end_saves_held: bool = False
    measured_peak_bytes: int | None = None
    output_held: bool = True
    metadata: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        names = [n.name for n in self.nodes]
        if len(set(names)) != len(names):
            raise ValueError("CostGraph node names must be unique")
        known = set(names)
        storage_keys = {s.key for s in self.storages}
        for node in self.nodes:
            missing = [i for i in node.input_names if i not in known]
            if missing:
                raise ValueError(f"node {node.name!r} reads unknown nodes {missing}")
            unknown = [k for k in (*node.output_storages, *node.saved_storages) if k not in storage_keys]
            if unknown:
                raise ValueError(f"node {node.name!r} refers to unknown storages {unknown}")
        for name in (*self.output_names, *self.loss_names):
            if name not in known:
                raise ValueError(f"output {name!r} is not a node of the graph")

    def __getstate__(self) -> dict[str, Any]:
        """The fields without the caches derived from them (:attr:`index`, :attr:`storage_by_key`,
        :attr:`replay_facts`): a pickled graph (a saved optimized module holds its profiles) is
        rebuilt by the code that loads it, whatever code computed the caches.

        Example:
            >>> import pickle
            >>> g = CostGraph((CostNode("x", "placeholder", kind="input", output_storages=(0,)),),
            ...               (Storage(0, 8, True),))
            >>> _ = g.replay_facts
            >>> "replay_facts" in vars(pickle.loads(pickle.dumps(g)))
            False
        """
        return {k: v for k, v in self.__dict__.items() if k not in _DERIVED}

    def __setstate__(self, state: dict[str, Any]) -> None:
        # a pickle written with the caches in it drops them here as well
        self.__dict__.update({k: v for k, v in state.items() if k not in _DERIVED})

    @cached_property
    def index(self) -> dict[str, int]:
        """Position of every node in execution order, by name."""
        return {n.name: i for i, n in enumerate(self.nodes)}

    @property
    def held_output_names(self) -> tuple[str, ...]:
        """The values the caller holds through the whole backward: every output when
        ``output_held``, else the loss alone.

        Example:
            >>> g = CostGraph((CostNode("x", "placeholder", kind="input", output_storages=(0,)),),
            ...               (Storage(0, 8, True),), output_names=("x",), output_held=False)
            >>> g.held_output_names
            ()
        """
        return self.output_names if self.output_held else self.loss_names

    @cached_property
    def storage_by_key(self) -> dict[int, Storage]:
        return {s.key: s for s in self.storages}

    @cached_property
    def replay_facts(self) -> ReplayFacts:
        """What every replay of this graph needs and no plan changes (:mod:`planner.core.replay_facts`)."""
        return replay_facts(self)

    @property
    def persistent_bytes(self) -> int:
        """Bytes of parameters, buffers and inputs: held for the whole step."""
        return sum(s.size_bytes for s in self.storages if s.persistent)

    @property
    def compute_nodes(self) -> tuple[CostNode, ...]:
        return tuple(n for n in self.nodes if n.kind == "compute")

    @property
    def forward_ms(self) -> float:
        return sum(n.time_ms for n in self.nodes)

    @property
    def forward_flops(self) -> int:
        return sum(n.flops for n in self.nodes)

    def node(self, name: str) -> CostNode:
        return self.nodes[self.index[name]]

    def saved_bytes_by_node(self) -> dict[str, int]:
        """Activation bytes each node saves for backward, each storage counted at its first saver."""
        sizes = self.storage_by_key
        seen: set[int] = set()
        out: dict[str, int] = {}
        for node in self.nodes:
            fresh = [k for k in node.saved_storages if not sizes[k].persistent and k not in seen]
            seen.update(fresh)
            if fresh:
                out[node.name] = sum(sizes[k].size_bytes for k in fresh)
        return out

    def to_frame(self) -> "pandas.DataFrame":
        """One row per node: name, op, kind, output and saved bytes, time, FLOPs, flags."""
        import pandas

        sizes = self.storage_by_key
        rows = [
            {
                "name": n.name,
                "op": n.op,
                "kind": n.kind,
                "module": n.module,
                "output_bytes": n.output_bytes,
                "saved_bytes": sum(sizes[k].size_bytes for k in n.saved_storages if not sizes[k].persistent),
                "time_ms": n.time_ms,
                "flops": n.flops,
                "requires_grad": n.requires_grad,
                "recomputable": n.recomputable,
                "is_random": n.is_random,
            }
            for n in self.nodes
        ]
        return pandas.DataFrame(rows)


def _param_storage_keys(graph: CostGraph) -> set[int]:
    return {k for n in graph.nodes if n.kind == "param" for k in n.output_storages}


def shard_parameters(graph: CostGraph, world_size: int) -> CostGraph:
    """The per-rank view of ``graph`` when parameters and their gradients are sharded over
    ``world_size`` ranks (FSDP / ZeRO-3): each parameter storage and each parameter's gradient
    counts ``ceil(bytes / world_size)``. Buffers, inputs and activations are unchanged.

    Example:
        >>> g = CostGraph((CostNode("w", "get_attr", kind="param", output_storages=(0,),
        ...                         output_bytes=1000, requires_grad=True),),
        ...               (Storage(0, 1000, True),))
        >>> shard_parameters(g, 4).persistent_bytes
        250
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    if world_size == 1:
        return graph
    keys = _param_storage_keys(graph)
    storages = tuple(
        replace(s, size_bytes=-(-s.size_bytes // world_size)) if s.key in keys else s for s in graph.storages
    )
    nodes = tuple(
        replace(n, output_bytes=-(-n.output_bytes // world_size)) if n.kind == "param" else n for n in graph.nodes
    )
    return replace(graph, nodes=nodes, storages=storages, measured_peak_bytes=None,
                   metadata={**graph.metadata, "world_size": world_size})


def hold_parameter_grads(graph: CostGraph) -> CostGraph:
    """``graph`` for a step that starts with every parameter's ``.grad`` already allocated
    (gradient accumulation, or ``zero_grad(set_to_none=False)``): the gradients become one
    persistent storage held all step, and backward adds into them instead of allocating.

    Example:
        >>> g = CostGraph((CostNode("w", "get_attr", kind="param", output_storages=(0,),
        ...                         output_bytes=1000, requires_grad=True),),
        ...               (Storage(0, 1000, True),))
        >>> hold_parameter_grads(g).persistent_bytes
        2000
    """
    grads: dict[int, int] = {}
    for n in graph.nodes:
        if n.kind == "param" and n.requires_grad and n.output_storages:
            grads[n.output_storages[0]] = max(grads.get(n.output_storages[0], 0), n.output_bytes)
    if not grads:
        return graph
    key = max((s.key for s in graph.storages), default=-1) + 1
    storages = (*graph.storages, Storage(key, sum(grads.values()), persistent=True))
    nodes = tuple(replace(n, output_bytes=0) if n.kind == "param" and n.requires_grad else n for n in graph.nodes)
    return replace(graph, nodes=nodes, storages=storages, measured_peak_bytes=None,
                   metadata={**graph.metadata, "grads_held": True})


def with_held_bytes(graph: CostGraph, extra_bytes: int) -> CostGraph:
    """``graph`` with ``extra_bytes`` more held all step (one persistent storage), or ``graph``
    itself for none.

    Example:
        >>> g = CostGraph((), (Storage(0, 8, True),))
        >>> with_held_bytes(g, 100).persistent_bytes
        108
    """
    if extra_bytes <= 0:
        return graph
    key = max((st.key for st in graph.storages), default=-1) + 1
    return replace(graph, storages=(*graph.storages, Storage(key, int(extra_bytes), True)),
                               measured_peak_bytes=None)


def protect_reads_before_writes(graph: CostGraph) -> CostGraph:
    """Mark as not recomputable every node that reads a storage an in-place op writes later in
    the forward: its recompute (in backward, after the write) would read the new values, and
    non-reentrant checkpoint refuses an input whose version changed. In-place writers are the
    non-recomputable compute nodes whose outputs alias their inputs (``add_``, ``mul_``, ...).

    Example:
        >>> g = CostGraph((CostNode("a", "placeholder", kind="input", output_storages=(0,)),
        ...                CostNode("t", "tanh", input_names=("a",), output_storages=(1,)),
        ...                CostNode("m", "mul_", input_names=("a",), output_storages=(0,),
        ...                         is_alias=True, recomputable=False)),
        ...               (Storage(0, 8, True), Storage(1, 8)))
        >>> protect_reads_before_writes(g).node("t").recomputable
        False
    """
    storages_of = {n.name: set(n.output_storages) for n in graph.nodes}
    last_write: dict[int, int] = {}
    for i, n in enumerate(graph.nodes):
        if n.kind == "compute" and not n.recomputable and n.is_alias:
            read = {k for name in n.input_names for k in storages_of[name]}
            for k in set(n.output_storages) & read:
                last_write[k] = i
    if not last_write:
        return graph
    nodes = list(graph.nodes)
    changed = False
    for i, n in enumerate(nodes):
        if n.kind != "compute" or not n.recomputable:
            continue
        read = {k for name in n.input_names for k in storages_of[name]} | set(n.output_storages)
        if any(last_write.get(k, -1) > i for k in read):
            nodes[i] = replace(n, recomputable=False)
            changed = True
    return replace(graph, nodes=tuple(nodes)) if changed else graph
