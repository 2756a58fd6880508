"""Draw a report: memory over the training step (unoptimized vs plan, budget line) and the
Pareto front of a sweep. Needs matplotlib (``pip install matplotlib``).

Example:
    >>> from planner.report import build_report  # doctest: +SKIP
    >>> plot_report(build_report(graph, plan), "report.png")  # doctest: +SKIP
"""

from __future__ import annotations

from pathlib import Path

from planner.core.errors import PlannerError
from planner.report import Report
from planner.core.units import MIB

__all__ = ["plot_report", "distinct_mib_labels"]



def _progress(timeline: tuple[tuple[str, str, int], ...]) -> tuple[list[float], list[float], float]:
    """x in [0, 1] over the step's events, y in MiB, and where backward starts."""
    n = max(len(timeline) - 1, 1)
    xs = [i / n for i in range(len(timeline))]
    ys = [b / MIB for _, _, b in timeline]
    backward = next((i / n for i, (phase, _, _) in enumerate(timeline) if phase != "forward"), 1.0)
    return xs, ys, backward


def distinct_mib_labels(values_mib: list[float], max_decimals: int = 6) -> list[str]:
    """The values with the fewest decimals (at least one) that tell different values apart, so
    that two peaks a legend compares never read the same.

    Example:
        >>> distinct_mib_labels([10.5, 10.0]), distinct_mib_labels([10.04, 10.01])
        (['10.5', '10.0'], ['10.04', '10.01'])
    """
    for decimals in range(1, max_decimals + 1):
        labels = [f"{v:.{decimals}f}" for v in values_mib]
        if len(set(labels)) == len(set(values_mib)):
            return labels
    return [f"{v:.{max_decimals}f}" for v in values_mib]


def plot_report(report: Report, path: str | Path) -> Path:
    """Write a PNG with memory over the step and, when the report has a sweep, the Pareto front."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlannerError("--plot needs matplotlib: pip install matplotlib") from None
    path = Path(path)
    panels = 2 if report.pareto else 1
    fig, axes = plt.subplots(1, panels, figsize=(6.5 * panels, 4.2), squeeze=False)
    ax = axes[0][0]
    curves = [(label, colour, *_progress(report.timelines[key].timeline))
              for label, key, colour in (("unoptimized", "unoptimized", "tab:blue"), ("plan", "plan", "tab:orange"))]
    peaks = distinct_mib_labels([max(ys, default=0.0) for _, _, _, ys, _ in curves])
    for (label, colour, xs, ys, backward), peak in zip(curves, peaks):
        ax.plot(xs, ys, color=colour, label=f"{label} (peak {peak} MiB)")
        ax.axvline(backward, color=colour, linestyle=":", linewidth=1)
    ax.text(0.99, 0.01, "dotted: backward starts", color="grey", ha="right", va="bottom",
            transform=ax.transAxes, fontsize=8)
    ax.axhline(report.plan.budget_bytes / MIB, color="red", linestyle="--", label="budget")
    ax.set_xlabel("progress through one training step (forward, recompute and backward ops)")
    ax.set_ylabel("live memory (MiB, predicted)")
    on = f" on {report.device}" if report.device else ""
    by = f" ({report.plan.capture} path)" if report.plan.capture != "graph" else ""
    ax.set_title(f"{report.model_name}{on}{by}: memory over the step")
    ax.set_ylim(bottom=0)
    ax.legend(loc="upper left", fontsize=8)
    if report.pareto:
        ax = axes[0][1]
        xs = [100 * p.overhead_ratio for p in report.pareto]
        ys = [p.predicted_peak_bytes / MIB for p in report.pareto]
        ax.plot(xs, ys, "o-", label="plans of the sweep")
        ax.plot([100 * report.plan.overhead_ratio], [report.plan.predicted_peak_bytes / MIB], "r*",
                markersize=12, label="plan at the budget")
        ax.set_xlabel("predicted extra step time (%)")
        ax.set_ylabel("predicted peak (MiB)")
        ax.set_title("memory / overhead Pareto front")
        ax.legend(fontsize=8)
    fig.tight_layout()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
    except OSError as exc:
        raise PlannerError(f"--plot {path} could not be written: {exc.strerror or exc}") from None
    finally:
        plt.close(fig)
    return path
