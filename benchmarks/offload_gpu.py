"""Offload to pinned host memory measured on a GPU: peak and step time against keeping everything
and checkpointing every layer.

On GPT-2 and Llama at the sizes of the H100 profiles (``tests/data/h100/README.md``), each step
run four ways, one process, interleaved repeats (median step-time ratio to keeping everything),
the peak from ``torch.cuda.max_memory_allocated`` over one warm step:

- *keep all*: the model as it is;
- *every layer*: each layer under ``torch.utils.checkpoint`` (HF's gradient checkpointing);
- *every layer, inputs offloaded*: the same, with each layer's saved input moved to pinned host
  memory (:meth:`rewrite.offload.HostOffload.offload_modules`: what HF/Accelerate's
  ``save_on_cpu`` around gradient checkpointing does, on side streams, one layer ahead);
- *first half offloaded, rest every layer*: the first half of the layers run without
  checkpoint with everything they save offloaded, the second half checkpointed: a plan of the
  kind the offload start chooses, where the early layers' copies have the longest to hide.

Gradients of every variant are compared with keeping everything (same seed each step: dropout
draws the same numbers). A second table plans each model on this device: captured, profiled,
solved at checkpoint-every-layer's simulated peak with recompute only and with offload
(``solve(..., offload=True)`` over the host link ``--link``), each plan applied to
the captured graph (:func:`rewrite.offload.apply_offload`) and measured: peak against budget and
prediction, step time against the captured graph with nothing recomputed and against the
prediction. ``--device cpu --tiny`` runs the same code on small models (no streams: a smoke
test, no figures worth reading).

    python benchmarks/offload_gpu.py [--device cuda] [--repeats 5] [--docs]
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from common import checkpoint_every_k, find_layers, publish_doc, step_time_ratios  # noqa: E402
from publish import markdown_table  # noqa: E402
from examples.models import gpt2, llama  # noqa: E402
from profiling import StepInputs, TrainingStep, run_step  # noqa: E402
from planner.core.costgraph import protect_reads_before_writes  # noqa: E402
from planner.core.offload import HOST_LINKS  # noqa: E402
from planner.core.plan import Plan  # noqa: E402
from planner.core.simulate import simulate  # noqa: E402
from planner.solvers.hand_policies import hand_placed_plans  # noqa: E402
from planner.solvers.solve import solve  # noqa: E402
from profiling import profile_graph, trace_module  # noqa: E402
from rewrite.apply import CheckpointedModule, apply_plan  # noqa: E402
from rewrite.offload import HostOffload, apply_offload  # noqa: E402

log = logging.getLogger("benchmarks.offload_gpu")

#: the builders and sizes of the H100 profiles gpt2_gpu and llama_gpu, and small ones for --tiny
MODELS: dict[str, tuple[Callable[..., Any], dict[str, int], dict[str, int]]] = {
    "gpt2": (gpt2, dict(batch=8, seq_len=1024, layers=6, width=768, heads=12, vocab=50257),
             dict(batch=2, seq_len=32, layers=4, width=32, heads=2, vocab=128)),
    "llama": (llama, dict(batch=4, seq_len=1024, layers=6, width=1024, heads=16, vocab=32000),
              dict(batch=2, seq_len=32, layers=4, width=32, heads=2, vocab=128)),
}
GIB = 2**30


class _Offloaded(torch.nn.Module):
    """``model`` whose forward runs under ``offload``'s saved-tensor hooks."""

    def __init__(self, model: torch.nn.Module, offload: HostOffload) -> None:
        super().__init__()
        self.model = model
        self.offload = offload

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with self.offload.hooks():
            return self.model(*args, **kwargs)


def variants(model: torch.nn.Module, device: torch.device) -> dict[str, torch.nn.Module]:
    every = checkpoint_every_k(model, 1)
    boundaries = checkpoint_every_k(model, 1)
    offload = HostOffload(device)
    _, layers = find_layers(boundaries)
    offload.offload_modules([(str(k), layer) for k, layer in enumerate(layers)])
    late = checkpoint_every_k(model, 1)  # checkpoint every layer, then undo it on the first half
    _, late_layers = find_layers(late)
    half = len(late_layers) // 2
    for layer in late_layers[:half]:
        del layer.forward  # the instance attribute checkpoint_every_k set: back to the class's
    mixed_offload = HostOffload(device)
    mixed_offload.offload_modules([(str(k), layer) for k, layer in enumerate(late_layers[:half])])
    return {"keep all": model, "every layer": every,
            "every layer, inputs offloaded": _Offloaded(boundaries, offload),
            "first half offloaded, rest every layer": _Offloaded(late, mixed_offload)}


def _grads(module: torch.nn.Module, inputs: StepInputs) -> list[torch.Tensor]:
    module.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    run_step(module, inputs, TrainingStep())
    grads = [p.grad.detach().clone() for p in module.parameters() if p.grad is not None]
    module.zero_grad(set_to_none=True)
    return grads


