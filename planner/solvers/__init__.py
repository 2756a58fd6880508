"""The solvers: the strategy (``solve``) and the searches, stage models and candidates it uses."""
