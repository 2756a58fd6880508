"""Where the gap between `--target h100` on CPU kernels and the H100 came from: each GPU rule off.

For each profile in ``tests/data/h100/``, the model is profiled on fake tensors for the
H100 (as ``benchmarks/target_accuracy.py`` does) once with every rule of
:mod:`profiling.gpu_rules` switched off (the CPU's kernels) and once with each rule off alone,
and the predicted unoptimized peak is set beside the one measured on the H100. Five fake
profiles per model: about five minutes for the six on a 2-core machine.

    python benchmarks/target_ablation.py [--models gpt2_gpu ...] [--docs]
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent))

from publish import markdown_table, publish_doc  # noqa: E402
from target_accuracy import MIB, MODELS, fake_profile, measured_points  # noqa: E402

from planner.core.costgraph import protect_reads_before_writes  # noqa: E402
from planner.core.simulate import simulate  # noqa: E402

#: each GPU rule, switched off alone (``None``: all of them)
RULES = {"no GPU rules (CPU kernels)": None, "without the attention rule": "_ATTENTION",
         "without the dropout rule": "_DROPOUT", "without allocator rounding": "rounding",
         "without reduction scratch": "scratch"}


def ablation_rows(models: list[str], target: str = "h100") -> list[list[str]]:
    """The unoptimized peak's error against the H100's with each GPU rule off in turn: where the
    gap between CPU kernels and the GPU's comes from."""
    import profiling.fake_mode as fake_mode_module
    import profiling.profile as profile_module
    from profiling.gpu_rules import GpuKernels

    table = []
    for name in models:
        measured = int(measured_points(name)["unoptimized_peak_bytes"])
        row = [name]
        for rule in RULES.values():
            patches = []
            if rule is None:
                patches.append(mock.patch.object(profile_module, "target_kernels", lambda _t: contextlib.nullcontext()))
                patches.append(mock.patch.object(profile_module, "target_storages", lambda s, _t: tuple(s)))
            elif rule == "rounding":
                patches.append(mock.patch.object(profile_module, "target_storages", lambda s, _t: tuple(s)))
            elif rule == "scratch":
                patches.append(mock.patch.object(fake_mode_module, "kernel_scratch_bytes", lambda *_a, **_k: 0))
            else:
                patches.append(mock.patch.object(GpuKernels, rule, ()))
            with contextlib.ExitStack() as stack:
                for patch in patches:
                    stack.enter_context(patch)
                predicted = simulate(protect_reads_before_writes(fake_profile(name, target))).peak_bytes
            row.append(f"{predicted / MIB:,.0f} ({100 * (predicted / measured - 1):+.1f} %)")
        table.append(row)
        logging.info("%s", row)
    return table


def ablation_markdown(table: list[list[str]]) -> str:
    header = ["profile", *(f"unoptimized peak, {label} (MiB, error)" for label in RULES)]
    return markdown_table(header, table)


ABLATION_ABOUT = """Each column profiles the model on fake tensors for the H100 with one of the
rules of `profiling.gpu_rules` switched off (the first column: all of them, so the CPU's kernels
decide what is saved and no kernel's scratch is counted), and gives the predicted unoptimized
peak with its error against the peak measured on the H100. *Reduction scratch* is the staging
buffer of a `sum` split across thread blocks (a bias gradient's, `kernel_scratch_bytes`). The full table with all
rules on is [target_accuracy.md](target_accuracy.md)."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", choices=MODELS, default=MODELS)
    parser.add_argument("--target", default="h100")
    parser.add_argument("--docs", action="store_true", help="also write docs/benchmarks/target_ablation.md")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for noisy in ("planner", "profiling", "transformers"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    text = ablation_markdown(ablation_rows(args.models, args.target))
    sys.stdout.write(text)
    if args.docs:
        publish_doc(text, "target_ablation", sys.argv, about=ABLATION_ABOUT,
                    title="Where the gap between CPU kernels and the H100 came from (--target h100)")


if __name__ == "__main__":
    main()
