"""Turn a plan into a module: each recomputed segment runs under ``torch.utils.checkpoint``."""

from rewrite.apply import apply_plan

__all__ = ["apply_plan"]
