"""Hand-made and random CostGraphs for the solver tests (standard library only)."""

from __future__ import annotations

import itertools
import random

from planner.core.costgraph import CostGraph, CostNode, Storage
from planner.solvers.keep import keepable_in_segment, segment_with_kept
from planner.core.simulate import simulate

MIB = 2**20


def chain(sizes_mib: list[float], times_ms: list[float] | None = None, param_mib: float = 0.0) -> CostGraph:
    """input -> n1 -> n2 ... each node saves its own output (like relu/tanh), optional params."""
    storages = [Storage(0, MIB, persistent=True)]
    nodes = [CostNode("x", "placeholder", kind="input", output_storages=(0,))]
    times_ms = times_ms or [1.0] * len(sizes_mib)
    prev = "x"
    for i, (size, t) in enumerate(zip(sizes_mib, times_ms), start=1):
        inputs = [prev]
        if param_mib:
            key = len(storages)
            storages.append(Storage(key, int(param_mib * MIB), persistent=True))
            nodes.append(CostNode(f"w{i}", "get_attr", kind="param", output_storages=(key,),
                                  output_bytes=int(param_mib * MIB), requires_grad=True))
            inputs.append(f"w{i}")
        key = len(storages)
        storages.append(Storage(key, int(size * MIB)))
        nodes.append(CostNode(f"n{i}", "op", input_names=tuple(inputs), output_storages=(key,),
                              saved_storages=(key,), output_bytes=int(size * MIB), requires_grad=True,
                              time_ms=t, flops=int(t * 1e6)))
        prev = f"n{i}"
    return CostGraph(tuple(nodes), tuple(storages), output_names=(prev,))


