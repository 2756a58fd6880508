"""What the solver decided: the segments to recompute and what that costs.

Example:
    >>> p = Plan(budget_bytes=2**30, predicted_peak_bytes=2**29, unoptimized_peak_bytes=2**30,
    ...          segments=(Segment(("relu", "mul"), recompute_ms=1.5, recompute_flops=0),),
    ...          forward_ms=10.0, step_ms=30.0, forward_flops=100, solver="HiGHS", solve_s=0.1)
    >>> p.recompute_ms, p.recomputed_nodes
    (1.5, ('relu', 'mul'))
    >>> describe_segments(p.segments), format_ms(p.recompute_ms)
    ('2 nodes in 1 segment (2 rerun; 0 kept or skipped)', '1.50 ms')
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING
from planner.core.units import GIB

if TYPE_CHECKING:  # pragma: no cover
    import pandas

__all__ = ["Segment", "Plan", "describe_capture", "describe_segments", "format_ms", "rerun_nodes"]



def format_ms(ms: float) -> str:
    """A duration as people read it: three significant digits (all the integer digits of long
    ones), in microseconds below 0.1 ms, so that the small times of small models do not show as 0.

    Example:
        >>> [format_ms(t) for t in (492.61, 3.3, 0.25, 0.0123, 0.0)]
        ['493 ms', '3.30 ms', '0.250 ms', '12.3 µs', '0 ms']
    """
    if ms == 0 or not math.isfinite(ms):
        return f"{ms:g} ms"
    value, unit = (ms, "ms") if abs(ms) >= 0.1 else (ms * 1000, "µs")
    decimals = max(0, 2 - math.floor(math.log10(abs(value))))
    return f"{value:.{decimals}f} {unit}"


def describe_capture(capture: str) -> str:
    """What a plan's ``capture`` means, for reports.

    Example:
        >>> describe_capture("modules")
        'modules (whole submodule calls checkpointed: coarser than a captured graph)'
    """
    if capture == "modules":
        return "modules (whole submodule calls checkpointed: coarser than a captured graph)"
    if capture == "graph-breaks":
        return "graph-breaks (the ATen ops the step dispatched, node by node; the Python between graph breaks runs as is)"
    return f"{capture} (the captured graph, node by node)"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def describe_segments(segments: Sequence[Segment]) -> str:
    """How many nodes the segments hold and how many of them the backward runs again: a
    selective segment's kept nodes, and the nodes after a segment's last saved tensor, are in
    the segment but not rerun (:attr:`Plan.recomputed_nodes` counts the rerun ones).

    Example:
        >>> describe_segments([Segment(("a", "b", "c"), 1.0, 0, kept_nodes=("b",))])
        '3 nodes in 1 segment (2 rerun; 1 kept or skipped)'
    """
    if not segments:
        return "nothing (0 segments)"
    total = sum(len(s.node_names) for s in segments)
    rerun = sum(len(rerun_nodes(s)) for s in segments)
    return (f"{_count(total, 'node')} in {_count(len(segments), 'segment')} "
            f"({rerun} rerun; {total - rerun} kept or skipped)")


def rerun_nodes(segment: Segment) -> tuple[str, ...]:
    """The nodes of ``segment`` the backward runs again: neither kept nor skipped."""
    return tuple(name for name in segment.node_names
                 if name not in segment.kept_nodes and name not in segment.skipped_nodes)


@dataclass(frozen=True)
class Segment:
    """A contiguous run of nodes run under one ``torch.utils.checkpoint`` call.

    A selective segment keeps the outputs of ``kept_nodes`` from the forward, under a selective
    checkpoint policy, and recomputes only the rest (:mod:`planner.solvers.keep` chooses them).
    ``skipped_nodes`` are the nodes the recompute never runs: it stops once the last tensor
    the segment saved is saved again (:mod:`planner.core.rerun`). ``recompute_ms`` and
    ``recompute_flops`` count what is actually recomputed, and ``recompute_ms`` of a selective
    segment also the time the policy adds to each of its nodes.
    """

    node_names: tuple[str, ...]
    recompute_ms: float
    recompute_flops: int
    kept_nodes: tuple[str, ...] = ()
    skipped_nodes: tuple[str, ...] = ()

    @property
    def selective(self) -> bool:
        return bool(self.kept_nodes)


@dataclass(frozen=True)
class Plan:
    """A checkpointing plan for one profiled graph at one budget.

    ``predicted_peak_bytes`` comes from :func:`planner.core.simulate.simulate`; ``step_ms`` is the
    measured unoptimized forward plus backward time the overhead is expressed against.
    """

    budget_bytes: int
    predicted_peak_bytes: int
    unoptimized_peak_bytes: int
    segments: tuple[Segment, ...]
    forward_ms: float
    step_ms: float
    forward_flops: int
    solver: str
    solve_s: float
    measured_unoptimized_peak_bytes: int | None = None
    #: proven relative gap between this plan's recompute cost and the solver's best bound
    #: (None when unknown: no ILP ran, or the plan is the minimum-peak fallback)
    optimality_gap: float | None = None
    #: the solver stopped at its time limit; the plan fits the budget but may cost more
    hit_time_limit: bool = False
    #: the segments are the chain DP's optimum over a stage model (no MILP solver was needed)
    by_chain_dp: bool = False
    #: labels the chain DP kept solving that model: its cost (0: a MILP, or not the DP's plan)
    chain_labels: int = 0
    #: transformations of the captured graph that make it compute other than the user's module
    #: (each asked for by name, e.g. ``simplify_attention_masks``); empty: the user's computation
    computation_changes: tuple[str, ...] = ()
    #: which path made the plan: ``"graph"`` (the captured FX graph, node by node),
    #: ``"graph-breaks"`` (the ATen ops of a step with graph breaks, node by node) or
    #: ``"modules"`` (whole submodule calls, for models torch.export cannot capture: coarser)
    capture: str = "graph"
    #: with ``capture == "graph-breaks"``: the stretches of ops between graph breaks
    subgraphs: int = 1
    #: the rewritten step's peak measured at the allocator, where the plan was accepted on that
    #: measurement because its prediction sat above the budget's room (:mod:`planner.measured_fit`)
    measured_peak_bytes: int | None = None
    #: nodes whose held outputs go to pinned host memory in the forward and come back for the
    #: backward (:mod:`planner.core.offload`); empty: nothing is offloaded
    offloaded: tuple[str, ...] = ()
    #: for each node of ``offloaded``, the node whose backward issues its fetch back to the device
    offload_triggers: tuple[str, ...] = ()
    #: bytes those outputs take in host memory
    offloaded_bytes: int = 0
    #: predicted time the compute waits for copies to or from host memory, per step
    exposed_transfer_ms: float = 0.0
    #: graph breaks Dynamo counted compiling the planned step under ``optimize(compile=...)``
    #: (:mod:`rewrite.compiled`); None: the plan runs eagerly
    compile_graph_breaks: int | None = None
    #: seconds the first compiled step took (compiling included); None: the plan runs eagerly
    compile_s: float | None = None
    #: the compiled step runs as two compiled graphs in a row, split before the loss it computes
    #: (docs/memory.md#compiled-steps)
    compile_split_before_loss: bool = False

    @property
    def recompute_ms(self) -> float:
        """Predicted extra time per step: the forward time of every recomputed node."""
        return sum(s.recompute_ms for s in self.segments)

    @property
    def recompute_flops(self) -> int:
        """Extra FLOPs per step (``FlopCounterMode`` counting) spent on recompute."""
        return sum(s.recompute_flops for s in self.segments)

    @property
    def recomputed_nodes(self) -> tuple[str, ...]:
        """Nodes run again in the backward, wholly or in part (a selective segment's kept nodes
        and the nodes after a segment's last saved tensor are not)."""
        return tuple(name for s in self.segments for name in rerun_nodes(s))

    @property
    def extra_time_ms(self) -> float:
        """Predicted extra time per step: recompute plus the host copies not hidden behind compute."""
        return self.recompute_ms + self.exposed_transfer_ms

    @property
    def overhead_ratio(self) -> float:
        """Predicted extra step time as a fraction of the unoptimized step."""
        return self.extra_time_ms / self.step_ms if self.step_ms > 0 else 0.0

    def summary(self) -> str:
        """A few lines a person can read: budget, peaks, what is recomputed, the cost."""
        # a plan made without a profile (the measured unoptimized step fit the budget) has no
        # step time and peaks that were measured, not predicted
        profiled = self.step_ms > 0 or self.measured_unoptimized_peak_bytes != self.unoptimized_peak_bytes
        how = "predicted" if profiled else "measured"
        extra_time = f"{format_ms(self.extra_time_ms)} per step, predicted" + (
            f" (~{self.overhead_ratio:.1%} of a {format_ms(self.step_ms)} step, measured)" if self.step_ms > 0 else "")
        rows = [
            ("budget", f"{self.budget_bytes / GIB:.4f} GiB"),
            ("unoptimized peak", f"{self.unoptimized_peak_bytes / GIB:.4f} GiB ({how})"),
            ("planned peak", f"{self.predicted_peak_bytes / GIB:.4f} GiB ({how}, "
                             f"{self.predicted_peak_bytes / max(self.unoptimized_peak_bytes, 1):.0%} of unoptimized)"),
            *([("measured peak", f"{self.measured_peak_bytes / GIB:.4f} GiB (the planned step, measured at the "
                                 f"allocator)")]
              if self.measured_peak_bytes is not None else []),
            ("recomputed", describe_segments(self.segments)),
            *([("offloaded", f"outputs of {_count(len(self.offloaded), 'node')}, {self.offloaded_bytes / GIB:.4f} GiB "
                             f"to pinned host memory ({format_ms(self.recompute_ms)} recompute + "
                             f"{format_ms(self.exposed_transfer_ms)} of copies not hidden, predicted)")]
              if self.offloaded else []),
            ("extra time", extra_time),
            ("extra FLOPs", f"{self.recompute_flops:.3e} ({self.recompute_flops / max(self.forward_flops, 1):.1%} "
                            f"of the forward)" if self.capture != "modules" else "not counted (module path: time only)"),
            ("solver", f"{self.solver}, {self.solve_s:.2f} s{self._solver_note()}"),
        ]
        if self.compile_graph_breaks is not None:
            split = ", split before the loss into two graphs" if self.compile_split_before_loss else ""
            rows.append(("compiled", f"torch.compile, {_count(self.compile_graph_breaks, 'graph break')}{split}, compiled in "
                                     f"{self.compile_s or 0.0:.1f} s; the measured peaks are the compiled step's" + (
                f" (unoptimized {self.measured_unoptimized_peak_bytes / GIB:.4f} GiB)"
                if self.measured_unoptimized_peak_bytes is not None else "")))
        rows.extend(("computation", f"CHANGED: {change}") for change in self.computation_changes)
        if self.capture != "graph":
            count = f", {self.subgraphs} subgraphs" if self.capture == "graph-breaks" else ""
            rows.append(("capture", describe_capture(self.capture) + count))
        width = max(len(label) for label, _ in rows) + 2
        lines = [f"{label:<{width}}{value}" for label, value in rows]
        for k, seg in enumerate(self.segments):
            lines.append(
                f"  segment {k}: {seg.node_names[0]} .. {seg.node_names[-1]} "
                f"({_count(len(seg.node_names), 'node')}, {len(rerun_nodes(seg))} rerun, "
                f"{format_ms(seg.recompute_ms)}{f', {len(seg.kept_nodes)} outputs kept' if seg.selective else ''})"
            )
        return "\n".join(lines)

    def _solver_note(self) -> str:
        gap = "" if self.optimality_gap is None else f", gap {self.optimality_gap:.1%}"
        return gap + (" (stopped at the time limit)" if self.hit_time_limit else "")

    def to_frame(self) -> "pandas.DataFrame":
        """One row per recomputed node: its segment index and node name."""
        import pandas

        rows = [
            {"segment": k, "node": name, "selective": seg.selective}
            for k, seg in enumerate(self.segments)
            for name in seg.node_names
        ]
        return pandas.DataFrame(rows, columns=["segment", "node", "selective"])