def _peak_bytes(module: torch.nn.Module, inputs: StepInputs, device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    module.zero_grad(set_to_none=True)
    run_step(module, inputs, TrainingStep())  # warm: the pool and the allocator
    module.zero_grad(set_to_none=True)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    run_step(module, inputs, TrainingStep())
    torch.cuda.synchronize(device)
    module.zero_grad(set_to_none=True)
    return torch.cuda.max_memory_allocated(device)


def _built(name: str, device: torch.device, tiny: bool) -> tuple[torch.nn.Module, dict[str, Any], StepInputs]:
    """Model ``name`` at its benchmark (or ``tiny``) size on ``device`` in training mode, its
    example inputs there, and the step inputs made of them."""
    build, sizes, small = MODELS[name]
    model, example = build(**(small if tiny else sizes))
    model = model.to(device).train()
    example = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in example.items()}
    return model, example, StepInputs.from_example(example)


def rows(names: list[str], device: torch.device, repeats: int, tiny: bool) -> list[list[str]]:
    table = []
    for name in names:
        model, example, inputs = _built(name, device, tiny)
        modules = variants(model, device)
        reference = _grads(model, inputs)
        ratios = step_time_ratios(list(modules.values()), inputs, repeats, device=device)
        for (label, module), ratio in zip(modules.items(), ratios):
            grads = _grads(module, inputs)
            same = len(grads) == len(reference) and all(
                torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(grads, reference))
            offloaded = module.offload.packed_bytes if isinstance(module, _Offloaded) else 0
            peak = _peak_bytes(module, inputs, device)
            table.append([name, label, "n/a" if peak is None else f"{peak / GIB:.3f}", f"{offloaded / 2**20:.2f}",
                          f"{ratio:.3f}", "allclose" if same else "DIFFER"])
            log.info("%s", table[-1])
    return table


def _applied(model: torch.nn.Module, example: dict[str, Any], plan: Plan, device: torch.device) -> torch.nn.Module:
    gm = trace_module(model, example)
    if plan.offloaded:
        apply_offload(gm, plan, HostOffload(device))
    return CheckpointedModule(apply_plan(gm, plan), model, plan)


def planned_rows(names: list[str], device: torch.device, repeats: int, tiny: bool, link: str) -> list[list[str]]:
    """Plans made on this device, recompute only and with offload, predicted against measured."""
    table = []
    for name in names:
        model, example, inputs = _built(name, device, tiny)
        graph = protect_reads_before_writes(profile_graph(trace_module(model, example), example))
        every = next(p for p in hand_placed_plans(graph) if p.name == "every layer")
        budget = simulate(graph, every.segments).peak_bytes
        recompute = solve(graph, budget)
        offloaded = solve(graph, budget, offload=True, host_link=link)
        nothing = Plan(budget, simulate(graph).peak_bytes, simulate(graph).peak_bytes, (), graph.forward_ms,
                       graph.step_ms, graph.forward_flops, "nothing recomputed", 0.0)
        plans = {"nothing recomputed": nothing, "recompute only": recompute}
        if offloaded.offloaded:
            plans["with offload"] = offloaded
        modules = {label: _applied(model, example, plan, device) for label, plan in plans.items()}
        reference = _grads(model, inputs)
        ratios = step_time_ratios(list(modules.values()), inputs, repeats, device=device)
        for (label, plan), module, ratio in zip(plans.items(), modules.values(), ratios):
            grads = _grads(module, inputs)
            same = len(grads) == len(reference) and all(
                torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(grads, reference))
            peak = _peak_bytes(module, inputs, device)
            table.append([name, label, f"{budget / GIB:.3f}", f"{plan.predicted_peak_bytes / GIB:.3f}",
                          "n/a" if peak is None else f"{peak / GIB:.3f}", f"{plan.offloaded_bytes / GIB:.3f}",
                          f"{1 + plan.overhead_ratio:.3f}", f"{ratio:.3f}", "allclose" if same else "DIFFER"])
            log.info("%s", table[-1])
    return table


def planned_markdown(table: list[list[str]]) -> str:
    header = ["model", "plan", "budget (GiB)", "predicted peak (GiB)", "measured peak (GiB)", "offloaded (GiB)",
              "predicted step / nothing recomputed", "measured step / nothing recomputed", "gradients vs the model"]
    return markdown_table(header, table)


def markdown(table: list[list[str]]) -> str:
    header = ["model", "variant", "measured peak (GiB)", "offloaded (MiB)", "step time / keep all",
              "gradients vs keep all"]
    return markdown_table(header, table)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", choices=sorted(MODELS), default=sorted(MODELS))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tiny", action="store_true", help="small models (a smoke test)")
    parser.add_argument("--link", choices=sorted(HOST_LINKS), default="h100", help="host link the plans assume")
    parser.add_argument("--no-planned", action="store_true", help="skip the planned table")
    parser.add_argument("--docs", action="store_true", help="also write docs/benchmarks/offload_cuda.md")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    device = torch.device(args.device)
    table: list[list[str]] = []
    planned: list[list[str]] = []
    for name in args.models:  # the page is written after each model: a time box cut short keeps the rest
        table += rows([name], device, args.repeats, args.tiny)
        if not args.no_planned:
            planned += planned_rows([name], device, args.repeats, args.tiny, args.link)
        text = markdown(table) + ("\n" + planned_markdown(planned) if planned else "")
        if args.docs:
            publish_doc(text, "offload_cuda", sys.argv if argv is None else ["benchmarks/offload_gpu.py", *argv],
                        title="Offload to host memory, measured on a GPU", about=__doc__.split("\n\n")[1])
    sys.stdout.write(text)
    return 0 if all(row[-1] == "allclose" for row in (*table, *planned)) else 1


if __name__ == "__main__":
    sys.exit(main())
