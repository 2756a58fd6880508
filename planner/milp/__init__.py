"""MILP plumbing: HiGHS as the planner runs it, and PuLP's import side effects."""
