"""Load a saved model and build example inputs for it, for the command line.

Three kinds of PATH:

* a ``torch.export`` program saved with ``torch.export.save`` (``.pt2``): the graph is used as
  saved; example inputs come from the program or from ``--input-shape``;
* a HuggingFace ``save_pretrained`` directory (``config.json`` inside): the class named in
  ``config.architectures`` is built and loaded, inputs from ``batch_size``/``seq_len`` (token
  ids, with labels for language-model heads) or ``image_size`` (pixel values);
* a whole pickled ``nn.Module`` saved with ``torch.save``: unpickling runs code, so only with
  ``trust_pickle=True``; inputs from ``--input-shape``.

Every failure is a :class:`planner.PlannerError` with one line saying what to do.

Example:
    >>> [tuple(t.shape) for t in tensors_from_specs(["2x3:float32", "2:int64"])]
    [(2, 3), (2,)]
"""

from __future__ import annotations

import json
import logging
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.fx

from planner.errors import PlannerError
from profiling.measure import StepInputs

__all__ = ["LoadedModel", "load_model", "tensors_from_specs", "parse_input_spec"]

log = logging.getLogger(__name__)

_DTYPES = {
    name: getattr(torch, name)
    for name in ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool")
}


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
    generator = torch.Generator().manual_seed(seed)
    out = []
    for spec in specs:
        shape, dtype = parse_input_spec(spec)
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
        return _load_exported(path, input_shapes)
    return _load_pickle(path, input_shapes, trust_pickle)


def _load_exported(path: Path, input_shapes: list[str] | None) -> LoadedModel:
    if not zipfile.is_zipfile(path):
        raise PlannerError(f"{path} is not a torch.export archive (truncated or corrupt?); save it with torch.export.save")
    try:
        program = torch.export.load(str(path))
    except Exception as exc:  # the loader raises many kinds on a damaged archive
        raise PlannerError(f"{path} could not be loaded as a torch.export program: {type(exc).__name__}: "
                           f"{str(exc).splitlines()[0] if str(exc) else ''}") from exc
    if input_shapes:
        inputs = StepInputs(tuple(tensors_from_specs(input_shapes)), {})
    else:
        example = getattr(program, "example_inputs", None)
        if not example:
            raise PlannerError(f"{path} stores no example inputs; pass --input-shape for each input")
        args, kwargs = example
        inputs = StepInputs(tuple(args), dict(kwargs))
    # the graph keeps the mode it was exported in (export a model in train() mode to plan training)
    return LoadedModel(program.module(), inputs, "torch.export", path.name)


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
    except json.JSONDecodeError as exc:
        raise PlannerError(f"{config_file} is not valid JSON: {exc}") from None
    architectures = config_data.get("architectures") or []
    if not architectures or not hasattr(transformers, architectures[0]):
        raise PlannerError(f"{config_file} names no known architecture (architectures={architectures})")
    cls = getattr(transformers, architectures[0])
    try:
        model = cls.from_pretrained(str(path), use_cache=False) if "use_cache" in config_data else cls.from_pretrained(str(path))
    except Exception as exc:
        raise PlannerError(f"{path} could not be loaded with {cls.__name__}: {type(exc).__name__}: "
                           f"{str(exc).splitlines()[0] if str(exc) else ''}") from exc
    model.train()
    config = model.config
    if input_shapes:
        inputs = StepInputs(tuple(tensors_from_specs(input_shapes, int_high=getattr(config, "vocab_size", 100))), {})
    elif getattr(config, "vocab_size", None) and not image_size:
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(0, config.vocab_size, (batch_size, seq_len), generator=generator)
        kwargs: dict[str, Any] = {"input_ids": ids}
        if cls.__name__.endswith(("LMHeadModel", "ForCausalLM", "ForMaskedLM")):
            kwargs["labels"] = ids
        inputs = StepInputs((), kwargs)
    else:
        size = image_size or getattr(config, "image_size", 224)
        channels = getattr(config, "num_channels", 3)
        pixels = torch.randn(batch_size, channels, size, size, generator=torch.Generator().manual_seed(0))
        inputs = StepInputs((), {"pixel_values": pixels})
    return LoadedModel(model, inputs, "huggingface", path.name)
