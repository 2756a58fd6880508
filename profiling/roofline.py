"""Estimated op time from FLOPs and bytes moved, for planning without running on the device.

``time = max(flops / peak_flops, bytes_moved / bandwidth)``: a roofline that, unlike FLOPs
alone, charges pointwise ops for the memory traffic that dominates their cost. On a GPU target
the roofline is calibrated per op class (:func:`op_class`) against node times measured on an
H100 (:data:`GPU_CALIBRATION`): ``floor_ms + roofline / efficiency``, where ``floor_ms`` is
what the shortest node takes (a view) and ``efficiency`` the share of the datasheet's peak that
class reaches; :func:`calibrated_ms`.

Example:
    >>> round(estimate_ms(flops=2e12, bytes_moved=0, target="h100"), 3) > 0
    True
    >>> DEVICE_SPECS["h100"].memory_bytes / 2**30   # a budget_gb for planning on a CPU machine
    74.50580596923828
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.core.errors import PlannerError

__all__ = ["DeviceSpec", "DEVICE_SPECS", "estimate_ms", "Calibration", "GPU_CALIBRATION", "op_class",
           "calibrated_ms", "roofline_ms", "peak_flops_per_s"]


@dataclass(frozen=True)
class DeviceSpec:
    """Peak dense float32 FLOP/s (tensor-core TF32 where the device has it), memory bandwidth, and
    the device's memory in bytes (a natural ``budget_gb``: ``memory_bytes / 2**30``; 0 when not
    fixed); for a GPU also the dense float32 peak without tensor cores (torch's default for
    float32 matmuls) and the dense float16/bfloat16 tensor-core peak (0: ``flops_per_s``), and
    its streaming multiprocessors and the most threads one of them runs at once (CUDA's
    ``multiProcessorCount`` and ``maxThreadsPerMultiProcessor``), which size the scratch buffer of
    a reduction kernel (:func:`profiling.gpu_rules.reduction_scratch_bytes`; 0 on the CPU)."""

    flops_per_s: float
    bytes_per_s: float
    memory_bytes: int = 0
    fp32_flops_per_s: float = 0.0
    half_flops_per_s: float = 0.0
    sm_count: int = 0
    max_threads_per_sm: int = 0


# Public datasheet figures (SXM parts; SM counts and threads per SM from the CUDA programming
# guide's compute-capability tables: 1,536 on sm_89, 2,048 on sm_80 and sm_90); "cpu" is a
# modest 2-core machine.
DEVICE_SPECS: dict[str, DeviceSpec] = {
    "cpu": DeviceSpec(flops_per_s=1.0e11, bytes_per_s=2.0e10),
    "l4": DeviceSpec(flops_per_s=60e12, bytes_per_s=0.3e12, memory_bytes=24 * 10**9,
                     fp32_flops_per_s=30.3e12, half_flops_per_s=121e12, sm_count=58, max_threads_per_sm=1536),
    "a100": DeviceSpec(flops_per_s=156e12, bytes_per_s=1.555e12, memory_bytes=40 * 10**9,
                       fp32_flops_per_s=19.5e12, half_flops_per_s=312e12, sm_count=108, max_threads_per_sm=2048),
    "a100-80gb": DeviceSpec(flops_per_s=156e12, bytes_per_s=2.039e12, memory_bytes=80 * 10**9,
                            fp32_flops_per_s=19.5e12, half_flops_per_s=312e12, sm_count=108,
                            max_threads_per_sm=2048),
    "h100": DeviceSpec(flops_per_s=494e12, bytes_per_s=3.35e12, memory_bytes=80 * 10**9,
                       fp32_flops_per_s=67e12, half_flops_per_s=989e12, sm_count=132, max_threads_per_sm=2048),
    "h200": DeviceSpec(flops_per_s=494e12, bytes_per_s=4.8e12, memory_bytes=141 * 10**9,
                       fp32_flops_per_s=67e12, half_flops_per_s=989e12, sm_count=132, max_threads_per_sm=2048),
}


def estimate_ms(flops: float, bytes_moved: float, target: str = "cpu") -> float:
    """Roofline time of one op on ``target`` (a key of :data:`DEVICE_SPECS`), in milliseconds.

    Example:
        >>> estimate_ms(flops=0, bytes_moved=3.35e9, target="h100")   # 1 ms of HBM traffic
        1.0
    """
    spec = DEVICE_SPECS.get(target.lower())
    if spec is None:
        raise PlannerError(f"unknown target device {target!r}; use one of {sorted(DEVICE_SPECS)}")
    return 1e3 * max(flops / spec.flops_per_s, bytes_moved / spec.bytes_per_s)


#: ops whose time is their FLOPs on the tensor cores
MATMUL_OPS = ("addmm", "mm.", "bmm", "linear", "matmul", "baddbmm", "addbmm", "einsum", "convolution", "conv")
ATTENTION_OPS = ("scaled_dot_product",)
#: memory-bound ops that read their input more than once (statistics, then normalisation)
NORMALIZATION_OPS = ("layer_norm", "softmax", "cross_entropy", "nll_loss", "batch_norm", "group_norm", "rms_norm",
                     "mean", "sum", "var", "std", "norm")


def op_class(op: str, is_view: bool = False) -> str:
    """The calibration class of an op: ``"view"`` (an output aliasing an input: no kernel),
    ``"matmul"``, ``"attention"``, ``"normalization"`` or ``"pointwise"`` (everything else).

    Example:
        >>> op_class("aten.addmm.default"), op_class("aten.gelu.default"), op_class("aten.view.default", True)
        ('matmul', 'pointwise', 'view')
    """
    if is_view:
        return "view"
    name = op.removeprefix("aten.")
    if any(word in name for word in ATTENTION_OPS):
        return "attention"
    if any(name.startswith(word) or f"_{word}" in name for word in MATMUL_OPS):
        return "matmul"
    if any(word in name for word in NORMALIZATION_OPS):
        return "normalization"
    return "pointwise"


@dataclass(frozen=True)
class Calibration:
    """What a device's measured node times add to the roofline: ``floor_ms``, the time of a node
    that moves nothing (a view, as the profiler times it), and per op class the share of the
    datasheet's peak reached (:func:`calibrated_ms`)."""

    floor_ms: float
    efficiency: dict[str, float]


