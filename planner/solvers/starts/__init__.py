"""The starts of a solve: each one module, each a way to a plan for the budget.

:func:`planner.solvers.solve.solve` solves the first stage model (:mod:`.first_model`), runs
every start of :data:`planner.solvers.solve.STARTS` in order on the same
:class:`planner.solvers.context.SolveContext`, lets the exact search (:mod:`.exact_search`) look
for a cheaper plan, and keeps the cheapest plan whose simulated peak fits; the earlier start
wins a tie. Adding a start is one module with a ``run(ctx) -> Plan | None`` and one line in
that list (docs/design.md#adding-a-start). With ``offload``, the offload step (:mod:`.offload`)
runs last, on the plan chosen.
"""
