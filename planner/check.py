"""Memory-regression checks: compare a model's profile with a baseline file.

A baseline is JSON: the unoptimized predicted peak, the activation bytes each node saves, and
the plan at each configured budget. Profiles for checks are taken on fake tensors, so the same
code gives the same bytes on any machine; time is not part of pass or fail.

A check fails when the unoptimized peak grows beyond the tolerance, or a budget that had a
plan no longer has one. The report names the nodes whose saved activations grew.

Example:
    >>> base = {"format": BASELINE_FORMAT, "version": 1, "model": "m", "unoptimized_peak_bytes": 100,
    ...         "activation_bytes_by_node": {"relu": 40}, "plans": []}
    >>> now = dict(base, unoptimized_peak_bytes=110, activation_bytes_by_node={"relu": 50})
    >>> result = compare(validate_baseline(base, "b.json"), now, tolerance=0.05)
    >>> result.regressed, result.grown_nodes
    (True, [('relu', 40, 50)])
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from xml.etree import ElementTree

from planner.core.costgraph import CostGraph
from planner.core.errors import PlannerError
from planner.core.plan import Plan
from planner.core.simulate import simulate
from planner.core.units import GIB, MIB

__all__ = [
    "BASELINE_FORMAT",
    "BaselineError",
    "CheckResult",
    "baseline_from",
    "read_baseline",
    "validate_baseline",
    "write_baseline",
    "compare",
    "baseline_key",
    "stem_key",
    "check_same_model",
    "check_same_capture",
    "parse_tolerance",
    "render_check",
    "junit_xml",
]

BASELINE_FORMAT = "ckpt-planner-baseline"


class BaselineError(PlannerError):
    """A baseline file is missing, unreadable, malformed, or for another model."""


def parse_tolerance(text: str | float) -> float:
    """``"5%"`` or ``"0.05"`` → 0.05."""
    raw = str(text).strip()
    try:
        value = float(raw[:-1]) / 100 if raw.endswith("%") else float(raw)
    except ValueError:
        raise PlannerError(f"tolerance {text!r} must look like 5% or 0.05") from None
    if not 0 <= value < 10:
        raise PlannerError(f"tolerance {text!r} must be between 0% and 1000%")
    return value


def baseline_from(
    graph: CostGraph, plans: Sequence[tuple[int, Plan | None, int | None]], model_name: str
) -> dict[str, Any]:
    """The baseline dict for ``graph``; ``plans`` holds ``(budget_bytes, plan or None, min_feasible_bytes)``."""
    return {
        "format": BASELINE_FORMAT,
        "version": 1,
        "model": model_name,
        # how the figures were made: "graph" (a captured graph, on fake tensors: the same bytes on
        # every machine), or "graph-breaks" or "modules" (one real step measured, for a model
        # that cannot be captured); figures of two paths are not compared
        "capture": graph.metadata.get("capture", "graph"),
        "unoptimized_peak_bytes": simulate(graph).peak_bytes,
        "persistent_bytes": graph.persistent_bytes,
        "activation_bytes_by_node": graph.saved_bytes_by_node(),
        "plans": [
            {
                "budget_bytes": budget,
                "feasible": plan is not None,
                "predicted_peak_bytes": plan.predicted_peak_bytes if plan else None,
                "recompute_flops": plan.recompute_flops if plan else None,
                "segments": len(plan.segments) if plan else None,
                "min_feasible_bytes": minimum,
            }
            for budget, plan, minimum in plans
        ],
    }


def validate_baseline(data: Any, source: str) -> dict[str, Any]:
    """Check the shape of a baseline dict; raises :class:`BaselineError` naming what is wrong."""
    def bad(what: str) -> BaselineError:
        return BaselineError(f"baseline {source} {what}; regenerate it with --update")

    if not isinstance(data, dict) or data.get("format") != BASELINE_FORMAT:
        raise bad(f"is not a ckpt-planner baseline (no \"format\": \"{BASELINE_FORMAT}\")")
    if data.get("version") != 1:
        raise bad(f"has version {data.get('version')!r}, this ckpt-planner reads version 1")
    for key, kind in (("model", str), ("unoptimized_peak_bytes", int), ("activation_bytes_by_node", dict),
                      ("plans", list)):
        if key not in data:
            raise bad(f"has no {key!r} field")
        if not isinstance(data[key], kind) or isinstance(data[key], bool):
            raise bad(f"field {key!r} should be {kind.__name__}, got {type(data[key]).__name__}")
    if not all(isinstance(k, str) and isinstance(v, int) for k, v in data["activation_bytes_by_node"].items()):
        raise bad("field 'activation_bytes_by_node' should map node names to byte counts")
    if not isinstance(data.get("capture", "graph"), str):
        raise bad(f"field 'capture' should be str, got {type(data['capture']).__name__}")
    for i, plan in enumerate(data["plans"]):
        if not isinstance(plan, dict) or not isinstance(plan.get("budget_bytes"), int) \
                or not isinstance(plan.get("feasible"), bool):
            raise bad(f"plan {i} needs an integer 'budget_bytes' and a boolean 'feasible'")
    return data


def read_baseline(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise BaselineError(f"baseline {path} does not exist; create it with --update")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BaselineError(f"baseline {path} is not valid JSON ({exc}); regenerate it with --update") from None
    return validate_baseline(data, str(path))


def write_baseline(path: str | Path, data: dict[str, Any]) -> None:
    """Write atomically: a failed write leaves the old baseline as it was.

    The folder must exist (a typo in it should fail, not create folders); the file gets the
    permissions any new file gets here (the umask's), or keeps those of the file it replaces.
    """
    path = Path(path)
    if not path.parent.is_dir():
        raise BaselineError(f"baseline folder {path.parent} does not exist; create it first or pass another path")
    mode = path.stat().st_mode & 0o777 if path.is_file() else _new_file_mode()
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as handle:
                json.dump(data, handle, indent=2, sort_keys=True)
                handle.write("\n")
            # mkstemp makes the file private (0600): a baseline is shared, like any file written here
            os.chmod(tmp, mode)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as exc:
        raise BaselineError(f"baseline {path} could not be written: {exc.strerror or exc}") from None


def _new_file_mode() -> int:
    """The mode ``open(path, "w")`` gives a new file: 0666 less the process's umask."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


@dataclass
class CheckResult:
    """One row per compared figure, the nodes whose saved bytes grew, and the verdict."""

    model: str
    tolerance: float
    rows: list[dict[str, Any]] = field(default_factory=list)
    grown_nodes: list[tuple[str, int, int]] = field(default_factory=list)
    new_nodes: list[tuple[str, int]] = field(default_factory=list)
    #: the path the current figures came from (:attr:`planner.core.plan.Plan.capture`)
    capture: str = "graph"
    #: the first line of the capture failure that chose the graph-break or module path; ""
    #: where the figures are the captured graph's or the path was asked for
    capture_failure: str = ""

    @property
    def regressed(self) -> bool:
        return any(row["status"] == "REGRESSED" for row in self.rows)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "tolerance": self.tolerance,
            "capture": self.capture,
            "capture_failure": self.capture_failure or None,
            "regressed": self.regressed,
            "rows": self.rows,
            "grown_nodes": [{"node": n, "baseline_bytes": a, "current_bytes": b} for n, a, b in self.grown_nodes],
            "new_nodes": [{"node": n, "current_bytes": b} for n, b in self.new_nodes],
        }


