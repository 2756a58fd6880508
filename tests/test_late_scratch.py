"""A backward peak's late part (``CostNode.backward_late_scratch_bytes``) in the simulator.

On CUDA a linear's bias gradient is reduced over the batch after the node's backward function
has returned, in a scratch buffer of up to 132 MiB. Outside a checkpoint the linear's saved input
is still held then; inside a non-reentrant checkpoint the recomputed input the function unpacked
is already gone. The simulator adds the late part after releasing the node's recomputed saved
tensors, and only in a recomputed segment; a profile saved without the field reads as 0.
"""

from __future__ import annotations

import dataclasses

import pytest

from graphs import MIB
from planner.core.costgraph import CostGraph, CostNode, Storage
from planner.core.simulate import fits_budget, simulate


def _linear_between(late_mib: int) -> CostGraph:
    """x -> a -> b -> c: ``b`` (a linear) saves its 4 MiB input ``a`` and its backward peaks at
    the input's 4 MiB gradient plus ``late_mib`` of scratch taken after its function returned."""
    nodes = (
        CostNode("x", "placeholder", kind="input", output_storages=(0,)),
        CostNode("a", "op", input_names=("x",), output_storages=(1,), output_bytes=4 * MIB, requires_grad=True),
        CostNode("b", "aten.linear.default", input_names=("a",), output_storages=(2,), saved_storages=(1,),
                 output_bytes=4 * MIB, requires_grad=True, backward_peak_bytes=(4 + 8) * MIB,
                 backward_late_scratch_bytes=late_mib * MIB),
        CostNode("c", "op", input_names=("b",), output_storages=(3,), saved_storages=(3,), output_bytes=MIB,
                 requires_grad=True),
    )
    storages = (Storage(0, MIB, True), Storage(1, 4 * MIB), Storage(2, 4 * MIB), Storage(3, MIB))
    return CostGraph(nodes, storages, output_names=("c",))


def test_the_late_scratch_counts_in_full_outside_a_checkpoint():
    # b's backward: x, c's output, the gradients of b and a, b's saved input and the 8 MiB
    # scratch, whether or not the scratch comes after the function
    for late_mib in (0, 8):
        result = simulate(_linear_between(late_mib))
        assert result.peak_bytes == (1 + 1 + 4 + 4 + 4 + 8) * MIB
        assert (result.peak_phase, result.peak_node) == ("backward", "b")


def test_in_a_recomputed_segment_the_late_scratch_comes_after_the_saved_input_is_released():
    segment = [("a", "b")]
    early = simulate(_linear_between(0), segment)
    assert early.peak_bytes == (1 + 1 + 4 + 4 + 4 + 8) * MIB  # all of it while the input is held
    late = simulate(_linear_between(8), segment)
    assert late.peak_bytes == (1 + 1 + 4 + 4 + 8) * MIB  # the recomputed input is gone
    moments = [b for phase, name, b in late.timeline if (phase, name) == ("backward", "b")]
    assert moments == [(1 + 1 + 4 + 4 + 4) * MIB, (1 + 1 + 4 + 4 + 8) * MIB]  # the function, then the scratch
    for budget in (late.peak_bytes - 1, late.peak_bytes):
        assert fits_budget(_linear_between(8), segment, budget) == (late.peak_bytes <= budget)


def test_a_saved_tensor_an_earlier_node_also_saved_stays_for_the_late_scratch():
    # a (a relu) saves its output too: its backward, after b's, still needs the recomputed a
    g = _linear_between(8)
    g = dataclasses.replace(g, nodes=(g.nodes[0], dataclasses.replace(g.nodes[1], saved_storages=(1,)), *g.nodes[2:]))
    plain = dataclasses.replace(g, nodes=tuple(dataclasses.replace(n, backward_late_scratch_bytes=0) for n in g.nodes))
    segment = [("a", "b")]
    assert simulate(g, segment).peak_bytes == simulate(plain, segment).peak_bytes == (1 + 1 + 4 + 4 + 4 + 8) * MIB


def test_the_late_part_is_part_of_the_backward_peak():
    with pytest.raises(ValueError, match="backward_late_scratch_bytes"):
        CostNode("b", "op", backward_peak_bytes=MIB, backward_late_scratch_bytes=2 * MIB)


def test_the_field_is_saved_and_a_profile_without_it_reads_as_none(tmp_path):
    import json

    from profiling.cache import READABLE_CACHE_VERSIONS, load_profile, save_profile

    g = _linear_between(8)
    path = tmp_path / "p.json"
    save_profile(g, path)
    assert load_profile(path).nodes == g.nodes
    payload = json.loads(path.read_text())
    for node in payload["nodes"]:
        del node["backward_late_scratch_bytes"]
    path.write_text(json.dumps({**payload, "cache_version": min(READABLE_CACHE_VERSIONS)}))
    assert load_profile(path).node("b").backward_late_scratch_bytes == 0


@pytest.mark.parametrize("bound_name", ["covering_bound", "segment_covering_bound"])
def test_the_lower_bounds_stay_below_a_plan_that_uses_the_late_release(bound_name):
    # at 18 MiB only recomputing a and b fits (their recompute releases a before the scratch);
    # a bound that held b's saved input at the late moment would call the budget infeasible
    import importlib

    module = "planner.bounds.covering" if bound_name == "covering_bound" else "planner.bounds.segment_covering"
    bound = getattr(importlib.import_module(module), bound_name)
    g = _linear_between(8)
    budget = simulate(g, [("a", "b")]).peak_bytes
    assert budget < simulate(g).peak_bytes
    result = bound(g, budget)
    assert result.value < float("inf")
    assert result.value <= sum(g.node(name).time_ms for name in ("a", "b")) + 1e-9
