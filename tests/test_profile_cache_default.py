"""The profile cache is on by default, and that keeps a model's plan from run to run.

Node times measured again move by 10 % or more on a CPU; here each profile's node times are
skewed on purpose (one half of the graph made dear, then the other), so fresh profiles choose
different plans, while ``optimize``'s default cache plans the second call on the first profile.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import pytest
import torch

import models
import profiling.profile
from planner import optimize
from profiling.cache import AUTO_CACHE_DIR, CACHE_DIR_ENV, fingerprint, resolve_cache_dir
from profiling.trace import trace_module

SOLVE = dict(max_stages=8, time_limit_s=30, exact=False)


@pytest.fixture
def skewed_profiles(monkeypatch) -> list[int]:
    """Each ``profile_graph`` call makes one half of the compute nodes 20 times dearer: the
    first half on the first call, the second half on the next, and so on; the calls are counted."""
    calls: list[int] = []
    real = profiling.profile.profile_graph

    def skewed(*args: Any, **kwargs: Any):
        graph = real(*args, **kwargs)
        half = len(calls) % 2
        calls.append(1)
        names = [n.name for n in graph.compute_nodes]
        dear = set(names[: len(names) // 2] if half == 0 else names[len(names) // 2:])
        return dataclasses.replace(graph, nodes=tuple(
            dataclasses.replace(n, time_ms=n.time_ms * 20) if n.name in dear else n for n in graph.nodes))

    monkeypatch.setattr(profiling.profile, "profile_graph", skewed)
    return calls


def _segments(opt: Any) -> tuple[tuple[str, ...], ...]:
    return tuple(s.node_names for s in opt.plan.segments)


def _budget_gb() -> float:
    model, example = models.residual_mlp(batch=512)
    return 0.75 * optimize(model, example, budget_gb=64.0, cache_dir=None).plan.unoptimized_peak_bytes / 2**30


def test_fresh_profiles_whose_times_moved_choose_other_plans(skewed_profiles):
    """The check below is not vacuous: without the cache the two skews give two plans."""
    budget_gb = _budget_gb()
    model, example = models.residual_mlp(batch=512)
    first = optimize(model, example, budget_gb=budget_gb, cache_dir=None, **SOLVE)
    second = optimize(model, example, budget_gb=budget_gb, cache_dir=None, **SOLVE)
    assert len(skewed_profiles) == 2 and _segments(first) != _segments(second)


def test_default_cache_plans_the_same_model_again_on_its_first_profile(skewed_profiles, tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path))
    budget_gb = _budget_gb()
    model, example = models.residual_mlp(batch=512)
    first = optimize(model, example, budget_gb=budget_gb, **SOLVE)
    again_model, again_example = models.residual_mlp(batch=512)  # another process's model: new objects
    second = optimize(again_model, again_example, budget_gb=budget_gb, **SOLVE)
    assert len(skewed_profiles) == 1, "the second call must read the profile the first one kept"
    assert first.cost_graph.metadata["cache"] == "miss" and second.cost_graph.metadata["cache"] == "hit"
    assert _segments(first) == _segments(second) and first.plan.segments
    assert len(list(tmp_path.glob("*.json"))) == 1


def test_auto_cache_folder_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "here"))
    assert resolve_cache_dir(AUTO_CACHE_DIR) == tmp_path / "here"
    monkeypatch.setenv(CACHE_DIR_ENV, "")
    assert resolve_cache_dir(AUTO_CACHE_DIR) is None
    monkeypatch.delenv(CACHE_DIR_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert resolve_cache_dir(AUTO_CACHE_DIR) == tmp_path / "xdg" / "ckpt-planner" / "profiles"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert resolve_cache_dir(AUTO_CACHE_DIR) == tmp_path / "home" / ".cache" / "ckpt-planner" / "profiles"
    assert resolve_cache_dir(str(tmp_path)) == tmp_path and resolve_cache_dir(None) is None


def test_a_cache_folder_that_cannot_be_written_plans_uncached_with_one_warning(tmp_path, caplog):
    blocked = tmp_path / "a_file"
    blocked.write_text("not a folder")
    model, example = models.residual_mlp(batch=512)
    with caplog.at_level(logging.WARNING, logger="profiling.cache"):
        opts = [optimize(model, example, budget_fraction=0.75, cache_dir=str(blocked / "profiles"), **SOLVE)
                for _ in range(2)]
    assert all(o.cost_graph.metadata["cache"] == "unwritable" for o in opts)
    warnings = [r for r in caplog.records if "cannot be written" in r.getMessage()]
    assert len(warnings) == 1 and "CKPT_PLANNER_CACHE_DIR" in warnings[0].getMessage()


def test_fingerprint_names_the_machine_threads():
    model, example = models.residual_mlp(batch=16)
    gm = trace_module(model, example)
    before = torch.get_num_threads()
    key = fingerprint(gm, example)
    fake_key = fingerprint(gm, example, fake=True)
    try:
        torch.set_num_threads(before + 1)
        assert fingerprint(gm, example) != key  # times measured on other threads are another machine's
        assert fingerprint(gm, example, fake=True) == fake_key  # a roofline's times are no machine's
    finally:
        torch.set_num_threads(before)


def test_fingerprint_names_the_autocast_mode():
    model, example = models.residual_mlp(batch=16)
    gm = trace_module(model, example)
    key = fingerprint(gm, example)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert fingerprint(gm, example) != key  # the profile's dtypes, and bytes, follow autocast
    assert fingerprint(gm, example) == key


def test_a_later_process_charges_the_overheads_kept_beside_the_profiles(tmp_path, monkeypatch):
    """The device's checkpoint overheads are measured by the machine's first profile and kept in
    the cache folder: a new process (here: the in-process figures forgotten, and measuring made
    to fail) profiles another model with the stored figures and measures nothing."""
    import json

    import profiling.device_overheads as overheads
    from profiling.cache import cached_profile_graph

    first_model, first_example = models.residual_mlp(batch=64)
    first = cached_profile_graph(trace_module(first_model, first_example), first_example, tmp_path, timing_repeats=1)
    [stored] = tmp_path.glob("machines/device-overheads-*.json")
    kept = json.loads(stored.read_text())
    assert (first.segment_overhead_ms, first.selective_overhead_ms_per_node) == \
        (kept["segment_ms"], kept["selective_ms_per_node"])

    stored.write_text(json.dumps({"segment_ms": 0.125, "selective_ms_per_node": 0.0625}))
    overheads._measured_overheads.cache_clear()

    def no_measuring(*args: Any, **kwargs: Any) -> float:
        raise AssertionError("the overheads were measured again")

    monkeypatch.setattr(overheads, "segment_overhead_ms", no_measuring)
    monkeypatch.setattr(overheads, "selective_overhead_ms_per_node", no_measuring)
    model, example = models.residual_mlp(batch=32)
    again = cached_profile_graph(trace_module(model, example), example, tmp_path, timing_repeats=1)
    assert again.metadata["cache"] == "miss"
    assert (again.segment_overhead_ms, again.selective_overhead_ms_per_node) == (0.125, 0.0625)
