"""Lower bounds on the recompute any plan needs at a budget."""