#: Fitted by ``python benchmarks/target_accuracy.py --fit`` on the measured H100 profiles
#: gpt2_gpu, bert_gpu and mlp_gpu (float32, torch's default of no TF32 in matmuls, so against
#: the CUDA cores' float32 peak); tested on the other three (docs/tuning.md#gpu_calibration).
#: Used for every GPU target and dtype: only float32 on the H100 was measured.
GPU_CALIBRATION = Calibration(
    floor_ms=0.0013,
    efficiency={"view": 1.0, "matmul": 0.70, "attention": 0.53, "normalization": 0.31, "pointwise": 0.91},
)


def peak_flops_per_s(target: str, klass: str, dtype: str = "float32", tf32: bool = False) -> float:
    """The datasheet peak an op of class ``klass`` in ``dtype`` runs against on GPU ``target``:
    float16/bfloat16 on the tensor cores; float32 matmuls on them as TF32 only when torch allows
    it (``torch.set_float32_matmul_precision("high")``), else, as float32 attention always, on
    the CUDA cores.

    Example:
        >>> [peak_flops_per_s("h100", "matmul", dtype, tf32) / 1e12
        ...  for dtype, tf32 in (("bfloat16", False), ("float32", True), ("float32", False))]
        [989.0, 494.0, 67.0]
    """
    spec = DEVICE_SPECS[target.lower()]
    if dtype in ("float16", "bfloat16") and spec.half_flops_per_s:
        return spec.half_flops_per_s
    if dtype == "float32" and not (tf32 and klass == "matmul") and spec.fp32_flops_per_s:
        return spec.fp32_flops_per_s
    return spec.flops_per_s


def calibrated_ms(flops: float, bytes_moved: float, target: str, klass: str, dtype: str = "float32",
                  tf32: bool = False) -> float:
    """Time of one op of class ``klass`` (:func:`op_class`) in ``dtype`` on ``target``: the plain
    roofline on ``"cpu"``; on a GPU the calibrated one, ``floor_ms + roofline / efficiency``
    (:data:`GPU_CALIBRATION`), the FLOPs against :func:`peak_flops_per_s`; a view costs the
    floor alone.

    Example:
        >>> calibrated_ms(0, 0, "h100", "view") == GPU_CALIBRATION.floor_ms
        True
        >>> calibrated_ms(2e12, 0, "cpu", "matmul") == estimate_ms(2e12, 0, "cpu")
        True
    """
    if target.lower() == "cpu":
        return estimate_ms(flops, bytes_moved, target)
    if klass == "view":
        return GPU_CALIBRATION.floor_ms
    return GPU_CALIBRATION.floor_ms + roofline_ms(flops, bytes_moved, target, klass, dtype, tf32) \
        / GPU_CALIBRATION.efficiency[klass]


def roofline_ms(flops: float, bytes_moved: float, target: str, klass: str, dtype: str = "float32",
                tf32: bool = False) -> float:
    """The uncalibrated roofline of one op on GPU ``target``, FLOPs against
    :func:`peak_flops_per_s`, in milliseconds.

    Example:
        >>> roofline_ms(67e9, 0, "h100", "matmul")   # float32 on the CUDA cores: 1 ms
        1.0
    """
    estimate_ms(0, 0, target)  # an unknown target raises
    spec = DEVICE_SPECS[target.lower()]
    return 1e3 * max(flops / peak_flops_per_s(target, klass, dtype, tf32), bytes_moved / spec.bytes_per_s)
