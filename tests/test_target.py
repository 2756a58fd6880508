"""Planning for a GPU from a CPU machine (``profile_graph(fake=True, target="h100")``).

The per-op saving rules (:mod:`profiling.gpu_rules`) on small fake shapes, no GPU needed: what
CUDA's attention backends and dropout save, the allocator's rounding, the calibrated roofline.
Then the comparison with the profiles measured on an H100 (``tests/data/h100``) on two of
them (``benchmarks/target_accuracy.py`` runs all six).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from planner.core.costgraph import Storage
from profiling.fake_mode import target_storages
from profiling.gpu_rules import BLOCK_BYTES, GpuKernels, round_block_bytes, sdpa_backend
from profiling.profile import profile_graph
from profiling.roofline import GPU_CALIBRATION, calibrated_ms, estimate_ms, op_class, roofline_ms
from profiling.trace import trace_module

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import target_accuracy  # noqa: E402

aten = torch.ops.aten
B, H, L, E = 2, 4, 48, 32  # L not a multiple of 32: memory-efficient pads its log-sum-exp


def _saved(fn, *shapes, dtype=torch.float32, mask_grad=False):
    """The tensors autograd saves when ``fn`` runs under GpuKernels on fresh fake tensors."""
    saved: list[torch.Tensor] = []
    with FakeTensorMode():
        inputs = [torch.randn(s, dtype=dtype, requires_grad=True) for s in shapes]
        if mask_grad:
            inputs.append(torch.randn(1, H, L, L, dtype=dtype, requires_grad=True))
        with GpuKernels(), torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            out = fn(*inputs)
        out.sum().backward()  # the backward runs on what was saved
    return saved, inputs


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def test_backend_choice_follows_cuda_conditions():
    q32, q16 = torch.empty(B, H, L, E), torch.empty(B, H, L, E, dtype=torch.float16)
    mask = torch.ones(L, L, dtype=torch.bool)
    assert sdpa_backend(q32, q32, q32) == "efficient"  # no flash kernel for float32
    assert sdpa_backend(q16, q16, q16) == "flash"
    assert sdpa_backend(q16, q16, q16, mask) == "efficient"  # flash takes no mask
    big = torch.empty(B, H, L, 512, dtype=torch.float16)
    assert sdpa_backend(big, big, big) == "efficient"  # flash's head size limit
    assert sdpa_backend(q32, q32, q32, torch.zeros(L, L, requires_grad=True)) == "math"
    odd = torch.empty(B, H, L, 30)
    assert sdpa_backend(odd, odd, odd) == "math"  # not aligned for memory-efficient
    kv = torch.empty(B, 1, L, E)
    assert sdpa_backend(q32, kv, kv, enable_gqa=True) == "math"
    assert sdpa_backend(q16, kv.half(), kv.half(), enable_gqa=True) == "flash"


def test_efficient_attention_saves_a_log_sum_exp_not_the_probabilities():
    saved, (q, k, v) = _saved(lambda q, k, v: aten.scaled_dot_product_attention.default(q, k, v, None, 0.1, True),
                              (B, H, L, E), (B, H, L, E), (B, H, L, E))
    assert max(t.numel() for t in saved) == B * H * L * E  # nothing of L x L
    lse = [t for t in saved if t.dim() == 3]
    assert [tuple(t.shape) for t in lse] == [(B, H, 32 * math.ceil(L / 32))] and lse[0].dtype == torch.float32
    seeds = [t for t in saved if t.dim() == 0]
    assert len(seeds) == 2  # the dropout RNG's seed and offset
    assert _bytes(saved) == 4 * _bytes([q]) + _bytes(lse) + _bytes(seeds)  # q, k, v, output


@pytest.mark.parametrize("mask_shape", [(L, L), (B, 1, L, L)])
def test_efficient_attention_saves_its_mask_as_an_additive_one(mask_shape):
    saved: list[torch.Tensor] = []
    with FakeTensorMode():
        q = torch.randn(B, H, L, E, requires_grad=True)
        mask = torch.ones(mask_shape, dtype=torch.bool)
        with GpuKernels(), torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            out = aten.scaled_dot_product_attention.default(q, q, q, mask)
        out.sum().backward()
    masks = [t for t in saved if t.shape == (B, H, L, L)]
    assert len(masks) == 1 and masks[0].dtype == q.dtype  # expanded, not copied per head
    assert masks[0].untyped_storage().nbytes() == math.prod(mask_shape) * q.element_size()


def test_flash_attention_saves_an_unpadded_log_sum_exp():
    saved, (q, _, _) = _saved(lambda q, k, v: aten.scaled_dot_product_attention.default(q, k, v, is_causal=True),
                              (B, H, L, E), (B, H, L, E), (B, H, L, E), dtype=torch.bfloat16)
    lse = [t for t in saved if t.dim() == 3]
    assert [tuple(t.shape) for t in lse] == [(B, H, L)]
    assert max(t.numel() for t in saved) == q.numel()


def test_a_mask_that_needs_grad_takes_math_and_saves_probabilities_and_a_byte_mask():
    saved, (q, _, _, mask) = _saved(
        lambda q, k, v, m: aten.scaled_dot_product_attention.default(q, k, v, m, 0.1),
        (B, H, L, E), (B, H, L, E), (B, H, L, E), mask_grad=True)
    probabilities = {t.untyped_storage()._cdata for t in saved
                     if t.numel() == B * H * L * L and t.dtype == torch.float32}
    masks = [t for t in saved if t.dtype == torch.bool]
    assert len(probabilities) == 2  # softmax's output and the dropped probabilities (matmul's input)
    assert [t.numel() for t in masks] == [B * H * L * L]
    assert mask.grad is not None and mask.grad.shape == mask.shape  # the learned bias gets its gradient


def test_dropout_saves_a_one_byte_mask_as_cuda_does():
    saved, (x,) = _saved(lambda x: aten.dropout.default(x, 0.1, True), (64, 48))
    assert [(t.dtype, t.numel()) for t in saved] == [(torch.bool, x.numel())]
    saved, _ = _saved(lambda x: torch.nn.functional.dropout(x, 0.0, True) * 2, (64, 48))
    assert saved == []  # p = 0: no mask


def test_allocator_rounding_counts_blocks_of_the_step_not_parameters():
    assert [round_block_bytes(n) for n in (0, 1, BLOCK_BYTES, BLOCK_BYTES + 1)] == [0, BLOCK_BYTES, BLOCK_BYTES,
                                                                                    2 * BLOCK_BYTES]
    storages = [Storage(0, 100, persistent=True), Storage(1, 100), Storage(2, 4 * BLOCK_BYTES)]
    assert [s.size_bytes for s in target_storages(storages, "h100")] == [100, BLOCK_BYTES, 4 * BLOCK_BYTES]
    assert target_storages(storages, "cpu") == tuple(storages)


def test_calibrated_roofline_by_op_class_and_dtype():
    assert op_class("aten.addmm.default") == "matmul"
    assert op_class("aten.scaled_dot_product_attention.default") == "attention"
    assert op_class("aten.layer_norm.default") == "normalization"
    assert op_class("aten.gelu.default") == "pointwise"
    flops, moved = 4e10, 3e8
    for klass, efficiency in GPU_CALIBRATION.efficiency.items():
        plain = roofline_ms(flops, moved, "h100", klass) if klass != "view" else 0.0
        expected_ms = GPU_CALIBRATION.floor_ms + plain / efficiency
        assert calibrated_ms(flops, moved, "h100", klass) == pytest.approx(expected_ms)
    assert calibrated_ms(flops, moved, "cpu", "matmul") == estimate_ms(flops, moved, "cpu")
    # float32 matmuls run on the CUDA cores unless TF32 is allowed; half precision on the tensor cores
    fp32, tf32, bf16 = (calibrated_ms(flops, 0, "h100", "matmul", dtype, allow)
                        for dtype, allow in (("float32", False), ("float32", True), ("bfloat16", False)))
    assert fp32 > tf32 > bf16
    assert calibrated_ms(flops, 0, "h100", "attention", "float32", True) == calibrated_ms(flops, 0, "h100", "attention")


class _Attention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(E, 3 * E)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(B, L, 3, H, E // H).permute(2, 0, 3, 1, 4)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.1, is_causal=True)
        return torch.nn.functional.dropout(out, 0.1, True)


def test_a_gpu_target_profiles_what_cuda_saves_and_cpu_what_cpu_saves():
    x = torch.randn(B, L, E)
    gm = trace_module(_Attention().train(), (x,))
    size = {}
    for target in ("cpu", "h100"):
        graph = profile_graph(gm, (x,), fake=True, target=target)
        keys = {k for n in graph.nodes for k in n.saved_storages}
        size[target] = {s.key: s.size_bytes for s in graph.storages if s.key in keys}
        attention = next(n for n in graph.nodes if "scaled_dot_product" in n.op)
        largest = max(size[target][k] for k in attention.saved_storages)
        if target == "h100":
            assert largest < B * H * L * L * 4  # no probabilities
            assert all(s % BLOCK_BYTES == 0 for s in size[target].values())
            assert attention.time_ms >= GPU_CALIBRATION.floor_ms
        else:
            assert largest >= B * H * L * L * 4  # CPU's kernel saves them
    assert sum(size["h100"].values()) < sum(size["cpu"].values())


@pytest.mark.parametrize("name", ["mlp_gpu", "bert_gpu"])
def test_fake_profile_predicts_the_h100s_peaks_within_five_percent(name):
    row = target_accuracy.compare(name, target_accuracy.fake_profile(name), plans=False)
    assert abs(row.unoptimized_error) <= 0.05, row
    assert abs(row.every_layer_error) <= 0.05, row
    assert row.joined_share >= 0.95 and row.saved_share >= 0.99, row
    assert row.time_spearman >= 0.8, row


def test_a_plan_made_on_the_fake_profile_fits_and_costs_little_more_on_the_real_one():
    row = target_accuracy.compare("bert_gpu", target_accuracy.fake_profile("bert_gpu"))
    assert row.fits, row
    assert row.cost_ratio is not None and row.cost_ratio <= 1.10, row
