"""What a GPU's kernels save for backward, for profiling a GPU step on a CPU machine.

Profiled on fake CPU tensors, ops take the CPU's kernel paths, and some save other tensors than
the CUDA kernels a GPU runs: CPU attention saves the attention probabilities (batch x heads x
seq x seq) where CUDA's flash and memory-efficient kernels save only a log-sum-exp, and CPU
dropout saves a float noise tensor where CUDA's fused dropout saves a one-byte mask.
:class:`GpuKernels` is a ``TorchFunctionMode`` that, while a graph is profiled for a GPU target,
calls each such op as CUDA would dispatch it, so autograd saves what it saves on the GPU:

- ``scaled_dot_product_attention``: the backend CUDA picks (:func:`sdpa_backend`, torch's
  default order: flash, then memory-efficient, then math) is called directly; flash and
  memory-efficient save query, key, value, output, a float32 log-sum-exp and the dropout RNG
  seed and offset (memory-efficient also the mask); math saves the probabilities and a one-byte
  dropout mask.
- ``dropout``: CUDA's fused ``native_dropout`` (a ``bool`` mask, 1 byte per element).

:func:`round_block_bytes` is CUDA's caching allocator's rounding of every block, which
``max_memory_allocated`` counts. :func:`kernel_scratch_bytes` is the scratch a CUDA kernel takes
from that allocator inside one op (no tensor of its own): a ``sum`` or ``mean`` split across
thread blocks stages partial results in global memory (:func:`reduction_scratch_bytes`). That
is most of a matmul's backward on a GPU: the gradient of a linear's bias is the sum of the
output gradient over the batch, and on the H100 its staging buffer took twice that gradient's
bytes, up to 132 MiB (docs/tuning.md#reduction_scratch).

Example:
    >>> import torch
    >>> from torch._subclasses.fake_tensor import FakeTensorMode
    >>> with FakeTensorMode():
    ...     q = torch.randn(2, 4, 64, 32, requires_grad=True)
    ...     saved = []
    ...     with GpuKernels(), torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
    ...         out = torch.ops.aten.scaled_dot_product_attention.default(q, q, q, None, 0.1, True)
    >>> max(t.numel() for t in saved) == q.numel()   # no (64 x 64) probabilities saved
    True
    >>> round_block_bytes(1), round_block_bytes(513)
    (512, 1024)
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["GpuKernels", "sdpa_backend", "round_block_bytes", "BLOCK_BYTES", "is_gpu_target",
           "kernel_scratch_bytes", "reduction_scratch_bytes"]

aten = torch.ops.aten

#: CUDA's caching allocator rounds every allocation up to a multiple of 512 bytes
#: (``kMinBlockSize`` in ``c10/cuda/CUDACachingAllocator.cpp``); ``max_memory_allocated`` counts
#: the rounded blocks. Large blocks are carved from 2 MiB-rounded segments, but that rounding
#: shows in ``memory_reserved``, not in the allocated bytes a budget bounds
#: (docs/tuning.md#block_bytes).
BLOCK_BYTES = 512

_FLASH_DTYPES = (torch.float16, torch.bfloat16)
_EFFICIENT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: the largest head size CUDA's flash attention takes (``check_head_dim_size_flash``;
#: docs/tuning.md#flash_max_head_dim)
FLASH_MAX_HEAD_DIM = 256


def is_gpu_target(target: str) -> bool:
    """Whether ``target`` names a GPU (every roofline device but ``"cpu"``).

    Example:
        >>> is_gpu_target("h100"), is_gpu_target("cpu")
        (True, False)
    """
    return target.lower() != "cpu"


def round_block_bytes(size_bytes: int) -> int:
    """The bytes CUDA's caching allocator counts for an allocation of ``size_bytes``.

    Example:
        >>> round_block_bytes(0), round_block_bytes(512), round_block_bytes(8)
        (0, 512, 512)
    """
    return BLOCK_BYTES * math.ceil(size_bytes / BLOCK_BYTES)


#: CUDA's reduction kernel (``aten/src/ATen/native/cuda/Reduce.cuh``, ``setReduceConfig``): at
#: most 512 threads a block, a warp of 32, each thread summing at least 16 and at most 256 values
#: once the input is split across blocks, outputs read 4 at a time
_REDUCE_MAX_THREADS, _WARP, _MIN_VALUES, _MAX_VALUES, _MAX_VECTOR = 512, 32, 16, 256, 4
#: the reductions whose CUDA kernel is that one (``sum_kernel_cuda``, ``mean_kernel_cuda``)
_STAGED_REDUCTIONS = ("aten.sum.dim_IntList", "aten.sum.default", "aten.mean.dim", "aten.mean.default")


def _last_pow2(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def _div_up(a: int, b: int) -> int:
    return -(-a // b)


def _iterator_dims(shape: tuple[int, ...], strides: tuple[int, ...], reduced: set[int]) -> list[tuple[int, int, bool]]:
    """``(size, input stride, reduced)`` of the dimensions a reduction's ``TensorIterator`` runs
    over: size-one dimensions dropped, reduced ones first, each group ordered by stride, and
    neighbours of a group merged where the input is contiguous across them."""
    dims = [(shape[d], strides[d], d in reduced) for d in range(len(shape)) if shape[d] != 1]
    dims.sort(key=lambda dim: (not dim[2], dim[1]))
    merged: list[tuple[int, int, bool]] = []
    for size, stride, red in dims:
        if merged and merged[-1][2] == red and merged[-1][0] * merged[-1][1] == stride:
            merged[-1] = (merged[-1][0] * size, merged[-1][1], red)
        else:
            merged.append((size, stride, red))
    return merged


def reduction_scratch_bytes(shape: tuple[int, ...], strides: tuple[int, ...], dims: Any, target: str,
                            accumulator_bytes: int = 4) -> int:
    """Bytes CUDA's reduction kernel takes from the caching allocator while it reduces a tensor of
    ``shape`` and ``strides`` (in elements) over ``dims`` (None or empty: all) on GPU ``target``.

    ``setReduceConfig`` in ``Reduce.cuh``, followed step by step: when each thread would still sum
    256 values or more, the reduction is split across up to ``ctas_per_output`` thread blocks
    (enough blocks to fill the GPU's SMs, :class:`profiling.roofline.DeviceSpec`), which stage
    partial results in a global buffer of ``accumulator_bytes * outputs * ctas_per_output`` (times
    the block width and output vector width when outputs lie along the fastest dimension) and
    count finished blocks in an ``int`` semaphore per block column. Both are freed when the kernel
    has been queued. A sum over the batch of a (batch, features) float32 gradient, a bias
    gradient, stages twice the gradient's bytes on an H100, up to about 132 MiB.
    Inputs over 2**31 elements, which CUDA splits into several launches, are taken as one.

    Example:
        >>> MiB = 2**20
        >>> reduction_scratch_bytes((4096, 768), (768, 1), [0], "h100") // MiB   # twice 12 MiB
        24
        >>> reduction_scratch_bytes((65536, 1024), (1024, 1), [0], "h100") // MiB   # at most 132
        132
        >>> reduction_scratch_bytes((4096, 768), (768, 1), [1], "h100") < MiB   # along rows: small
        True
        >>> reduction_scratch_bytes((4096, 768), (768, 1), [0], "cpu")
        0
    """
    from profiling.roofline import DEVICE_SPECS

    spec = DEVICE_SPECS.get(target.lower())
    if spec is None or not spec.sm_count:
        return 0
    ndim = len(shape)
    reduced = set(range(ndim)) if not dims else {d % ndim for d in dims} if ndim else set()
    iter_dims = _iterator_dims(tuple(shape), tuple(strides), reduced)
    if not iter_dims or not any(red for _, _, red in iter_dims):
        return 0
    num_outputs = math.prod(size for size, _, red in iter_dims if not red)
    num_inputs = math.prod(size for size, _, red in iter_dims if red)
    outputs_dims = [(size, stride) for size, stride, red in iter_dims if not red]
    fastest_reduced = not outputs_dims or iter_dims[0][1] < outputs_dims[0][1]
    vector = 1
    if fastest_reduced:
        dim0, dim1 = num_inputs, num_outputs
        if iter_dims[0][1] == 1 and dim0 >= 128 and sum(red for _, _, red in iter_dims) == 1:
            dim0 //= _MAX_VECTOR  # loads vectorised along the input
    else:
        dim0, dim1 = num_outputs, num_inputs
        if outputs_dims[0][1] == 1:
            vector = _MAX_VECTOR
            others = [stride for size, stride, _ in iter_dims if (size, stride) != outputs_dims[0]]
            while vector > 1 and any(n % vector for n in (outputs_dims[0][0], *others)):
                vector //= 2
            dim0 //= vector
    max_threads = _REDUCE_MAX_THREADS // vector
    dim0_pow2 = max_threads if dim0 >= max_threads else _last_pow2(dim0)
    dim1_pow2 = max_threads if dim1 >= max_threads else _last_pow2(dim1)
    block_width = min(dim0_pow2, _WARP)
    block_height = min(dim1_pow2, max_threads // block_width)
    block_width = min(dim0_pow2, max_threads // block_height)
    step_input = block_width if fastest_reduced else 1
    step_output = 1 if fastest_reduced else block_width
    if _div_up(num_inputs, step_input) < min(block_height * _MIN_VALUES, _MAX_VALUES):
        return 0  # each warp takes outputs of its own: no split of the input across blocks
    step_input *= block_height
    values = _div_up(num_inputs, step_input)
    target_grid = spec.sm_count * (spec.max_threads_per_sm // (block_width * block_height))
    grid = _div_up(num_outputs // vector, step_output)
    if values < _MAX_VALUES or grid > target_grid:
        return 0
    ctas = max(min(_div_up(target_grid, grid), _div_up(values, _MIN_VALUES)), _div_up(values, _MAX_VALUES))
    if ctas <= 1:
        return 0
    staging = accumulator_bytes * num_outputs * ctas * (1 if fastest_reduced else block_width * vector)
    return round_block_bytes(staging) + round_block_bytes(4 * grid)


def kernel_scratch_bytes(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], target: str) -> int:
    """Bytes the CUDA kernel of aten op ``func`` takes from the caching allocator while it runs on
    GPU ``target`` and gives back before returning, beyond its outputs: the staging buffer of a
    ``sum`` or ``mean`` split across thread blocks (:func:`reduction_scratch_bytes`; floats below
    double precision accumulate in float32, the rest in 8 bytes); 0 for every other op. These
    bytes count in CUDA's ``max_memory_allocated`` but belong to no tensor, so a fake-tensor
    profile sees them only from here (:class:`profiling.temporaries.FakeAllocationTracker`).

    Example:
        >>> g = torch.empty(4096, 768)
        >>> kernel_scratch_bytes(torch.ops.aten.sum.dim_IntList, (g, [0], True), {}, "h100") // 2**20
        24
        >>> kernel_scratch_bytes(torch.ops.aten.sum.dim_IntList, (g, [0], True), {}, "cpu")
        0
    """
    if not is_gpu_target(target) or str(func) not in _STAGED_REDUCTIONS:
        return 0
    x = args[0] if args else kwargs.get("self")
    if not isinstance(x, torch.Tensor) or x.numel() == 0 or x.is_complex():
        return 0
    dims = args[1] if len(args) > 1 else kwargs.get("dim")
    accumulator = 4 if x.dtype in (torch.float32, torch.float16, torch.bfloat16) else 8  # else double or int64
    return reduction_scratch_bytes(tuple(x.shape), tuple(x.stride()), dims, target, accumulator)


def sdpa_backend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any = None,
                 enable_gqa: bool = False) -> str:
    """The kernel CUDA's ``scaled_dot_product_attention`` picks on an sm80+ GPU: ``"flash"``,
    ``"efficient"`` or ``"math"``, in torch's default priority order.

    Flash takes float16/bfloat16, equal head sizes of at most 256 that are multiples of 8, and no
    mask; memory-efficient also takes float32 and a mask, with head sizes aligned to 8 elements
    (16 bytes) in half precision and 4 in float32, but not grouped-query heads nor a mask that
    requires grad (T5's learned position bias: the H100 ran math there, ``t5_gpu`` in
    ``tests/data/h100``); math takes anything. Dropout and ``is_causal`` are taken by
    all three.

    Example:
        >>> q = torch.empty(1, 2, 8, 64)
        >>> sdpa_backend(q, q, q), sdpa_backend(q.half(), q.half(), q.half())
        ('efficient', 'flash')
    """
    head_dims = {query.shape[-1], key.shape[-1], value.shape[-1]}
    dtype = query.dtype
    grouped = enable_gqa and query.dim() == 4 and key.shape[-3] != query.shape[-3]
    if (dtype in _FLASH_DTYPES and attn_mask is None and len(head_dims) == 1
            and query.shape[-1] <= FLASH_MAX_HEAD_DIM and query.shape[-1] % 8 == 0):
        return "flash"
    alignment = 4 if dtype == torch.float32 else 8
    mask_needs_grad = isinstance(attn_mask, torch.Tensor) and attn_mask.requires_grad
    if (dtype in _EFFICIENT_DTYPES and not grouped and query.dim() == 4 and not mask_needs_grad
            and all(d % alignment == 0 for d in head_dims)):
        return "efficient"
    return "math"


def _sdpa_args(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    bound = dict(zip(names, args))
    bound.update(kwargs)
    return {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False, **bound}


def _math_attention(a: dict[str, Any]) -> torch.Tensor:
    """CUDA's math path (``_scaled_dot_product_attention_math``), with CUDA's dropout: query
    and key each scaled by the square root of the scale (two new tensors), the probabilities and
    the dropped probabilities saved, with a one-byte dropout mask."""
    q, k, v = a["query"], a["key"], a["value"]
    scale = a["scale"] if a["scale"] is not None else 1.0 / math.sqrt(q.shape[-1])
    if a["enable_gqa"] and k.shape[-3] != q.shape[-3]:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
    root = math.sqrt(scale)
    scores = torch.matmul(q * root, k.transpose(-2, -1) * root)
    mask = a["attn_mask"]
    if a["is_causal"]:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        # in place, as CUDA adds it: the scores are no input any backward saves
        scores = scores.masked_fill_(~mask, float("-inf")) if mask.dtype == torch.bool else scores.add_(mask)
    probs = torch.softmax(scores, dim=-1)
    if a["dropout_p"] > 0:
        probs = aten.native_dropout.default(probs, a["dropout_p"], True)[0]
    return torch.matmul(probs, v)


def _attention(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    a = _sdpa_args(args, kwargs)
    q, k, v, mask = a["query"], a["key"], a["value"], a["attn_mask"]
    backend = sdpa_backend(q, k, v, mask, a["enable_gqa"])
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    if backend == "flash":
        return aten._scaled_dot_product_flash_attention.default(
            q, k, v, a["dropout_p"], a["is_causal"], needs_grad, scale=a["scale"])[0]
    if backend == "efficient":
        if mask is not None:
            if mask.dtype == torch.bool:
                # sdp_utils converts a boolean mask to an additive one of the query's dtype
                mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, float("-inf"))
            seq_k = k.shape[-2]
            if seq_k % 16:
                # the kernel reads the mask in 16-element rows: CUDA pads a copy and slices it back
                mask = torch.nn.functional.pad(mask, (0, 16 - seq_k % 16))[..., :seq_k]
            mask = mask.expand(q.shape[0], q.shape[1], q.shape[2], seq_k)
        return aten._scaled_dot_product_efficient_attention.default(
            q, k, v, mask, needs_grad, a["dropout_p"], a["is_causal"], scale=a["scale"])[0]
    return _math_attention(a)


def _dropout(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    """CUDA's fused dropout where CUDA takes it (training, 0 < p < 1); None elsewhere, where
    CUDA runs the same composite as the CPU."""
    a = {"p": 0.5, "train": True, **dict(zip(("input", "p", "train"), args)), **kwargs}
    train = a.get("training", a["train"])  # torch.nn.functional.dropout's name for it
    if not train or not 0.0 < float(a["p"]) < 1.0 or a["input"].numel() == 0:
        return None
    return aten.native_dropout.default(a["input"], float(a["p"]), True)[0]


class GpuKernels(TorchFunctionMode):
    """Calls attention and dropout as CUDA dispatches them (see the module docs), so autograd
    saves what it saves on a GPU; every other op runs as it is.

    Active around the forward of a fake-tensor profile for a GPU target
    (:func:`profiling.profile.profile_graph` with ``fake=True`` and a GPU ``target``).

    Example:
        >>> from torch._subclasses.fake_tensor import FakeTensorMode
        >>> with FakeTensorMode():
        ...     x = torch.randn(8, 8, requires_grad=True)
        ...     saved = []
        ...     hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t)
        ...     with GpuKernels(), hooks:
        ...         y = torch.ops.aten.dropout.default(x, 0.1, True)
        >>> [t.dtype for t in saved]
        [torch.bool]
    """

    _ATTENTION = (aten.scaled_dot_product_attention.default, torch._C._nn.scaled_dot_product_attention,
                  torch.nn.functional.scaled_dot_product_attention)
    _DROPOUT = (aten.dropout.default, torch.dropout, torch.nn.functional.dropout)

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func in self._ATTENTION:
            return _attention(args, kwargs)
        if func in self._DROPOUT and not kwargs.get("inplace", False):
            out = _dropout(args, kwargs)
            if out is not None:
                return out
        return func(*args, **kwargs)
