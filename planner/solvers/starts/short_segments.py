"""Start: short segments on many stages, then finer rounds, one solve a shape
(:func:`planner.solvers.stage_plans.short_segment_shapes`); first, on a model of repeated blocks
whose first stages each span several blocks, a shape that resolves every block.

On a deep graph the first stages each span a layer or more, and their plan is a few segments of
several layers that the finer rounds cannot break up; short segments on many stages end inside
the layers. They run where the first model found no plan too: near the smallest peak its
stages can miss a budget that many stages meet."""

from __future__ import annotations

import logging

from planner.core.plan import Plan
from planner.solvers.chain_dp import DEFAULT_MAX_LABELS
from planner.solvers.context import SolveContext, cheapest
from planner.solvers.finer_rounds import on_finer_stages
from planner.solvers.hand_policies import repeated_blocks
from planner.solvers.stage_plans import short_segment_shapes, short_segments_plan

__all__ = ["run", "shapes_of", "projected_labels", "STAGES_PER_REPEATED_BLOCK", "PER_BLOCK_START_MAX_STAGES",
           "MIN_STAGES_PER_REPEATED_BLOCK", "PER_BLOCK_ROUND_MAX_CANDIDATES", "LABEL_GROWTH_EXPONENT"]

log = logging.getLogger("planner.solvers.solve")  # every module of a solve logs as planner.solvers.solve

#: Stages per repeated block of the start that resolves each block (docs/tuning.md#stages_per_repeated_block).
STAGES_PER_REPEATED_BLOCK = 16
#: At most this many stages in that start: deeper models get fewer a block, down to
#: :data:`MIN_STAGES_PER_REPEATED_BLOCK` (docs/tuning.md#per_block_start_max_stages).
PER_BLOCK_START_MAX_STAGES = 512
#: Fewest stages a block of the per-block start (docs/tuning.md#per_block_start_max_stages).
MIN_STAGES_PER_REPEATED_BLOCK = 8
#: Most candidate segments of the first finer round after the per-block start, the one round
#: that may go past half the compute nodes (docs/tuning.md#per_block_round_max_candidates).
PER_BLOCK_ROUND_MAX_CANDIDATES = 24_000
#: The chain DP's labels on a graph grow about as the square of its stage count: a shape whose
#: count, projected from a solved shape of fewer stages, passes the DP's cap is not solved
#: (docs/tuning.md#label_growth_exponent).
LABEL_GROWTH_EXPONENT = 2.0


def projected_labels(solved_stages: int, solved_labels: int, stage_count: int) -> int:
    """The labels the chain DP is expected to keep on ``stage_count`` stages of a graph whose
    model of ``solved_stages`` stages kept ``solved_labels`` (:data:`LABEL_GROWTH_EXPONENT`).

    Example:
        >>> projected_labels(256, 800_000, 1024)
        12800000
    """
    return int(solved_labels * (stage_count / solved_stages) ** LABEL_GROWTH_EXPONENT)


def shapes_of(ctx: SolveContext) -> tuple[list[tuple[int, int]], bool]:
    """The (stage count, most stages a segment spans) of each short-segment solve, in order,
    and whether the first is the per-block shape."""
    shapes = short_segment_shapes(len(ctx.graph.compute_nodes), ctx.options.max_stages, finest=ctx.by_chain_dp)
    blocks = sum(len(stack) for stack in repeated_blocks(ctx.graph))
    stages_a_block = max(MIN_STAGES_PER_REPEATED_BLOCK,
                         min(STAGES_PER_REPEATED_BLOCK, PER_BLOCK_START_MAX_STAGES // max(blocks, 1)))
    assert ctx.first is not None, "the first stage model is solved before the other starts"
    per_block = bool(ctx.by_chain_dp and blocks and stages_a_block * blocks > len(ctx.first.stages))
    if per_block:
        shapes.insert(0, (stages_a_block * blocks, 2 * stages_a_block))
    return shapes, per_block


def run(ctx: SolveContext) -> Plan | None:
    """The cheapest plan of the short-segment shapes (segments-only solves), each improved by
    finer rounds; the per-block shape's first round may go to the node
    (:data:`PER_BLOCK_ROUND_MAX_CANDIDATES`), where other shapes' rounds stop at half the nodes."""
    options = ctx.options
    if not (options.finer_s > 0 and options.finer_rounds > 0) or not options.short_segments or options.selective:
        return None
    shapes, per_block = shapes_of(ctx)
    plans: list[Plan | None] = []
    solved: tuple[int, int] | None = None  # (stages, labels) of the largest shape the DP solved
    for index, (stage_count, max_segment_stages) in enumerate(shapes):
        if not ctx.deadline.allows(f"the short segments on {stage_count} stages"):
            break
        if solved is not None and stage_count > solved[0] and \
                projected_labels(*solved, stage_count) > DEFAULT_MAX_LABELS:
            log.info("short segments on %d stages skipped: about %d labels projected from %d on %d stages, "
                     "past the chain DP's %d", stage_count, projected_labels(*solved, stage_count), solved[1],
                     solved[0], DEFAULT_MAX_LABELS)
            continue
        short, short_stages = short_segments_plan(ctx.graph, stage_count, max_segment_stages, ctx.budget_bytes,
                                                  ctx.unoptimized_bytes, options.solver,
                                                  ctx.deadline.cut(ctx.finer_limit_s), options.max_attempts,
                                                  ctx.started, ctx.by_chain_dp)
        if short is not None and short.chain_labels and (solved is None or short_stages > solved[0]):
            solved = (short_stages, short.chain_labels)
        round_cap = PER_BLOCK_ROUND_MAX_CANDIDATES if per_block and index == 0 else None
        if short is not None and ctx.deadline.allows(f"the finer rounds after {short_stages} stages"):
            short = on_finer_stages(ctx.graph, short, short_stages, ctx.budget_bytes, ctx.unoptimized_bytes,
                                    selective=False, solver=options.solver,
                                    time_limit_s=ctx.deadline.cut(ctx.finer_limit_s),
                                    max_attempts=options.max_attempts, started=ctx.started,
                                    rounds=options.finer_rounds, every_round_capped=round_cap is None,
                                    first_round_max_candidates=round_cap, by_chain_dp=ctx.by_chain_dp)
        plans.append(short)
    return cheapest(plans)
