"""Load a saved model and build example inputs for it, for the command line.

Three kinds of PATH:

* a ``torch.export`` program saved with ``torch.export.save`` (``.pt2``): the graph is used as
  saved; example inputs come from the program or from ``--input-shape``;
* a HuggingFace ``save_pretrained`` directory (``config.json`` inside): the class named in
  ``config.architectures`` is built and loaded, inputs from ``batch_size``/``seq_len`` (token
  ids, with labels for language-model heads) or ``image_size`` (pixel values);
* a whole pickled ``nn.Module`` saved with ``torch.save``: unpickling runs code, so only with
  ``trust_pickle=True``; inputs from ``--input-shape``. A ``torch.save`` file named ``.pt2`` is
  recognised as one.

Every failure is a :class:`planner.PlannerError` with one line saying what to do.

Example:
    >>> [tuple(t.shape) for t in tensors_from_specs(["2x3:float32", "2:int64"])]
    [(2, 3), (2,)]
"""

from __future__ import annotations

import json
import logging
import math
import os
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.fx

from planner.core.errors import PlannerError
from profiling.measure import StepInputs
from planner.core.units import GIB

__all__ = ["LoadedModel", "load_model", "tensors_from_specs", "parse_input_spec"]

log = logging.getLogger(__name__)

_DTYPES = {
    name: getattr(torch, name)
    for name in ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool")
}
_DTYPE_NAMES = {dtype: name for name, dtype in _DTYPES.items()}

#: config.json keys holding the longest sequence a HuggingFace model's position embeddings cover
_POSITION_LIMIT_KEYS = ("max_position_embeddings", "n_positions")

#: example inputs may take at most this share of the machine's memory: they are allocated for
#: real before profiling, and a step needs several times their size on top
_INPUT_MEMORY_SHARE = 0.5


@dataclass
class LoadedModel:
    """A module to plan for (a captured GraphModule for .pt2 files) and its example inputs."""

    module: torch.nn.Module
    inputs: StepInputs
    kind: str
    name: str


def parse_input_spec(spec: str) -> tuple[tuple[int, ...], torch.dtype]:
    """``"2x3x224x224:float32"`` → ``((2, 3, 224, 224), torch.float32)``; dtype defaults to float32."""
    shape_text, _, dtype_text = spec.partition(":")
    dtype_text = dtype_text or "float32"
    if dtype_text not in _DTYPES:
        raise PlannerError(f"input spec {spec!r}: unknown dtype {dtype_text!r}; use one of {sorted(_DTYPES)}")
    try:
        shape = tuple(int(part) for part in shape_text.lower().split("x"))
    except ValueError:
        raise PlannerError(f"input spec {spec!r}: shape must look like 2x3x224x224") from None
    if not shape or any(d <= 0 for d in shape):
        raise PlannerError(f"input spec {spec!r}: every dimension must be a positive integer")
    return shape, _DTYPES[dtype_text]


def tensors_from_specs(specs: list[str], int_high: int = 100, seed: int = 0) -> list[torch.Tensor]:
    """Random tensors for ``--input-shape`` specs (integers drawn below ``int_high``)."""
    parsed = [parse_input_spec(spec) for spec in specs]
    _check_fits_in_memory([(shape, dtype) for shape, dtype in parsed], "the --input-shape inputs")
    generator = torch.Generator().manual_seed(seed)
    out = []
    for shape, dtype in parsed:
        if dtype.is_floating_point:
            out.append(torch.randn(shape, generator=generator).to(dtype))
        elif dtype == torch.bool:
            out.append(torch.randint(0, 2, shape, generator=generator).bool())
        else:
            out.append(torch.randint(0, int_high, shape, generator=generator, dtype=dtype))
    return out


def load_model(
    path: str | Path,
    *,
    input_shapes: list[str] | None = None,
    batch_size: int = 1,
    seq_len: int = 128,
    image_size: int | None = None,
    trust_pickle: bool = False,
) -> LoadedModel:
    """Load PATH as one of the three supported kinds and build its example inputs."""
    path = Path(path)
    if not path.exists():
        raise PlannerError(f"{path} does not exist")
    if path.is_dir():
        return _load_huggingface(path, input_shapes, batch_size, seq_len, image_size)
    if path.suffix == ".pt2":
        if _is_torch_save_archive(path):
            if trust_pickle:
                return _load_pickle(path, input_shapes, trust_pickle)
            raise PlannerError(
                f"{path} is not a torch.export program: it was written by torch.save; if it holds a whole "
                f"nn.Module, pass --trust-pickle (unpickling runs code from the file) with --input-shape, "
                f"or save the model with torch.export.save"
            )
        return _load_exported(path, input_shapes)
    return _load_pickle(path, input_shapes, trust_pickle)


