"""What the solver decided: the segments to recompute and what that costs.

Example:
    >>> p = Plan(budget_bytes=2**30, predicted_peak_bytes=2**29, unoptimized_peak_bytes=2**30,
    ...          segments=(Segment(("relu", "mul"), recompute_ms=1.5, recompute_flops=0),),
    ...          forward_ms=10.0, step_ms=30.0, forward_flops=100, solver="HiGHS", solve_s=0.1)
    >>> p.recompute_ms, p.recomputed_nodes
    (1.5, ('relu', 'mul'))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    import pandas

__all__ = ["Segment", "Plan"]

GIB = 2**30


@dataclass(frozen=True)
class Segment:
    """A contiguous run of nodes run under one ``torch.utils.checkpoint`` call.

    A selective segment keeps the outputs of ``kept_nodes`` from the forward, under a selective
    checkpoint policy, and recomputes only the rest (:mod:`planner.keep` chooses them).
    ``skipped_nodes`` are the nodes the recompute never runs: it stops once the last tensor
    the segment saved is saved again (:mod:`planner.rerun`). ``recompute_ms`` and
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

    ``predicted_peak_bytes`` comes from :func:`planner.simulate.simulate`; ``step_ms`` is the
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
    #: transformations of the captured graph that make it compute other than the user's module
    #: (each asked for by name, e.g. ``simplify_attention_masks``); empty: the user's computation
    computation_changes: tuple[str, ...] = ()

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
        return tuple(name for s in self.segments for name in s.node_names
                     if name not in s.kept_nodes and name not in s.skipped_nodes)

    @property
    def overhead_ratio(self) -> float:
        """Predicted extra step time as a fraction of the unoptimized step."""
        return self.recompute_ms / self.step_ms if self.step_ms > 0 else 0.0

    def summary(self) -> str:
        """A few lines a person can read: budget, peaks, what is recomputed, the cost."""
        lines = [
            f"budget            {self.budget_bytes / GIB:9.4f} GiB",
            f"unoptimized peak  {self.unoptimized_peak_bytes / GIB:9.4f} GiB (predicted)",
            f"planned peak      {self.predicted_peak_bytes / GIB:9.4f} GiB (predicted, "
            f"{self.predicted_peak_bytes / max(self.unoptimized_peak_bytes, 1):.0%} of unoptimized)",
            f"recomputed        {len(self.recomputed_nodes)} nodes in {len(self.segments)} segments",
            f"extra time        {self.recompute_ms:.2f} ms per step (~{self.overhead_ratio:.1%} of a "
            f"{self.step_ms:.1f} ms step)",
            f"extra FLOPs       {self.recompute_flops:.3e} ({self.recompute_flops / max(self.forward_flops, 1):.1%} "
            f"of the forward)",
            f"solver            {self.solver}, {self.solve_s:.2f} s{self._solver_note()}",
        ]
        lines.extend(f"computation       CHANGED: {change}" for change in self.computation_changes)
        for k, seg in enumerate(self.segments):
            lines.append(
                f"  segment {k}: {seg.node_names[0]} .. {seg.node_names[-1]} "
                f"({len(seg.node_names)} nodes, {seg.recompute_ms:.2f} ms"
                f"{f', {len(seg.kept_nodes)} outputs kept' if seg.selective else ''})"
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