def _change(old: int | None, new: int | None) -> float | None:
    if old is None or new is None or old == 0:
        return None
    return new / old - 1


def baseline_key(target: str, baseline_path: str | Path) -> str:
    """The name a baseline keys its model by: ``file.py:function`` and saved-model paths
    relative to the baseline file's folder (so two ``models.py`` in different folders are two
    models, and the key does not depend on the working directory or the machine);
    ``package.module:function`` as given.

    Example:
        >>> baseline_key("examples/models.py:gpt2", "memory.json")
        'examples/models.py:gpt2'
        >>> baseline_key("/repo/examples/models.py:gpt2", "/repo/ci/memory.json")
        '../examples/models.py:gpt2'
        >>> baseline_key("package.models:gpt2", "memory.json")
        'package.models:gpt2'
    """
    path, sep, func = target.rpartition(":")
    if not (sep and path.endswith(".py")):
        if ":" in target and not Path(target).exists():
            return target  # package.module:function
        path, func = target, ""
    folder = Path(baseline_path).absolute().parent
    relative = Path(os.path.relpath(Path(path).absolute(), folder)).as_posix()
    return f"{relative}:{func}" if func else relative


def stem_key(target: str) -> str:
    """The file's stem alone (``models:gpt2``, ``model.pt2``): what a baseline was keyed by
    before :func:`baseline_key`; such a baseline is still read as the same model.

    Example:
        >>> stem_key("examples/models.py:gpt2")
        'models:gpt2'
    """
    path, sep, func = target.rpartition(":")
    if sep and path.endswith(".py"):
        return f"{Path(path).stem}:{func}"
    return target if ":" in target and not Path(target).exists() else Path(target).name


