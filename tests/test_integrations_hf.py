"""The HuggingFace Trainer with the planner: one callback, the same loss curve and weights bit for
bit, ``save_model`` / ``from_pretrained``, and resuming from a checkpoint."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from planner.integrations.hf import PlannerCallback  # noqa: E402
from planner.integrations.inplace import checkpointed_module_of, is_enabled, plan_of  # noqa: E402

FAST = {"timing_repeats": 1, "max_stages": 12}
STEPS = 4


class TokenDataset(torch.utils.data.Dataset):
    """16 random sequences of 32 tokens, labels = inputs (causal LM)."""

    def __init__(self, vocab: int = 1000, rows: int = 16, seq_len: int = 32) -> None:
        generator = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, vocab, (rows, seq_len), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def tiny_gpt2():
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=1000, n_positions=64,
                                     use_cache=False, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).train()


def train(output_dir, callbacks=(), resume_from=None, model=None):
    """``STEPS`` steps of a default Trainer (batch 4, a checkpoint every 2 steps); the model and
    its per-step losses."""
    model = tiny_gpt2() if model is None else model
    args = transformers.TrainingArguments(output_dir=str(output_dir), report_to="none", use_cpu=True, max_steps=STEPS,
                                          per_device_train_batch_size=4, logging_steps=1, save_steps=2,
                                          disable_tqdm=True, seed=0)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=TokenDataset(), callbacks=list(callbacks))
    trainer.train(resume_from_checkpoint=resume_from)
    losses = {entry["step"]: entry["loss"] for entry in trainer.state.log_history if "loss" in entry}
    return trainer, losses


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    assert all(torch.equal(sa[k], sb[k]) for k in sa), [k for k in sa if not torch.equal(sa[k], sb[k])]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    options = {**FAST, "cache_dir": str(tmp_path_factory.mktemp("profiles"))}
    plain, plain_losses = train(tmp_path_factory.mktemp("plain"))
    planned_dir = tmp_path_factory.mktemp("planned")
    planned, planned_losses = train(planned_dir, [PlannerCallback(budget_fraction=0.8, **options)])
    return plain, plain_losses, planned, planned_losses, planned_dir, options


def test_one_callback_plans_the_trainers_model_and_trains_bit_for_bit(runs):
    plain, plain_losses, planned, planned_losses, _, _ = runs
    model = planned.model
    assert type(model) is transformers.GPT2LMHeadModel and is_enabled(model)
    plan = plan_of(model)
    assert plan is not None and plan.segments and plan.predicted_peak_bytes <= plan.budget_bytes
    # planned on the batch as the Trainer passes it, num_items_in_batch included
    assert any("num_items_in_batch" in name for name in checkpointed_module_of(model).plans), \
        list(checkpointed_module_of(model).plans)
    assert sorted(planned_losses) == list(range(1, STEPS + 1))
    assert planned_losses == plain_losses
    assert_same_weights(planned.model, plain.model)


def test_save_model_and_from_pretrained(runs, tmp_path):
    _, _, planned, _, _, _ = runs
    planned.save_model(str(tmp_path / "saved"))
    back = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "saved"))
    assert_same_weights(back, planned.model)
    assert back.lm_head.weight is back.transformer.wte.weight
    assert not is_enabled(back)


def test_resuming_from_a_checkpoint_continues_the_same_curve(runs, tmp_path):
    plain, plain_losses, _, _, planned_dir, options = runs
    checkpoint = planned_dir / "checkpoint-2"
    assert (checkpoint / "model.safetensors").exists()
    resumed, losses = train(tmp_path, [PlannerCallback(budget_fraction=0.8, **options)], resume_from=str(checkpoint))
    assert is_enabled(resumed.model)
    assert {step: losses[step] for step in (3, 4)} == {step: plain_losses[step] for step in (3, 4)}
    assert_same_weights(resumed.model, plain.model)


def test_evaluation_matches_the_unplanned_trainer(runs):
    plain, _, planned, _, _, _ = runs
    ours, theirs = planned.evaluate(TokenDataset(rows=8)), plain.evaluate(TokenDataset(rows=8))
    assert ours["eval_loss"] == theirs["eval_loss"] > 0
