"""Helpers the benchmark scripts share: interleaved step timing, checkpoint-every-k-th-layer
baselines, moving a model and its inputs to a device, and publishing tables (to the results
folder, and with ``--docs`` to the script's page under ``docs/benchmarks/``, see
:mod:`publish`).

Step time is a ratio to a reference step, measured in one process with the modules' steps
interleaved (each repeat runs every module once, in order) and reported as the median of the
per-repeat ratios: on a shared machine single timings swing by 10 % or more. On CUDA each step
is timed with CUDA events; on CPU with ``time.perf_counter``.

Example:
    >>> import torch
    >>> from profiling import StepInputs
    >>> model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
    ...                               for _ in range(4)])
    >>> every = checkpoint_every_k(model, 1)
    >>> inputs = StepInputs.from_example((torch.randn(4, 8),))
    >>> ratios = step_time_ratios([model, every], inputs, repeats=2)
    >>> ratios[0]
    1.0
"""

from __future__ import annotations

import argparse
import copy
import functools
import logging
import os
import statistics
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils._pytree import tree_map

ROOT = Path(__file__).resolve().parents[1]
#: the profiles measured on an NVIDIA H100, kept with the tests (their README says how)
H100_PROFILES = ROOT / "tests" / "data" / "h100"
for _path in (ROOT, ROOT / "examples"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from profiling import StepInputs, TrainingStep, run_step  # noqa: E402
from publish import DOCS_DIR, command_line, publish_doc, tee_stdout  # noqa: E402

__all__ = [
    "MIB",
    "add_docs_argument",
    "benchmark_logging",
    "DOCS_DIR",
    "GIB",
    "H100_PROFILES",
    "ROOT",
    "checkpoint_every_k",
    "SAVED_MATMUL_ATEN_OPS",
    "command_line",
    "find_layers",
    "publish_doc",
    "publish_table",
    "step_seconds",
    "step_time_ratios",
    "tee_stdout",
    "to_device",
]

MIB = 2**20
GIB = 2**30


def _zero_grads(module: torch.nn.Module) -> None:
    module.zero_grad(set_to_none=True)


def step_seconds(module: torch.nn.Module, inputs: StepInputs, device: torch.device,
                 step: TrainingStep = TrainingStep()) -> float:
    """Wall time of one forward plus backward as ``step`` runs it (the output's loss by default;
    gradients cleared first, not timed)."""
    _zero_grads(module)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        output = run_step(module, inputs, step)
        end.record()
        torch.cuda.synchronize(device)
        del output
        return start.elapsed_time(end) / 1000.0
    t0 = time.perf_counter()
    output = run_step(module, inputs, step)
    elapsed_s = time.perf_counter() - t0
    del output
    return elapsed_s


def step_time_ratios(modules: Sequence[torch.nn.Module], inputs: StepInputs, repeats: int,
                     device: torch.device | str = "cpu", warmup: int = 1,
                     step: TrainingStep = TrainingStep(), steps_per_sample: int = 1) -> list[float]:
    """Median over ``repeats`` of each module's step time divided by ``modules[0]``'s.

    Every repeat runs each module's step once (interleaved), so slow phases of a shared machine
    hit all modules alike; repeat ``r`` starts at module ``r % len(modules)`` and goes round, so
    no module always runs after the same neighbour (whose freed memory and cold caches the next
    step inherits: docs/tuning.md#rotated-timing). ``warmup`` untimed rounds run first.
    Gradients are cleared before each step and after the last. ``step`` is the training step
    timed (a criterion outside the model: ``TrainingStep(loss_fn=...)``). Each timed sample is
    ``steps_per_sample`` steps of one module in a row: one step of a few milliseconds swings by
    10 % or more, a longer sample less.
    """
    device = torch.device(device)
    for _ in range(warmup):
        for module in modules:
            step_seconds(module, inputs, device, step)
    ratios: list[list[float]] = [[] for _ in modules]
    count = len(modules)
    for r in range(repeats):
        times_s = [0.0] * count
        for k in range(count):
            i = (r + k) % count
            times_s[i] = sum(step_seconds(modules[i], inputs, device, step) for _ in range(steps_per_sample))
        for i, t in enumerate(times_s):
            ratios[i].append(t / times_s[0])
    for module in modules:
        _zero_grads(module)
    return [statistics.median(r) for r in ratios]


def find_layers(model: torch.nn.Module) -> tuple[str, list[torch.nn.Module]]:
    """The model's repeated layers: the ``ModuleList``/``Sequential`` of two or more modules of one
    class holding the most parameters (GPT-2's ``transformer.h``, Llama's ``model.layers``, BERT's
    and ViT's ``encoder.layer``, the residual MLP's and CNN's ``blocks``). Returns its name too.

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ModuleList(
        ...     [torch.nn.Linear(2, 2) for _ in range(3)]))
        >>> name, layers = find_layers(model)
        >>> name, len(layers)
        ('1', 3)
    """
    best: tuple[int, str, list[torch.nn.Module]] | None = None
    for name, module in model.named_modules():
        if not isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential)):
            continue
        children = list(module.children())
        if len(children) < 2 or len({type(c) for c in children}) != 1:
            continue
        params = sum(p.numel() for p in module.parameters())
        if params and (best is None or params > best[0]):
            best = (params, name, children)
    if best is None:
        raise ValueError(f"{type(model).__name__} has no list of repeated layers to checkpoint")
    return best[1], best[2]