def check_same_model(baseline: dict[str, Any], key: str, stem: str | None = None) -> dict[str, Any]:
    """``baseline`` keyed by ``key``, or :class:`BaselineError` when it is another model's
    (checked before any profiling). A baseline keyed by ``stem`` (:func:`stem_key`) is the same
    model, returned keyed by ``key``."""
    if baseline["model"] == key:
        return baseline
    if stem is not None and baseline["model"] == stem:
        return {**baseline, "model": key}
    raise BaselineError(f"baseline is for model {baseline['model']!r}, not {key!r}: pass the right --baseline, "
                        f"or --update to replace it")


def check_same_capture(baseline: dict[str, Any], capture: str, source: str | Path) -> None:
    """Refuse with :class:`BaselineError` to compare figures of two capture paths (their nodes
    and bytes differ): a baseline without ``"capture"`` was made on the captured graph.

    Example:
        >>> check_same_capture({"capture": "modules"}, "graph", "memory.json")
        Traceback (most recent call last):
        ...
        planner.check.BaselineError: baseline memory.json was made on the modules path and this run on the graph path: their nodes and bytes are not comparable; pass --trace-method modules to check on the baseline's path, or --update to replace the baseline
    """
    made_on = baseline.get("capture", "graph")
    if made_on == capture:
        return
    method = "export" if made_on == "graph" else made_on
    raise BaselineError(f"baseline {source} was made on the {made_on} path and this run on the {capture} path: "
                        f"their nodes and bytes are not comparable; pass --trace-method {method} to check on the "
                        f"baseline's path, or --update to replace the baseline")


def compare(baseline: dict[str, Any], current: dict[str, Any], tolerance: float) -> CheckResult:
    """Compare two baseline dicts. The models must match by name."""
    check_same_model(baseline, current["model"])
    result = CheckResult(model=current["model"], tolerance=tolerance, capture=current.get("capture", "graph"))
    old_peak, new_peak = baseline["unoptimized_peak_bytes"], current["unoptimized_peak_bytes"]
    change = _change(old_peak, new_peak)
    result.rows.append({
        "figure": "unoptimized peak",
        "baseline": old_peak,
        "current": new_peak,
        "change": change,
        "status": "REGRESSED" if change is not None and change > tolerance else "ok",
    })
    old_plans = {p["budget_bytes"]: p for p in baseline["plans"]}
    for plan in current["plans"]:
        old = old_plans.get(plan["budget_bytes"])
        label = f"plan at {plan['budget_bytes'] / GIB:.3f} GiB"
        if old is None:
            result.rows.append({"figure": label, "baseline": None, "current": plan["predicted_peak_bytes"],
                                "change": None, "status": "new"})
            continue
        if old["feasible"] and not plan["feasible"]:
            status = "REGRESSED"
        elif not plan["feasible"]:
            status = "infeasible"
        else:
            status = "ok"
        result.rows.append({
            "figure": label,
            "baseline": old.get("predicted_peak_bytes"),
            "current": plan["predicted_peak_bytes"],
            "change": _change(old.get("predicted_peak_bytes"), plan["predicted_peak_bytes"]),
            "status": status,
            "baseline_recompute_flops": old.get("recompute_flops"),
            "current_recompute_flops": plan["recompute_flops"],
            "min_feasible_bytes": plan.get("min_feasible_bytes"),
        })
    old_nodes = baseline["activation_bytes_by_node"]
    for name, size in current["activation_bytes_by_node"].items():
        if name not in old_nodes:
            result.new_nodes.append((name, size))
        elif size > old_nodes[name]:
            result.grown_nodes.append((name, old_nodes[name], size))
    result.grown_nodes.sort(key=lambda row: row[1] - row[2])
    result.new_nodes.sort(key=lambda row: -row[1])
    return result


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / MIB:.2f} MiB"


