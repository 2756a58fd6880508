"""Profile cache: a profiled :class:`CostGraph` stored as JSON, keyed by a fingerprint.

Planning another budget for the same model needs the same profile, not a new one. The fingerprint
is a SHA-256 of what decides the profile: the captured graph's code, the shapes, dtypes, devices
and ``requires_grad`` of its parameters, buffers and example inputs, the modes it runs under
(autocast, CUDA's attention kernels), the machine that measures it (processor and thread count, or
the GPU), the torch version, the profiling mode (measured or fake) and the target device of the
roofline, and the fields of the profile's record types (so a new field never reads an old file).
The file ``<cache_dir>/<fingerprint>.json`` holds every node and storage exactly (plain JSON:
integers stay integers, floats round-trip).

A cached profile is also what keeps plans the same from run to run: node times measured again
move by 10 % or more on a CPU, enough to swap plans whose predicted times are that close
(docs/benchmarks/plan_stability.md), while the same profile solved again gives the same plan.
``cache_dir="auto"`` (``optimize``'s default) is the user's cache folder
(:func:`resolve_cache_dir`).

Example:
    >>> import tempfile, torch
    >>> from profiling.trace import trace_module
    >>> model, x = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()), torch.randn(2, 4)
    >>> gm = trace_module(model, (x,))
    >>> with tempfile.TemporaryDirectory() as d:
    ...     first = cached_profile_graph(gm, (x,), d, timing_repeats=1)
    ...     again = cached_profile_graph(gm, (x,), d, timing_repeats=1)   # read from the file
    >>> again.nodes == first.nodes and again.metadata["cache"] == "hit"
    True
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import platform
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.fx

from planner.core.costgraph import CostGraph, CostNode, Storage
from planner.core.errors import ProfileError
from profiling import profile
from profiling.measure import StepInputs, TrainingStep

__all__ = ["CACHE_VERSION", "AUTO_CACHE_DIR", "CACHE_DIR_ENV", "fingerprint", "machine_identity", "resolve_cache_dir",
           "save_profile", "load_profile", "cached_profile_graph", "measurement_parts", "digest", "through_cache", "device_overheads_path"]

log = logging.getLogger(__name__)

#: Bumped when the meaning of a profile changes without a change of its fields.
CACHE_VERSION = 9  # 9: CostGraph.output_held and the criterion node of a loss taken outside the graph; 2: CostNode.selective_save marks every node a selective policy can keep; 3: node times from warm passes; 4: CUDA node times with the forward queued ahead; 5: CostNode.after_last_save_fraction; 6: CostNode.after_last_save_time_fraction; 7: fake profiles for a GPU target save what CUDA's kernels save; 8: CostNode.backward_late_scratch_bytes, and fake GPU profiles count a reduction's scratch
#: Versions :func:`load_profile` reads: their files have this version's fields but
#: ``backward_late_scratch_bytes``, which reads as 0 (none known, the simulator's reading of a
#: measured profile), and ``output_held``, which reads as True (those steps held the output
#: through the backward), so saved profiles such as the H100 ones load.
READABLE_CACHE_VERSIONS = (6, 7, 8, 9)


#: ``cache_dir`` value that names the user's cache folder (:func:`resolve_cache_dir`)
AUTO_CACHE_DIR = "auto"
#: environment variable that moves the ``"auto"`` cache folder; set to an empty string, no cache
CACHE_DIR_ENV = "CKPT_PLANNER_CACHE_DIR"


def resolve_cache_dir(cache_dir: str | os.PathLike[str] | None) -> Path | None:
    """The folder ``cache_dir`` names: None for no cache, a path as given, and for ``"auto"``
    ``$CKPT_PLANNER_CACHE_DIR`` (an empty value: no cache), else
    ``$XDG_CACHE_HOME/ckpt-planner/profiles``, else ``~/.cache/ckpt-planner/profiles``.

    Example:
        >>> resolve_cache_dir(None) is None, resolve_cache_dir("/tmp/profiles")
        (True, PosixPath('/tmp/profiles'))
    """
    if cache_dir is None:
        return None
    if str(cache_dir) != AUTO_CACHE_DIR:
        return Path(cache_dir)
    chosen = os.environ.get(CACHE_DIR_ENV)
    if chosen is not None:
        return Path(chosen).expanduser() if chosen else None
    base = os.environ.get("XDG_CACHE_HOME")
    if not base:
        try:
            base = str(Path.home() / ".cache")
        except RuntimeError:  # no home directory to be found: nowhere to keep profiles
            return None
    return Path(base) / "ckpt-planner" / "profiles"


def _processor() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown processor"


def machine_identity(devices: set[torch.device]) -> str:
    """What names the machine a profile's times were measured on: each GPU's name and the
    CUDA version where ``devices`` include one, the processor, its architecture and torch's
    thread count otherwise.

    Example:
        >>> import torch
        >>> machine_identity({torch.device("cpu")}).startswith("cpu ")
        True
    """
    gpus = sorted({torch.cuda.get_device_name(d) for d in devices if d.type == "cuda"})
    if gpus:
        return f"cuda {','.join(gpus)} cuda={torch.version.cuda}"
    return f"cpu {platform.machine()} {_processor()} threads={torch.get_num_threads()}"


def _kernel_modes(devices: set[torch.device]) -> str:
    """The modes the step runs under that change what it stores: autocast on each device type of
    the step (the dtypes), and on CUDA the attention kernels allowed (each saves other tensors)."""
    kinds = sorted({d.type for d in devices} | {"cpu"})
    modes = [f"{kind}:{torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else 'off'}"
             for kind in kinds]
    if "cuda" in kinds:
        cuda = torch.backends.cuda
        modes.append(f"sdpa:{int(cuda.flash_sdp_enabled())}{int(cuda.mem_efficient_sdp_enabled())}"
                     f"{int(cuda.math_sdp_enabled())}{int(cuda.cudnn_sdp_enabled())}")
    return ",".join(modes)


def _schema() -> str:
    return ";".join(
        f"{cls.__name__}:{','.join(f.name for f in dataclasses.fields(cls))}" for cls in (CostNode, Storage, CostGraph)
    )


def _describe(t: Any) -> str:
    if isinstance(t, torch.Tensor):
        return f"T{tuple(t.shape)}:{t.dtype}:{t.device.type}:{int(t.requires_grad)}:{tuple(t.stride())}"
    return repr(t) if isinstance(t, (int, float, bool, str, type(None))) else type(t).__name__


def fingerprint(gm: torch.fx.GraphModule, example_inputs: Any, *, fake: bool = False, target: str = "cpu",
                step: TrainingStep = TrainingStep()) -> str:
    """SHA-256 hex digest naming the profile of ``gm`` on ``example_inputs`` (see module docs).

    Example:
        >>> import torch
        >>> from profiling.trace import trace_module
        >>> m, x = torch.nn.Linear(4, 4), torch.randn(2, 4)
        >>> fingerprint(trace_module(m, (x,)), (x,)) == fingerprint(trace_module(m, (x,)), (x,))
        True
        >>> fingerprint(trace_module(m, (x,)), (x,)) == fingerprint(trace_module(m, (x,)), (x,), fake=True)
        False
    """
    from torch.utils._pytree import tree_leaves

    inputs = StepInputs.from_example(example_inputs)
    tensors = [*gm.parameters(), *gm.buffers(), *tree_leaves((inputs.args, inputs.kwargs))]
    parts = [*measurement_parts(tensors, fake=fake, target=target, step=step), gm.code]
    parts += [f"param {n} {_describe(p)}" for n, p in gm.named_parameters(remove_duplicate=False)]
    parts += [f"buffer {n} {_describe(b)}" for n, b in gm.named_buffers(remove_duplicate=False)]
    parts += [f"arg {_describe(a)}" for a in tree_leaves(inputs.args)]
    parts += [f"kwarg {k} {_describe(a)}" for k in sorted(inputs.kwargs) for a in tree_leaves(inputs.kwargs[k])]
    return digest(parts)


def measurement_parts(tensors: list[Any], *, fake: bool = False, target: str = "cpu",
                      step: TrainingStep = TrainingStep()) -> list[str]:
    """What decides a profile besides the graph: this cache's version and record fields, torch,
    the machine and kernel modes of the devices ``tensors`` are on, the profiling mode and target,
    and the training step.

    Example:
        >>> measurement_parts([torch.zeros(1)])[0] == f"version={CACHE_VERSION}"
        True
    """
    devices = {t.device for t in tensors if isinstance(t, torch.Tensor)} or {torch.device("cpu")}
    return [
        f"version={CACHE_VERSION}",
        f"schema={_schema()}",
        f"torch={torch.__version__}",
        f"machine={'none' if fake else machine_identity(devices)}",
        f"modes={_kernel_modes(devices)}",
        f"mode={'fake' if fake else 'measured'}",
        f"target={target.lower()}",
        f"step={step.describe()}",
    ]


def digest(parts: list[str]) -> str:
    """SHA-256 hex digest of ``parts`` in order (a profile's fingerprint).

    Example:
        >>> digest(["a", "b"]) == digest(["a", "b"]) != digest(["ab"])
        True
    """
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def _to_json(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_to_json(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _to_json(v) for k, v in value.items()}
    return value


def _record(cls: type, data: dict[str, Any]) -> Any:
    known = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items() if k in known})


def save_profile(graph: CostGraph, path: str | os.PathLike[str], key: str = "") -> None:
    """Write ``graph`` as JSON to ``path`` (atomically: a reader never sees half a file).

    Example:
        >>> import tempfile, os
        >>> g = CostGraph((CostNode("x", "placeholder", kind="input", output_storages=(0,)),), (Storage(0, 8, True),))
        >>> with tempfile.TemporaryDirectory() as d:
        ...     save_profile(g, os.path.join(d, "p.json"))
        ...     load_profile(os.path.join(d, "p.json")).nodes == g.nodes
        True
    """
    payload = {
        "cache_version": CACHE_VERSION,
        "fingerprint": key,
        "nodes": [_to_json(dataclasses.asdict(n)) for n in graph.nodes],
        "storages": [_to_json(dataclasses.asdict(s)) for s in graph.storages],
        "graph": {
            f.name: _to_json(getattr(graph, f.name))
            for f in dataclasses.fields(graph)
            if f.name not in ("nodes", "storages")
        },
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(payload, fh)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_profile(path: str | os.PathLike[str]) -> CostGraph:
    """Read a profile written by :func:`save_profile`.

    Raises:
        ProfileError: the file is missing, not JSON, or not a profile of this version.
    """
    try:
        payload = json.loads(Path(path).read_text())
        if payload.get("cache_version") not in READABLE_CACHE_VERSIONS:
            raise ProfileError(f"{path}: profile cache version {payload.get('cache_version')}, expected one of "
                               f"{READABLE_CACHE_VERSIONS}: profile the model again")
        nodes = tuple(_record(CostNode, n) for n in payload["nodes"])
        storages = tuple(_record(Storage, s) for s in payload["storages"])
        known = {f.name for f in dataclasses.fields(CostGraph)} - {"nodes", "storages", "metadata"}
        fields = {k: tuple(v) if isinstance(v, list) else v for k, v in payload["graph"].items() if k in known}
        return CostGraph(nodes=nodes, storages=storages, metadata=dict(payload["graph"].get("metadata") or {}),
                         **fields)
    except ProfileError:
        raise
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ProfileError(f"could not read the profile cache {path}: {type(exc).__name__}: {exc}") from exc


@functools.cache
def _warn_unwritable(folder: str, reason: str) -> None:
    """Warn once per folder and process that profiles cannot be kept there."""
    log.warning("the profile cache %s cannot be written (%s): profiles are not kept, so plans may differ from run "
                "to run; set cache_dir (or $%s) to a writable folder", folder, reason, CACHE_DIR_ENV)


def cached_profile_graph(
    gm: torch.fx.GraphModule,
    example_inputs: Any,
    cache_dir: str | os.PathLike[str] | None,
    **profile_kwargs: Any,
) -> CostGraph:
    """:func:`profiling.profile.profile_graph` through a cache in ``cache_dir`` (None: no cache;
    ``"auto"``: the user's cache folder, :func:`resolve_cache_dir`).

    A hit returns the stored profile without running anything (its ``metadata["cache"]`` is
    ``"hit"``); a miss profiles and stores it. An unreadable file is logged and profiled again;
    a folder that cannot be written is logged and the profile returned uncached.
    ``profile_kwargs`` go to ``profile_graph``; ``fake``, ``target`` and ``step`` are part of the key.
    """
    folder = resolve_cache_dir(cache_dir)
    if folder is None:
        return profile.profile_graph(gm, example_inputs, **profile_kwargs)
    if not profile_kwargs.get("fake", False):  # the device's checkpoint overheads, kept beside the profiles
        profile_kwargs.setdefault("overheads_path", device_overheads_path(folder, _devices(gm, example_inputs)))
    key = fingerprint(gm, example_inputs, fake=bool(profile_kwargs.get("fake", False)),
                      target=str(profile_kwargs.get("target", "cpu")),
                      step=profile_kwargs.get("step", TrainingStep()))
    return through_cache(folder, key, lambda: profile.profile_graph(gm, example_inputs, **profile_kwargs))


def device_overheads_path(folder: Path, devices: set[torch.device]) -> Path:
    """The file under ``folder`` that keeps the checkpoint overheads measured on the machine and
    devices of a step (:func:`profiling.device_overheads.device_overheads_ms`): one per torch
    version and :func:`machine_identity` (processor and thread count, or the GPUs), in the
    ``machines`` subfolder, apart from the profiles.

    Example:
        >>> cpu = {torch.device("cpu")}
        >>> device_overheads_path(Path("/tmp/p"), cpu) == device_overheads_path(Path("/tmp/p"), cpu)
        True
        >>> device_overheads_path(Path("/tmp/p"), cpu).parent
        PosixPath('/tmp/p/machines')
    """
    name = digest([f"torch={torch.__version__}", f"machine={machine_identity(devices)}"])[:16]
    return folder / "machines" / f"device-overheads-{name}.json"


def _devices(gm: torch.fx.GraphModule, example_inputs: Any) -> set[torch.device]:
    """The devices of ``gm``'s parameters and buffers and of the example inputs (CPU where none)."""
    from torch.utils._pytree import tree_leaves

    inputs = StepInputs.from_example(example_inputs)
    tensors = [*gm.parameters(), *gm.buffers(), *tree_leaves((inputs.args, inputs.kwargs))]
    return {t.device for t in tensors if isinstance(t, torch.Tensor)} or {torch.device("cpu")}


def through_cache(folder: Path, key: str, make: Callable[[], CostGraph]) -> CostGraph:
    """The profile stored as ``key`` in ``folder``, or ``make()``'s, stored there (see
    :func:`cached_profile_graph`); ``metadata["cache"]`` says which.

    Example:
        >>> import tempfile
        >>> g = CostGraph((CostNode("x", "placeholder", kind="input", output_storages=(0,)),), (Storage(0, 8, True),))
        >>> with tempfile.TemporaryDirectory() as d:
        ...     first = through_cache(Path(d), "k", lambda: g)
        ...     again = through_cache(Path(d), "k", lambda: None)   # read from the file
        >>> first.metadata["cache"], again.metadata["cache"], again.nodes == g.nodes
        ('miss', 'hit', True)
    """
    path = folder / f"{key}.json"
    if path.exists():
        try:
            graph = load_profile(path)
        except ProfileError as exc:
            log.warning("%s; profiling again", exc)
        else:
            log.info("profile cache hit: %s (%d nodes)", path, len(graph.nodes))
            graph.metadata.update(cache="hit", fingerprint=key)
            return graph
    graph = make()
    try:
        save_profile(graph, path, key)
    except OSError as exc:
        _warn_unwritable(str(folder), f"{type(exc).__name__}: {exc}")
        graph.metadata.update(cache="unwritable", fingerprint=key)
        return graph
    log.info("profile cached at %s", path)
    graph.metadata.update(cache="miss", fingerprint=key)
    return graph
