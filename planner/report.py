"""What checkpointing buys on one profiled model: the data behind ``ckpt-planner report``.

``build_report`` gathers the unoptimized peak and where it happens, the plan at the budget
(what it recomputes and, planned with ``offload``, what it moves to pinned host memory and the
copy time the compute waits for), the largest saved activations by node and by module, and
optionally a sweep's Pareto front and a proven lower bound on the recompute time of every plan
at the budget (:mod:`planner.bounds.reach`); ``render`` writes it as a terminal table, markdown,
JSON or CSV. Standard library only (pandas for CSV).

Example:
    >>> from planner.core.costgraph import CostGraph, CostNode, Storage
    >>> from planner.solvers.solve import solve
    >>> nodes = [CostNode("x", "placeholder", kind="input", output_storages=(0,))]
    >>> for i in range(1, 5):
    ...     nodes.append(CostNode(f"n{i}", "relu", input_names=(nodes[-1].name,),
    ...                           output_storages=(i,), saved_storages=(i,), output_bytes=2**20,
    ...                           requires_grad=True, time_ms=1.0, module=f"block{i}"))
    >>> g = CostGraph(tuple(nodes), tuple(Storage(i, 2**20, i == 0) for i in range(5)), ("n4",))
    >>> report = build_report(g, solve(g, 6 * 2**20), model_name="chain")
    >>> report.top_modules[0]
    ('block1', 1048576)
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from planner.core.costgraph import CostGraph
from planner.core.offload import simulate_offload
from planner.core.options import SolveOptions
from planner.core.plan import Plan, describe_capture, describe_segments, format_ms, rerun_nodes
from planner.core.simulate import SimulationResult, simulate
from planner.sweep import pareto_front
from planner.core.units import MIB

if TYPE_CHECKING:  # pragma: no cover
    from planner.bounds.reach import RecomputeBound

__all__ = ["Report", "build_report", "render", "REPORT_FORMATS"]

REPORT_FORMATS = ("text", "markdown", "json", "csv")


@dataclass(frozen=True)
class Report:
    """Everything one report shows; ``timelines`` feed the plot and stay out of ``to_dict``."""

    model_name: str
    node_count: int
    plan: Plan
    unoptimized_peak_phase: str
    unoptimized_peak_node: str
    unoptimized_peak_module: str
    kept_activation_bytes: int
    top_nodes: list[tuple[str, str, str, int]]
    top_modules: list[tuple[str, int]]
    pareto: list[Plan] = field(default_factory=list)
    #: what the profile ran on (``graph.metadata``): "target" for a roofline of another device,
    #: else "device" where it was measured; "" when the profile does not say
    device: str = ""
    #: the training step profiled (``graph.metadata["step"]``: the loss, and whether the output
    #: is held through the backward); "" when the profile does not say
    graph_step: str = ""
    #: the least recompute time any plan fitting the budget needs (None: not asked)
    bound: RecomputeBound | None = None
    #: the smallest feasible budgets in bytes without and with the output head and loss in row
    #: chunks (``--chunk-loss``, :mod:`planner.loss_chunking`); None: the graph has no such chain
    loss_chunk_floors: tuple[int, int] | None = None
    #: the first line of the capture failure that sent the model down the graph-break or
    #: module path (``plan.capture``); "" where the path was the captured graph or asked for
    capture_failure: str = ""
    #: the host link the plan's copies to pinned host memory were priced over ("" : none offloaded)
    host_link: str = ""
    timelines: dict[str, SimulationResult] = field(default_factory=dict, compare=False)

    def to_dict(self) -> dict[str, Any]:
        plan = self.plan
        return {
            "model": self.model_name,
            "nodes": self.node_count,
            "device": self.device,
            "capture": plan.capture,
            **({"subgraphs": plan.subgraphs} if plan.capture == "graph-breaks" else {}),
            "capture_failure": self.capture_failure or None,
            "unoptimized": {
                "predicted_peak_bytes": plan.unoptimized_peak_bytes,
                "measured_peak_bytes": plan.measured_unoptimized_peak_bytes,
                "peak_phase": self.unoptimized_peak_phase,
                "peak_node": self.unoptimized_peak_node,
                "peak_module": self.unoptimized_peak_module,
                "step_ms": plan.step_ms,
            },
            "plan": _plan_dict(plan) | {
                "kept_activation_bytes": self.kept_activation_bytes,
                "offloaded": [{"node": name, "fetched_at": trigger}
                              for name, trigger in zip(plan.offloaded, plan.offload_triggers)],
                "host_link": self.host_link or None,
                "computation_changes": list(plan.computation_changes),
                "segments": [
                    {"first": s.node_names[0], "last": s.node_names[-1], "nodes": len(s.node_names),
                     "recompute_ms": s.recompute_ms, "recompute_flops": s.recompute_flops,
                     "rerun_nodes": len(rerun_nodes(s))}
                    for s in plan.segments
                ],
            },
            "largest_activations_by_node": [
                {"node": n, "op": op, "module": m, "saved_bytes": b} for n, op, m, b in self.top_nodes
            ],
            "largest_activations_by_module": [{"module": m, "saved_bytes": b} for m, b in self.top_modules],
            "pareto": [_plan_dict(p) for p in self.pareto],
            "smallest_feasible_budget": None if self.loss_chunk_floors is None else {
                "bytes": self.loss_chunk_floors[0], "with_chunk_loss_bytes": self.loss_chunk_floors[1]},
            "training_step": self.graph_step,
            "lower_bound": None if self.bound is None else {
                "recompute_ms": None if self.bound.proven_infeasible else self.bound.bound,
                "proven_infeasible": self.bound.proven_infeasible,
                "method": self.bound.method,
                "solve_s": self.bound.solve_s,
            },
        }


def _plan_dict(plan: Plan) -> dict[str, Any]:
    return {
        "budget_bytes": plan.budget_bytes,
        "predicted_peak_bytes": plan.predicted_peak_bytes,
        "recompute_ms": plan.recompute_ms,
        "recompute_flops": plan.recompute_flops,
        "offloaded_bytes": plan.offloaded_bytes,
        "exposed_transfer_ms": plan.exposed_transfer_ms,
        "extra_time_ms": plan.extra_time_ms,
        "overhead_ratio": plan.overhead_ratio,
        "step_ms": plan.step_ms,
        "segment_count": len(plan.segments),
        "segment_nodes": sum(len(s.node_names) for s in plan.segments),
        "recomputed_nodes": len(plan.recomputed_nodes),
        "optimality_gap": plan.optimality_gap,
        "hit_time_limit": plan.hit_time_limit,
        "capture": plan.capture,
    }


def build_report(
    graph: CostGraph,
    plan: Plan,
    *,
    model_name: str = "model",
    sweep_plans: Sequence[Plan] = (),
    top: int = 10,
    bound: RecomputeBound | None = None,
    loss_chunk_floors: tuple[int, int] | None = None,
    unoptimized_graph: CostGraph | None = None,
    capture_failure: str = "",
    offload: SolveOptions | None = None,
) -> Report:
    """Gather the report for ``plan`` (made from ``graph``), an optional sweep and an optional
    lower bound (:func:`planner.bounds.reach.recompute_bound` at the plan's budget).
    ``unoptimized_graph``: the profile of the user's own step where ``graph`` computes it
    otherwise (the loss in row chunks); its peak and timeline are the unoptimized ones.
    ``capture_failure``: why the plan is not the captured graph's, where a failed capture
    chose its path (:attr:`Report.capture_failure`).
    ``offload``: the options the plan was solved with, whose host link priced its copies to
    pinned host memory (the plan's timeline is then replayed with them)."""
    reference = unoptimized_graph or graph
    unoptimized = simulate(reference)
    host_link = ""
    if plan.offloaded and offload is not None:
        copies = simulate_offload(graph, plan.segments, plan.offloaded, offload.offload_spec(),
                                  triggers=dict(zip(plan.offloaded, plan.offload_triggers)))
        planned = SimulationResult(copies.peak_bytes, copies.peak_phase, copies.peak_node, copies.timeline)
        host_link = _link_text(offload)
    else:
        planned = simulate(graph, [s.node_names for s in plan.segments])
    saved = graph.saved_bytes_by_node()
    # a segment's saved activations are dropped from the forward, those of nodes its recompute
    # never reruns too (their inputs are remade); kept nodes hold theirs
    checkpointed = {name for s in plan.segments for name in s.node_names if name not in s.kept_nodes}
    by_module: dict[str, int] = defaultdict(int)
    for name, size in saved.items():
        path = graph.node(name).module
        parts = path.split(".") if path else []
        for depth in range(1, len(parts) + 1):  # a module's total includes its submodules
            by_module[".".join(parts[:depth])] += size
        if not parts:
            by_module["(top level)"] += size
    ranked = sorted(saved.items(), key=lambda kv: -kv[1])[:top]
    peak_node = unoptimized.peak_node
    return Report(
        model_name=model_name,
        node_count=len(graph.nodes),
        plan=plan,
        unoptimized_peak_phase=unoptimized.peak_phase,
        unoptimized_peak_node=peak_node,
        unoptimized_peak_module=reference.node(peak_node).module if peak_node in reference.index else "",
        kept_activation_bytes=sum(size for name, size in saved.items() if name not in checkpointed),
        top_nodes=[(n, graph.node(n).op, graph.node(n).module, b) for n, b in ranked],
        top_modules=sorted(by_module.items(), key=lambda kv: (-kv[1], kv[0].count("."), kv[0]))[:top],
        pareto=pareto_front(sweep_plans) if sweep_plans else [],
        bound=bound,
        loss_chunk_floors=loss_chunk_floors,
        host_link=host_link,
        device=_profiled_on(graph),
        graph_step=str(graph.metadata.get("step") or ""),
        capture_failure=capture_failure,
        timelines={"unoptimized": unoptimized, "plan": planned},
    )


def _link_text(options: SolveOptions) -> str:
    """The host link as the options set it: a named link, or one bandwidth both ways."""
    spec = options.offload_spec()
    if options.host_bandwidth_gbps is not None:
        return f"{spec.h2d_gbps:g} GB/s each way"
    return f"{options.host_link} ({spec.h2d_gbps:g} GB/s to the device, {spec.d2h_gbps:g} GB/s to the host)"


def _profiled_on(graph: CostGraph) -> str:
    target = graph.metadata.get("target")
    if graph.metadata.get("mode") == "fake" and target:  # times from the target's roofline, nothing run
        return f"{target} (fake tensors, roofline)"
    return str(graph.metadata.get("device") or "")


def _mib(n: int | None) -> str:
    if n is None:
        return "n/a"
    return f"{n / MIB:.1f} MiB" if abs(n) >= MIB // 10 else f"{n / 1024:.1f} KiB"  # a tiny model's peak reads


def _rows(report: Report) -> list[tuple[str, list[str], list[list[str]]]]:
    """The report as titled tables: (title, header, rows)."""
    plan = report.plan
    summary = [
        ["model", f"{report.model_name} ({report.node_count} nodes)"],
        ["profiled on", report.device or "n/a"],
        ["training step", str(report.graph_step) or "n/a"],
        ["unoptimized peak (predicted)", _mib(plan.unoptimized_peak_bytes)],
        ["unoptimized peak (measured)", _mib(plan.measured_unoptimized_peak_bytes)],
        ["unoptimized peak at", f"{report.unoptimized_peak_phase} of {report.unoptimized_peak_node}"
                                f" ({report.unoptimized_peak_module or 'top level'})"],
        ["budget", _mib(plan.budget_bytes)],
        ["planned peak (predicted)", _mib(plan.predicted_peak_bytes)],
        ["kept activations", _mib(report.kept_activation_bytes)],
        ["recomputed", describe_segments(plan.segments)],
        *([["offloaded", f"outputs of {len(plan.offloaded)} nodes, {_mib(plan.offloaded_bytes)} to pinned host "
                         f"memory" + (f" over {report.host_link}" if report.host_link else "")],
           ["copies not hidden (predicted)", f"{format_ms(plan.exposed_transfer_ms)} per step"]]
          if plan.offloaded else []),
        ["extra time (predicted)", f"{format_ms(plan.extra_time_ms)} per step ({plan.overhead_ratio:.1%} of "
                                   f"{format_ms(plan.step_ms)})"],
        ["extra FLOPs", f"{plan.recompute_flops:.3e}"],
        ["computation", "; ".join(f"CHANGED: {c}" for c in plan.computation_changes) or "the model's own"],
        ["capture", _capture_text(report)],
    ]
    if report.bound is not None:
        summary.append(["least possible extra time", _bound_text(report.bound, plan)])
    if report.loss_chunk_floors is not None:
        summary.append(["smallest feasible budget", _floors_text(report.loss_chunk_floors, plan)])
    tables = [("Summary", ["", ""], summary)]
    if plan.segments:
        tables.append(("Recomputed segments", ["#", "first node", "last node", "nodes", "rerun", "time"], [
            [str(k), s.node_names[0], s.node_names[-1], str(len(s.node_names)),
             str(len(rerun_nodes(s))), format_ms(s.recompute_ms)]
            for k, s in enumerate(plan.segments)
        ]))
    tables.append(("Largest saved activations by node", ["node", "op", "module", "saved"], [
        [n, op, m or "-", _mib(b)] for n, op, m, b in report.top_nodes
    ]))
    tables.append(("Largest saved activations by module", ["module", "saved"], [
        [m, _mib(b)] for m, b in report.top_modules
    ]))
    if report.pareto:
        offloads = any(p.offloaded for p in report.pareto)  # a column of its own only where a plan offloads
        tables.append(("Pareto front (sweep)", ["budget", "predicted peak", "extra time", "extra FLOPs", "segments",
                                                *(["offloaded"] if offloads else [])], [
            [_mib(p.budget_bytes), _mib(p.predicted_peak_bytes),
             f"{format_ms(p.extra_time_ms)} ({p.overhead_ratio:.1%})",
             f"{p.recompute_flops:.3e}", str(len(p.segments)), *([_mib(p.offloaded_bytes)] if offloads else [])]
            for p in report.pareto
        ]))
    return tables


def _capture_text(report: Report) -> str:
    """The path that made the plan, its subgraphs, and whether a failed capture chose it."""
    plan = report.plan
    text = describe_capture(plan.capture)
    if plan.capture == "graph-breaks":
        text += f", {plan.subgraphs} subgraph{'' if plan.subgraphs == 1 else 's'}"
    if report.capture_failure:
        text += "; the model could not be captured (the warning below says why)"
    return text


def _floors_text(floors: tuple[int, int], plan: Plan) -> str:
    """Both floors, as shares of the measured unoptimized peak where there is one (the user's
    own computation, also when the plan chunks the loss)."""
    reference = plan.measured_unoptimized_peak_bytes or plan.unoptimized_peak_bytes
    plain, chunked = (f"{_mib(f)} ({f / reference:.0%} of the unoptimized peak)" if reference else _mib(f)
                      for f in floors)
    return (f"{plain}; with --chunk-loss {chunked}: the output head and cross-entropy run in row chunks, one "
            f"chunk's logits at a time (other summation order)")


def _bound_text(bound: RecomputeBound, plan: Plan) -> str:
    plans = "plan" if bound.kept_outputs else "plan of segments"
    if bound.proven_infeasible:
        return f"no {plans} fits the budget ({bound.method})"
    share = f" ({bound.bound / plan.step_ms:.1%})" if plan.step_ms > 0 else ""
    within = (f"; this plan costs {plan.recompute_ms / bound.bound - 1:.1%} more" if bound.bound > 0
              else "")
    return f"{format_ms(bound.bound)}{share} by any {plans}{within} ({bound.method})"


def _text_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    lines = []
    if any(header):
        lines.append("  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip())
        lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    return "\n".join(lines)


def render(report: Report, fmt: str = "text") -> str:
    """The report as ``text`` (terminal tables), ``markdown``, ``json`` or ``csv``.

    CSV has one row per plan: the plan at the budget, then each Pareto point of a sweep.
    """
    if fmt == "json":
        return json.dumps(report.to_dict(), indent=2)
    if fmt == "csv":
        import pandas

        plans = [("budget", report.plan)] + [("pareto", p) for p in report.pareto]
        frame = pandas.DataFrame([{"kind": kind, "model": report.model_name,
                                   "unoptimized_peak_bytes": p.unoptimized_peak_bytes, **_plan_dict(p)}
                                  for kind, p in plans])
        return frame.to_csv(index=False)
    if fmt == "markdown":
        parts = []
        for title, header, rows in _rows(report):
            head = header if any(header) else ["item", "value"]
            parts.append(f"### {title}\n\n| " + " | ".join(head) + " |\n|" + "---|" * len(head) + "\n"
                         + "\n".join("| " + " | ".join(r) + " |" for r in rows))
        return "\n\n".join(parts) + "\n"
    if fmt == "text":
        return "\n\n".join(f"{title}\n{_text_table(header, rows)}" for title, header, rows in _rows(report)) + "\n"
    raise ValueError(f"unknown format {fmt!r}; use one of {REPORT_FORMATS}")
