"""PyTorch Lightning with the planner: a callback plans the LightningModule's inner model; the
same losses and weights as without it, bit for bit; checkpoints save, load and resume."""

from __future__ import annotations

import pytest
import torch

pl = pytest.importorskip("pytorch_lightning")
transformers = pytest.importorskip("transformers")

from planner.integrations.inplace import is_enabled, plan_of  # noqa: E402
from planner.integrations.lightning import PlannerCallback  # noqa: E402

FAST = {"timing_repeats": 1, "max_stages": 12}


class LitGPT(pl.LightningModule):
    """A tiny GPT-2 language model trained by Lightning; keeps its per-step losses."""

    def __init__(self) -> None:
        super().__init__()
        config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=1000, n_positions=64,
                                         use_cache=False, bos_token_id=0, eos_token_id=0)
        torch.manual_seed(0)
        self.model = transformers.GPT2LMHeadModel(config)
        self.losses: list[torch.Tensor] = []

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.model(**batch).loss
        self.losses.append(loss.detach())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def loader() -> torch.utils.data.DataLoader:
    ids = torch.randint(0, 1000, (16, 32), generator=torch.Generator().manual_seed(1))
    rows = [{"input_ids": row, "labels": row} for row in ids]
    return torch.utils.data.DataLoader(rows, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(2))


def fit(root, callbacks=(), max_steps: int = 4, ckpt_path=None, module=None):
    module = LitGPT() if module is None else module
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=str(root), callbacks=list(callbacks))
    torch.manual_seed(3)  # dropout
    trainer.fit(module, loader(), ckpt_path=ckpt_path)
    return trainer, module


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    options = {**FAST, "cache_dir": str(tmp_path_factory.mktemp("profiles"))}
    _, plain = fit(tmp_path_factory.mktemp("plain"))
    root = tmp_path_factory.mktemp("planned")
    trainer, planned = fit(root, [PlannerCallback(budget_fraction=0.8, **options)])
    return plain, planned, trainer, root, options


def test_the_callback_plans_the_inner_model_and_trains_bit_for_bit(runs):
    plain, planned, _, _, _ = runs
    assert is_enabled(planned.model) and not is_enabled(planned)
    assert type(planned.model) is transformers.GPT2LMHeadModel
    assert plan_of(planned.model).segments
    assert len(planned.losses) == 4 and all(torch.equal(a, b) for a, b in zip(planned.losses, plain.losses))
    for (name, a), b in zip(planned.state_dict().items(), plain.state_dict().values()):
        assert torch.equal(a, b), name


def test_checkpoints_save_load_and_resume(runs, tmp_path):
    _, planned, trainer, root, options = runs
    saved = sorted(root.rglob("*.ckpt"))
    assert saved, "Lightning's ModelCheckpoint wrote a checkpoint"
    back = LitGPT.load_from_checkpoint(str(saved[-1]))
    assert back.state_dict().keys() == planned.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), planned.state_dict().values()))
    manual = tmp_path / "manual.ckpt"
    trainer.save_checkpoint(str(manual))
    resumed_trainer, resumed = fit(tmp_path, [PlannerCallback(budget_fraction=0.8, **options)], max_steps=6,
                                   ckpt_path=str(manual))
    assert resumed_trainer.global_step == 6 and len(resumed.losses) == 2
    assert is_enabled(resumed.model) and plan_of(resumed.model) is not None
    assert all(torch.isfinite(loss) for loss in resumed.losses)


def test_a_missing_submodule_is_named():
    from planner import InputError

    with pytest.raises(InputError, match="no submodule 'backbone'"):
        PlannerCallback(budget_gb=1.0, submodule="backbone").on_fit_start(None, LitGPT())