def _is_torch_save_archive(path: Path) -> bool:
    """A zip written by ``torch.save`` (a ``data.pkl`` record) rather than ``torch.export.save``
    (an ``archive_format`` record): both are zip files, and both are often named ``.pt2``."""
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
    except (zipfile.BadZipFile, OSError):
        return False
    records = {name.rsplit("/", 1)[-1] for name in names}
    return "data.pkl" in records and "archive_format" not in records


class _RecordCollector(logging.Filter):
    """Keeps the records a logger emits and drops them, so they are not printed."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        self.records.append(record)
        return False


@contextmanager
def _quiet_logger(name: str) -> Iterator[list[logging.LogRecord]]:
    """Hold back what logger ``name`` emits inside the block and yield the records:
    ``torch.export.load`` logs a whole traceback as a warning before it fails on a damaged
    archive, and the command line says what went wrong in one line instead."""
    logger = logging.getLogger(name)
    collector = _RecordCollector()
    logger.addFilter(collector)
    try:
        yield collector.records
    finally:
        logger.removeFilter(collector)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def _logged_cause(records: list[logging.LogRecord]) -> str:
    """The first line of the exception a held-back record carried, or ''."""
    for record in records:
        if record.exc_info and record.exc_info[1] is not None:
            return _first_line(record.exc_info[1])
    return ""


def _load_exported(path: Path, input_shapes: list[str] | None) -> LoadedModel:
    if not zipfile.is_zipfile(path):
        raise PlannerError(f"{path} is not a torch.export archive (truncated or corrupt?); save it with torch.export.save")
    with _quiet_logger("torch.export") as records:
        try:
            program = torch.export.load(str(path))
        except Exception as exc:  # the loader raises many kinds on a damaged archive
            # the loader's own message points at warnings that were held back: name their cause
            cause = _logged_cause(records) or _first_line(exc)
            if "warnings above" in cause:  # nothing was logged: the archive has no program in it
                cause = "no exported program found in the archive"
            raise PlannerError(f"{path} could not be loaded as a torch.export program ({cause}); "
                               f"save it again with torch.export.save") from exc
    if input_shapes:
        _check_input_specs_fit(path, program, input_shapes)
        inputs = StepInputs(tuple(tensors_from_specs(input_shapes)), {})
    else:
        example = getattr(program, "example_inputs", None)
        if not example:
            raise PlannerError(f"{path} stores no example inputs; pass --input-shape for each input")
        args, kwargs = example
        inputs = StepInputs(tuple(args), dict(kwargs))
    # the graph keeps the mode it was exported in (export a model in train() mode to plan training)
    return LoadedModel(program.module(), inputs, "torch.export", path.name)


@dataclass(frozen=True)
class _ExpectedInput:
    """One input of an exported program: its name, and the shape and dtype it was exported for
    (``dims`` holds an int for a static dimension, ``(low, high)`` for a dynamic one, ``high``
    None when unbounded, or None when its range is not known)."""

    name: str
    dims: tuple[int | tuple[int, int | None] | None, ...]
    dtype: torch.dtype

    def describe(self) -> str:
        parts = []
        for dim in self.dims:
            if isinstance(dim, int):
                parts.append(str(dim))
            elif dim is None:
                parts.append("[any]")
            else:
                parts.append(f"[{dim[0]}..{'' if dim[1] is None else dim[1]}]")
        return "x".join(parts) + f":{_DTYPE_NAMES.get(self.dtype, str(self.dtype))}"

    def example(self, wanted: tuple[int, ...] = ()) -> str:
        """An ``--input-shape`` this input accepts: the sizes of ``wanted`` where they fit, the
        smallest size of each other dynamic dimension."""
        sizes = []
        for k, dim in enumerate(self.dims):
            if len(wanted) == len(self.dims) and _size_fits(wanted[k], dim):
                sizes.append(wanted[k])
            else:
                sizes.append(dim if isinstance(dim, int) else (2 if dim is None else max(dim[0], 1)))
        return "x".join(map(str, sizes)) + f":{_DTYPE_NAMES.get(self.dtype, str(self.dtype))}"

    def accepts(self, shape: tuple[int, ...], dtype: torch.dtype) -> bool:
        return (dtype == self.dtype and len(shape) == len(self.dims)
                and all(_size_fits(size, dim) for size, dim in zip(shape, self.dims)))


def _size_fits(size: int, dim: int | tuple[int, int | None] | None) -> bool:
    if isinstance(dim, int):
        return size == dim
    return dim is None or (dim[0] <= size and (dim[1] is None or size <= dim[1]))


def _spec_children(spec: Any) -> list[Any]:
    children = getattr(spec, "children", None)  # newer torch: a method; older: children_specs
    return list(children()) if callable(children) else list(spec.children_specs)


def _dim_range(dim: Any, program: Any) -> int | tuple[int, int | None] | None:
    if isinstance(dim, int):
        return dim
    value_range = program.range_constraints.get(dim.node.expr)
    if value_range is None:  # a derived dimension (e.g. 2 * s0): its range is not stored
        return None
    try:
        high: int | None = int(value_range.upper)
    except (TypeError, ValueError, OverflowError):  # unbounded above
        high = None
    return int(value_range.lower), high


def _expected_inputs(program: Any) -> list[_ExpectedInput] | None:
    """The program's inputs, in call order, when they are positional tensors only (what
    ``--input-shape`` can give); None for keyword, nested or non-tensor inputs."""
    in_spec = program.call_spec.in_spec
    if in_spec is None:  # no call signature stored: nothing to compare with
        return None
    args_spec, kwargs_spec = _spec_children(in_spec)
    if _spec_children(kwargs_spec) or not all(child.is_leaf() for child in _spec_children(args_spec)):
        return None
    placeholders = {node.name: node for node in program.graph.nodes if node.op == "placeholder"}
    expected = []
    for name in program.graph_signature.user_inputs:
        value = placeholders[name].meta.get("val") if name in placeholders else None
        if not isinstance(value, torch.Tensor):
            return None
        expected.append(_ExpectedInput(name, tuple(_dim_range(d, program) for d in value.shape), value.dtype))
    return expected


def _check_input_specs_fit(path: Path, program: Any, input_shapes: list[str]) -> None:
    """Refuse ``--input-shape`` values the exported program would reject at its first call (its
    guards check the number of inputs, their shapes and dtypes), naming what it takes."""
    expected = _expected_inputs(program)
    if expected is None:
        raise PlannerError(f"{path} takes keyword, nested or non-tensor inputs, which --input-shape cannot give; "
                           f"leave out --input-shape to plan with the example inputs stored in the program")
    takes = ", ".join(f"{e.name} {e.describe()}" for e in expected)
    if len(input_shapes) != len(expected):
        what = f"{len(expected)} input{'s' if len(expected) != 1 else ''}"
        raise PlannerError(
            f"{path} takes {what} ({takes}), got {len(input_shapes)} --input-shape; pass --input-shape once "
            f"per input, in order, e.g. {' '.join('--input-shape ' + e.example() for e in expected)}"
        )
    for spec, want in zip(input_shapes, expected):
        shape, dtype = parse_input_spec(spec)
        if not want.accepts(shape, dtype):
            ranges = " ([a..b]: any size from a to b)" if not all(isinstance(d, int) for d in want.dims) else ""
            raise PlannerError(
                f"--input-shape {spec} does not fit input {want.name} of {path}, exported as {want.describe()}"
                f"{ranges}; pass --input-shape {want.example(shape)}, or export the model again with "
                f"torch.export.Dim for the dimensions that vary"
            )


def _check_fits_in_memory(tensors: list[tuple[tuple[int, ...], torch.dtype]], what: str) -> None:
    """Refuse example inputs that could not even be allocated for profiling, before allocating them."""
    total = sum(math.prod(shape) * dtype.itemsize for shape, dtype in tensors)
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # not a POSIX system: nothing to compare with
        return
    if total > memory * _INPUT_MEMORY_SHARE:
        raise PlannerError(
            f"{what} take {total / GIB:.4g} GiB, more than {_INPUT_MEMORY_SHARE:.0%} of this machine's "
            f"{memory / GIB:.4g} GiB: profiling runs a step on them; use a smaller batch (--target plans "
            f"another device, but still builds the inputs here)"
        )


def _load_pickle(path: Path, input_shapes: list[str] | None, trust_pickle: bool) -> LoadedModel:
    if not trust_pickle:
        raise PlannerError(
            f"{path} would be unpickled, which runs code from the file; pass --trust-pickle if you trust it, "
            f"or save the model with torch.export.save as .pt2"
        )
    if not input_shapes:
        raise PlannerError(f"{path}: a pickled module carries no inputs; pass --input-shape for each input")
    try:
        module = torch.load(str(path), weights_only=False, map_location="cpu")
    except Exception as exc:
        hint = " (the module's class must be importable: add its package to PYTHONPATH)" if isinstance(
            exc, (ImportError, AttributeError)) else ""
        raise PlannerError(f"{path} could not be unpickled: {type(exc).__name__}: "
                           f"{str(exc).splitlines()[0] if str(exc) else ''}{hint}") from exc
    if not isinstance(module, torch.nn.Module):
        raise PlannerError(f"{path} holds a {type(module).__name__}, not an nn.Module; save the whole module "
                           f"with torch.save(model, path)")
    module.train()
    return LoadedModel(module, StepInputs(tuple(tensors_from_specs(input_shapes)), {}), "pickle", path.name)


def _load_huggingface(
    path: Path, input_shapes: list[str] | None, batch_size: int, seq_len: int, image_size: int | None
) -> LoadedModel:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise PlannerError(f"{path} is a directory without config.json; give a save_pretrained directory, "
                           f"a .pt2 file or a pickled module")
    try:
        import transformers
    except ImportError:
        raise PlannerError("loading a HuggingFace directory needs transformers: pip install transformers") from None
    try:
        config_data = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise PlannerError(f"{config_file} is not valid JSON: {exc}") from None
    if not isinstance(config_data, dict):
        raise PlannerError(f"{config_file} holds a JSON {type(config_data).__name__}, not an object of settings; "
                           f"give a save_pretrained directory")
    architectures = config_data.get("architectures") or []
    if not isinstance(architectures, list) or not architectures or not isinstance(architectures[0], str) \
            or not hasattr(transformers, architectures[0]):
        raise PlannerError(f"{config_file} names no known architecture (architectures={architectures!r}); "
                           f"give a save_pretrained directory of a transformers model")
    if not input_shapes and config_data.get("vocab_size") and not image_size:  # token ids of --seq-len
        _check_sequence_length(config_file, config_data, seq_len)
    cls = getattr(transformers, architectures[0])
    try:
        with _quiet_transformers():
            model = (cls.from_pretrained(str(path), use_cache=False) if "use_cache" in config_data
                     else cls.from_pretrained(str(path)))
    except Exception as exc:
        raise PlannerError(f"{path} could not be loaded with {cls.__name__}: {type(exc).__name__}: "
                           f"{str(exc).splitlines()[0] if str(exc) else ''}") from exc
    model.train()
    config = model.config
    if input_shapes:
        inputs = StepInputs(tuple(tensors_from_specs(input_shapes, int_high=getattr(config, "vocab_size", 100))), {})
    elif getattr(config, "vocab_size", None) and not image_size:
        _check_fits_in_memory([((batch_size, seq_len), torch.int64)], "the token ids (--batch-size x --seq-len)")
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(0, config.vocab_size, (batch_size, seq_len), generator=generator)
        kwargs: dict[str, Any] = {"input_ids": ids}
        if cls.__name__.endswith(("LMHeadModel", "ForCausalLM", "ForMaskedLM")):
            kwargs["labels"] = ids
        inputs = StepInputs((), kwargs)
    else:
        size = image_size or getattr(config, "image_size", 224)
        channels = getattr(config, "num_channels", 3)
        _check_fits_in_memory([((batch_size, channels, size, size), torch.float32)],
                              "the pixel values (--batch-size x channels x --image-size squared)")
        pixels = torch.randn(batch_size, channels, size, size, generator=torch.Generator().manual_seed(0))
        inputs = StepInputs((), {"pixel_values": pixels})
    return LoadedModel(model, inputs, "huggingface", path.name)


def _check_sequence_length(config_file: Path, config_data: dict[str, Any], seq_len: int) -> None:
    """Refuse a ``--seq-len`` beyond the model's position embeddings before building the model
    (past it the embedding lookup fails with an IndexError deep inside the first step)."""
    for key in _POSITION_LIMIT_KEYS:
        limit = config_data.get(key)
        if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0:
            if seq_len > limit:
                raise PlannerError(f"--seq-len {seq_len} is longer than the model's position limit of {limit} "
                                   f"tokens ({key} in {config_file}); pass --seq-len {limit} or less")
            return


@contextmanager
def _quiet_transformers() -> Iterator[None]:
    """No progress bars or load warnings from transformers while the model loads: a command
    that then fails prints one line, and one that succeeds prints its report."""
    from transformers.utils import logging as transformers_logging

    verbosity = transformers_logging.get_verbosity()
    bars = transformers_logging.is_progress_bar_enabled()
    transformers_logging.set_verbosity_error()
    transformers_logging.disable_progress_bar()
    try:
        yield
    finally:
        transformers_logging.set_verbosity(verbosity)
        if bars:
            transformers_logging.enable_progress_bar()