def render_check(result: CheckResult, fmt: str = "text", top: int = 10) -> str:
    """The comparison as a text table (``text``) or JSON (``json``)."""
    if fmt == "json":
        return json.dumps(result.to_dict(), indent=2) + "\n"
    lines = [f"memory check of {result.model} (tolerance {result.tolerance:.1%}, capture: {result.capture})"]
    if result.capture != "graph":
        why = ("since the model could not be captured (the warning below says why)" if result.capture_failure
               else f"as --trace-method {result.capture} asks")
        lines.append(f"figures from the {result.capture} path, {why}: bytes of one real training step, not of fake "
                     f"tensors")
    lines.append("")
    table = [["figure", "baseline", "current", "change", "status"]]
    for row in result.rows:
        change = "-" if row["change"] is None else f"{row['change']:+.1%}"
        table.append([row["figure"], _mib(row["baseline"]), _mib(row["current"]), change, row["status"]])
        if row.get("current_recompute_flops") is not None and row.get("baseline_recompute_flops") is not None:
            table.append(["  recompute FLOPs", f"{row['baseline_recompute_flops']:.3e}",
                          f"{row['current_recompute_flops']:.3e}", "", "info"])
        if row["status"] in ("REGRESSED", "infeasible") and row.get("min_feasible_bytes"):
            table.append(["  smallest feasible budget", "", _mib(row["min_feasible_bytes"]), "", ""])
    widths = [max(len(r[i]) for r in table) for i in range(5)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in table]
    if result.grown_nodes or result.new_nodes:
        lines += ["", "nodes whose saved activations grew:"]
        for name, old, new in result.grown_nodes[:top]:
            lines.append(f"  {name}: {_mib(old)} -> {_mib(new)} ({new / old - 1:+.1%})")
        for name, new in result.new_nodes[:top]:
            lines.append(f"  {name}: new, {_mib(new)}")
    lines += ["", "REGRESSED: peak training memory grew beyond the tolerance" if result.regressed else "passed"]
    return "\n".join(lines) + "\n"


def junit_xml(result: CheckResult) -> str:
    """JUnit XML with one test case per compared figure, for CI dashboards."""
    suite = ElementTree.Element("testsuite", name="ckpt-planner memory check", tests=str(len(result.rows)),
                                failures=str(sum(r["status"] == "REGRESSED" for r in result.rows)))
    for row in result.rows:
        case = ElementTree.SubElement(suite, "testcase", classname=f"memory.{result.model}", name=row["figure"])
        if row["status"] == "REGRESSED":
            grown = ", ".join(f"{n} {_mib(a)}->{_mib(b)}" for n, a, b in result.grown_nodes[:5])
            failure = ElementTree.SubElement(case, "failure", message=(
                f"{row['figure']}: {_mib(row['baseline'])} -> {_mib(row['current'])}"))
            failure.text = f"grown nodes: {grown or 'none'}"
    return ElementTree.tostring(suite, encoding="unicode", xml_declaration=True) + "\n"