def random_dag(seed: int, n: int) -> CostGraph:
    """A random DAG of ``n`` compute nodes with skip connections, views and internal saves.
    Half the nodes that save an internal storage (a composite op) run half their forward after
    their last save (``after_last_save_fraction=0.5``, from a generator of its own so that the
    graphs are otherwise the same as before the field existed), and half of those a fifth of
    their time (``after_last_save_time_fraction=0.2``, from a third generator)."""
    rng = random.Random(seed)
    fraction_rng = random.Random(seed * 7919 + 1)
    time_fraction_rng = random.Random(seed * 104729 + 3)
    storages = [Storage(0, MIB, persistent=True), Storage(1, 2 * MIB, persistent=True)]
    nodes = [
        CostNode("x", "placeholder", kind="input", output_storages=(0,)),
        CostNode("w", "get_attr", kind="param", output_storages=(1,), output_bytes=2 * MIB, requires_grad=True),
    ]
    values: list[tuple[str, int, int]] = []  # (name, storage, bytes)
    for i in range(n):
        name = f"n{i}"
        k = rng.choice([1, 1, 2]) if values else 1
        parents = rng.sample(values, min(k, len(values))) if values else [("x", 0, MIB)]
        inputs = [p[0] for p in parents]
        if rng.random() < 0.3:
            inputs.append("w")
        if values and rng.random() < 0.15:  # a view of its first parent
            src = parents[0]
            nodes.append(CostNode(name, "view", input_names=tuple(inputs), output_storages=(src[1],),
                                  output_bytes=src[2], requires_grad=True, is_alias=True, time_ms=0.01))
            values.append((name, src[1], src[2]))
            continue
        size = rng.choice([1, 2, 3, 4, 6, 8]) * MIB // 2
        key = len(storages)
        storages.append(Storage(key, size))
        saved = []
        if rng.random() < 0.7:
            saved.append(key)
        for p in parents:
            if p[1] != 0 and rng.random() < 0.5:
                saved.append(p[1])
        fraction = time_fraction = None
        if rng.random() < 0.2:
            internal = len(storages)
            storages.append(Storage(internal, MIB // 2))
            saved.append(internal)
            fraction = 0.5 if fraction_rng.random() < 0.5 else None
            time_fraction = 0.2 if fraction is not None and time_fraction_rng.random() < 0.5 else None
        nodes.append(CostNode(
            name, "op", input_names=tuple(dict.fromkeys(inputs)), output_storages=(key,),
            saved_storages=tuple(dict.fromkeys(saved)), output_bytes=size, requires_grad=True,
            time_ms=rng.uniform(0.1, 3.0), flops=rng.randrange(0, 10**6),
            forward_peak_bytes=size + (MIB if rng.random() < 0.2 else 0),
            selective_save=rng.random() < 0.3, after_last_save_fraction=fraction,
            after_last_save_time_fraction=time_fraction,
        ))
        values.append((name, key, size))
    return CostGraph(tuple(nodes), tuple(storages), output_names=(values[-1][0],))


def mlp_blocks(blocks: int) -> CostGraph:
    """Residual MLP blocks, ``x + down(gelu(up(norm(x))))``, hidden 4x wide: norm, both linears
    and gelu save only their inputs (their recompute can end before their kernel), add saves
    nothing."""
    storages = [Storage(0, MIB, persistent=True), Storage(1, MIB, persistent=True)]
    nodes = [CostNode("x", "placeholder", kind="input", output_storages=(0,)),
             CostNode("w", "get_attr", kind="param", output_storages=(1,), output_bytes=MIB, requires_grad=True)]

    def add(name: str, inputs: tuple[str, ...], size: int, saved: tuple[int, ...], time_ms: float) -> int:
        key = len(storages)
        storages.append(Storage(key, size))
        nodes.append(CostNode(name, "op", input_names=inputs, output_storages=(key,), saved_storages=saved,
                              output_bytes=size, requires_grad=True, time_ms=time_ms))
        return key

    prev, prev_key = "x", 0
    for b in range(blocks):
        normed = add(f"norm{b}", (prev,), MIB, (prev_key,), 0.3)
        hidden = add(f"up{b}", (f"norm{b}", "w"), 4 * MIB, (normed, 1), 5.0)
        activated = add(f"gelu{b}", (f"up{b}",), 4 * MIB, (hidden,), 1.5)
        add(f"down{b}", (f"gelu{b}", "w"), MIB, (activated, 1), 5.0)
        prev_key = add(f"add{b}", (f"down{b}", prev), MIB, (), 0.2)
        prev = f"add{b}"
    return CostGraph(tuple(nodes), tuple(storages), output_names=(prev,))


def all_run_sets(n: int):
    """Every set of disjoint runs of consecutive positions in 0..n-1."""
    if n == 0:
        yield []
        return

    def from_position(i: int):
        if i >= n:
            yield []
            return
        yield from from_position(i + 1)
        for j in range(i, n):
            for rest in from_position(j + 1):
                yield [(i, j), *rest]

    yield from from_position(0)


def brute_force(g: CostGraph, budget: int, objective: str = "time",
                kept_outputs: bool = False) -> tuple[float | None, int | None]:
    """Least recompute time (``objective="flops"``: FLOPs) over every plan of segments that
    fits ``budget`` (None when none does), and the smallest peak of any plan. With
    ``kept_outputs``, every subset of each segment's keepable nodes is tried too (the
    selective policy's cost included, as :func:`planner.solvers.keep.segment_with_kept` prices it)."""
    compute = list(g.compute_nodes)
    best_cost, min_peak = None, None
    for runs in all_run_sets(len(compute)):
        names = [[n.name for n in compute[a : b + 1]] for a, b in runs]
        if any(not n.recomputable for seg in names for n in map(g.node, seg)):
            continue
        choices = [_subsets(keepable_in_segment(g, seg)) if kept_outputs else [()] for seg in names]
        for kept in itertools.product(*choices):
            segments = [segment_with_kept(g, seg, set(k)) for seg, k in zip(names, kept)]
            peak = simulate(g, segments).peak_bytes
            min_peak = peak if min_peak is None else min(min_peak, peak)
            if peak <= budget:
                cost = sum(s.recompute_ms if objective == "time" else s.recompute_flops for s in segments)
                best_cost = cost if best_cost is None else min(best_cost, cost)
    return best_cost, min_peak


def _subsets(names: list[str]) -> list[tuple[str, ...]]:
    return [c for r in range(len(names) + 1) for c in itertools.combinations(names, r)]


def every_plan(g: CostGraph, kept_outputs: bool = True) -> list[tuple[int, float, int]]:
    """``(simulated peak, recompute ms, recompute FLOPs)`` of every plan of segments, and with
    ``kept_outputs`` of every subset of each segment's keepable nodes too."""
    compute = [n.name for n in g.compute_nodes]
    plans = []
    for runs in all_run_sets(len(compute)):
        names = [compute[a : b + 1] for a, b in runs]
        choices = [_subsets(keepable_in_segment(g, seg)) if kept_outputs else [()] for seg in names]
        for kept in itertools.product(*choices):
            segments = [segment_with_kept(g, seg, set(k)) for seg, k in zip(names, kept)]
            plans.append((simulate(g, segments).peak_bytes, sum(s.recompute_ms for s in segments),
                          sum(s.recompute_flops for s in segments)))
    return plans