def _checkpointed_forward(forward: Any, *args: Any, **kwargs: Any) -> Any:
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)


#: What the save-matmuls policy of torchtitan and Megatron keeps inside a checkpointed layer:
#: matmul and attention outputs; everything else is recomputed.
SAVED_MATMUL_ATEN_OPS = (
    "mm", "addmm", "bmm", "baddbmm", "linear", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_cudnn_attention",
)


def _save_matmuls_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    from torch.utils.checkpoint import CheckpointPolicy

    name = getattr(op, "__name__", "").split(".")[0]
    return CheckpointPolicy.MUST_SAVE if name in SAVED_MATMUL_ATEN_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _save_matmuls_forward(forward: Any, *args: Any, **kwargs: Any) -> Any:
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return torch.utils.checkpoint.checkpoint(
        forward, *args, use_reentrant=False, preserve_rng_state=True,
        context_fn=functools.partial(create_selective_checkpoint_contexts, _save_matmuls_policy), **kwargs)


def checkpoint_every_k(model: torch.nn.Module, k: int, save_matmuls: bool = False) -> torch.nn.Module:
    """A deep copy of ``model`` whose layers 0, k, 2k, ... (see :func:`find_layers`) each run under
    ``torch.utils.checkpoint`` (non-reentrant, RNG state preserved); ``k=1`` is checkpoint-every-layer,
    what HuggingFace's ``gradient_checkpointing_enable()`` does. The copy's weights equal the model's.

    Each chosen layer's ``forward`` is replaced on the instance, so everything that calls the layer
    (keyword arguments included) goes through the checkpoint. ``save_matmuls`` keeps the matmul
    and attention outputs of each checkpointed layer (:data:`SAVED_MATMUL_ATEN_OPS`, PyTorch's
    selective checkpoint contexts) and recomputes the rest: the hand-written selective policy of
    torchtitan and Megatron. Naive checkpointing runs a
    training-mode BatchNorm inside such a layer twice per step (its running statistics are
    updated again on recompute).
    """
    if k < 1:
        raise ValueError(f"k must be at least 1, got {k}")
    wrapped = copy.deepcopy(model)
    _, layers = find_layers(wrapped)
    for index, layer in enumerate(layers):
        if index % k == 0:
            wrapper = _save_matmuls_forward if save_matmuls else _checkpointed_forward
            layer.forward = functools.partial(wrapper, layer.forward)  # type: ignore[method-assign]
    return wrapped.train(model.training)


def to_device(model: torch.nn.Module, example: Any, device: torch.device | str) -> tuple[torch.nn.Module, Any]:
    """``model`` moved to ``device`` (in place) and a copy of ``example`` with its tensors moved."""
    device = torch.device(device)
    model.to(device)
    return model, tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, example)


def add_output_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the options every table benchmark takes: ``--threads`` (CPU intra-op threads while
    profiling), ``--out`` (the results folder) and ``--docs``."""
    parser.add_argument("--threads", type=int, default=1, help="CPU intra-op threads while profiling")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    add_docs_argument(parser)
    return parser


def add_docs_argument(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``--docs``: also write the tables to the script's page under ``docs/benchmarks/``."""
    parser.add_argument("--docs", action="store_true",
                        help="also write the tables to the script's page under docs/benchmarks/ "
                             "(with this command line and today's date)")
    return parser


def table_arguments(description: str, models: Sequence[str]) -> argparse.ArgumentParser:
    """The options every per-model table benchmark takes: ``--models`` and
    :func:`add_output_arguments`'s."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--models", nargs="*", choices=list(models), default=list(models))
    return add_output_arguments(parser)


def publish_table(text: str, out_dir: Path, file_name: str, doc: dict[str, str] | None = None) -> None:
    """Write a benchmark's markdown ``text`` to ``out_dir / file_name`` and stdout, and, given
    ``doc`` (``name``, ``title`` and ``about`` of :func:`publish.publish_doc`), to the
    script's page ``docs/benchmarks/<name>.md`` under this process's command line and today's date."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / file_name).write_text(text)
    sys.stdout.write(text)
    if doc is not None:
        publish_doc(text, doc["name"], sys.argv, title=doc["title"], about=doc.get("about", ""))


def isolated_profile_cache() -> Path:
    """Point ``optimize``'s default profile cache (``cache_dir="auto"``) at a new empty folder for
    this process and its children, removed at exit: a benchmark's first call of each model
    profiles, as a first run on a machine does, whatever earlier runs left in the user's cache."""
    import atexit
    import shutil
    import tempfile

    from profiling.cache import CACHE_DIR_ENV

    folder = tempfile.mkdtemp(prefix="benchmark-profiles-")
    os.environ[CACHE_DIR_ENV] = folder
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return Path(folder)


def benchmark_logging() -> None:
    """INFO lines with times from the benchmark scripts; only warnings from the library."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", datefmt="%H:%M:%S")
    for noisy in ("profiling", "planner", "rewrite", "torch"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*global hooks on modules.*")
