"""Measure the training-step peak of the recipes' models before and after ``planner.enable``.

    .venv/bin/python benchmarks/recipe_peaks.py            # about a minute on a laptop CPU

For each model: the unoptimized step measured at the allocator
(:func:`profiling.measure.measure_step_peak_bytes`: torch.profiler's memory events, parameters,
gradients, activations and temporaries of one forward plus backward), then the same model
object after ``planner.enable(model, batch, budget_fraction=...)``, measured the same way
(its training forward now runs the plan). The HF Trainer, Accelerate and Lightning recipes train
the full GPT-2 below; the PEFT recipe its LoRA version.
"""

from __future__ import annotations

import logging

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from planner import enable
from planner.integrations.inplace import plan_of
from profiling.measure import StepInputs, measure_step_peak_bytes

MIB = 2**20


def gpt2(n_layer: int, n_embd: int, vocab: int) -> GPT2LMHeadModel:
    config = GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=4, vocab_size=vocab, n_positions=256, use_cache=False,
                        bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return GPT2LMHeadModel(config).train()


def lora(model: GPT2LMHeadModel) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=8, target_modules=["c_attn", "c_fc"], fan_in_fan_out=True,
                                            task_type="CAUSAL_LM"))


def row(name: str, model: torch.nn.Module, batch: dict[str, torch.Tensor], fraction: float) -> str:
    inputs = StepInputs.from_example(batch)
    before = measure_step_peak_bytes(model, inputs)
    enable(model, batch, budget_fraction=fraction, timing_repeats=1)
    after = measure_step_peak_bytes(model, inputs)
    plan = plan_of(model)
    assert plan is not None
    return (f"| {name} | {before / MIB:.1f} MiB | {plan.budget_bytes / MIB:.1f} MiB ({fraction:.0%}) | "
            f"{after / MIB:.1f} MiB ({after / before:.3f}) | {len(plan.segments)} |")


def main() -> None:
    logging.basicConfig(level=logging.WARNING)
    torch.manual_seed(1)
    ids = torch.randint(0, 2000, (8, 128))
    batch = {"input_ids": ids, "labels": ids}
    print("| model, batch 8 x 128 tokens | unoptimized peak | budget | planned peak (ratio) | segments |")
    print("|---|---|---|---|---|")
    print(row("GPT-2 4 layers, width 128, vocab 2000 (Trainer, Accelerate, Lightning)", gpt2(4, 128, 2000), batch, 0.6))
    print(row("the same with LoRA r=8 on c_attn, c_fc (PEFT)", lora(gpt2(4, 128, 2000)), batch, 0.5))


if __name__ == "__main__":
    main()
