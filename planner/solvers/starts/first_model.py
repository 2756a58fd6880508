"""The first start: the stage model on ``max_stages`` stages, solved at the budget and, by the
chain DP, at targets raised above it (the model's account is conservative).

Example:
    >>> from planner.core.costgraph import CostGraph, CostNode, Storage
    >>> from planner.core.options import SolveOptions
    >>> from planner.solvers.context import SolveContext
    >>> nodes = [CostNode("x", "placeholder", kind="input", output_storages=(0,))]
    >>> for i in range(1, 9):
    ...     nodes.append(CostNode(f"n{i}", "relu", input_names=(nodes[-1].name,), output_storages=(i,),
    ...                           saved_storages=(i,), output_bytes=2**20, requires_grad=True, time_ms=1.0))
    >>> g = CostGraph(tuple(nodes), tuple(Storage(i, 2**20, i == 0) for i in range(9)), ("n8",))
    >>> first = run(SolveContext.begin(g, 9 * 2**20, SolveOptions()))
    >>> first.plan.predicted_peak_bytes <= 9 * 2**20
    True
"""

from __future__ import annotations

from planner.core.stages import build_stages
from planner.solvers.context import FirstModel, SolveContext
from planner.solvers.stage_model import build_stage_model
from planner.solvers.stage_plans import loosened_plan, tightened_plan

__all__ = ["run", "FIRST_ILP_NODES"]

#: Branch-and-bound nodes of the first ILP, on ``max_stages`` stages (docs/tuning.md#first_ilp_nodes).
FIRST_ILP_NODES = 200


def run(ctx: SolveContext) -> FirstModel:
    """The first stage model and its plans. ``raised`` is solved here, with the model, because
    the finer rounds start from it where the model finds no plan at the budget itself."""
    options = ctx.options
    stages = build_stages(ctx.graph, options.max_stages)
    model = build_stage_model(ctx.graph, stages, max_segment_stages=len(stages), selective=options.selective)
    plan = tightened_plan(ctx.graph, model, ctx.budget_bytes, ctx.unoptimized_bytes, options.solver,
                          options.time_limit_s, options.max_attempts, ctx.started, node_limit=FIRST_ILP_NODES,
                          node_limit_needs_plan=True, by_chain_dp=ctx.by_chain_dp)
    by_dp = ctx.by_chain_dp and (plan is None or plan.by_chain_dp)  # not where the DP was too large
    raised = loosened_plan(ctx.graph, model, plan, ctx.budget_bytes, ctx.unoptimized_bytes, ctx.started) \
        if by_dp else plan
    return FirstModel(stages, model, plan, raised)
