"""Accelerate with the planner: ``accelerator.prepare`` of a model planned in place, its optimizer
and loader, gradient accumulation over two micro-batches, losses and weights bit for bit."""

from __future__ import annotations

import pytest
import torch

accelerate = pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")

from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402

from planner import enable  # noqa: E402
from planner.integrations.inplace import checkpointed_module_of, plan_of  # noqa: E402

FAST = {"timing_repeats": 1, "max_stages": 12}


def tiny_gpt2():
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=1000, n_positions=64,
                                     use_cache=False, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).train()


def token_batches(rows: int = 16, seq_len: int = 32) -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(0, 1000, (rows, seq_len), generator=torch.Generator().manual_seed(1))
    return [{"input_ids": row, "labels": row} for row in ids]


def train(planned: bool, cache_dir: str):
    """Two epochs of 4 micro-batches of 4, accumulating 2 per optimizer step; the model, its
    per-micro-batch losses and the module Accelerate handed back."""
    model = tiny_gpt2()
    example = {"input_ids": torch.zeros(4, 32, dtype=torch.long), "labels": torch.zeros(4, 32, dtype=torch.long)}
    if planned:
        enable(model, example, budget_fraction=0.8, cache_dir=cache_dir, **FAST)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(token_batches(), batch_size=4, shuffle=True,
                                         generator=torch.Generator().manual_seed(2))
    prepared, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    torch.manual_seed(3)  # dropout
    losses = []
    try:
        for _ in range(2):
            for batch in loader:
                with accelerator.accumulate(prepared):
                    loss = prepared(**batch).loss
                    accelerator.backward(loss)
                    optimizer.step()
                    optimizer.zero_grad()
                losses.append(loss.item())
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    return model, losses, prepared


def test_accelerate_trains_a_planned_model_bit_for_bit_with_accumulation(tmp_path):
    plain, plain_losses, _ = train(planned=False, cache_dir=str(tmp_path))
    model, losses, prepared = train(planned=True, cache_dir=str(tmp_path))
    assert prepared is model  # one process on CPU: Accelerate keeps the model object
    assert plan_of(model).segments
    # the second micro-batch of each step runs with the first one's gradients held
    assert any("grads held" in name for name in checkpointed_module_of(model).plans)
    assert len(losses) == 8 and losses == plain_losses
    for (name, a), b in zip(model.state_dict().items(), plain.state_dict().values()):
        assert torch.equal(a, b), name
