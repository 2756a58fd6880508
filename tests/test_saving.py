"""Every way a user saves the module ``optimize`` returns, on a model with tied embeddings: the
HF Trainer is refused before its first step (and the fix it names trains, saves and reloads),
``torch.save(opt)`` round-trips, ``save_pretrained`` is the model's own, safetensors, Accelerate
and Lightning save the model's tensors."""

from __future__ import annotations

import copy
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

from planner import InputError, enable, optimize  # noqa: E402
from planner.integrations.inplace import plan_of  # noqa: E402

FAST = {"timing_repeats": 1, "max_stages": 12}
BUDGET_GB = 0.0038  # 90 % of the tiny GPT-2's unoptimized peak (about 4.3 MiB): a plan with segments


def tied_gpt2() -> transformers.GPT2LMHeadModel:
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=1000, n_positions=64,
                                     use_cache=False, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).train()
    assert model.lm_head.weight is model.transformer.wte.weight
    return model


def batch(rows: int = 4) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 1000, (rows, 32), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids}


class Rows(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.ids = batch(16)["input_ids"]

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def trainer_for(model: torch.nn.Module, output_dir) -> transformers.Trainer:
    args = transformers.TrainingArguments(output_dir=str(output_dir), report_to="none", use_cpu=True, max_steps=2,
                                          per_device_train_batch_size=4, save_strategy="no", disable_tqdm=True, seed=0)
    return transformers.Trainer(model=model, args=args, train_dataset=Rows())


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return list(sa) == list(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.fixture(scope="module")
def options(tmp_path_factory):
    return {**FAST, "cache_dir": str(tmp_path_factory.mktemp("profiles"))}


@pytest.mark.parametrize("trace_method", ["export", "modules"])
def test_the_trainer_is_refused_before_its_first_step(tmp_path, options, trace_method):
    model = tied_gpt2()
    untouched = copy.deepcopy(model)
    opt = optimize(model, batch(), budget_gb=BUDGET_GB, trace_method=trace_method, **options)
    with pytest.raises(InputError) as refused:
        trainer_for(opt, tmp_path / "refused").train()
    message = str(refused.value)
    assert "\n" not in message and "planner.enable" in message and "PlannerCallback" in message, message
    assert same_weights(model, untouched)  # refused before any optimizer step


@pytest.mark.slow
def test_the_fix_the_refusal_names_trains_saves_and_reloads_tied_weights(tmp_path, options):
    # plan the model in place (on the Trainer's first batch): the Trainer saves it as its own
    model = tied_gpt2()
    untouched = copy.deepcopy(model)
    enabled = enable(model, budget_gb=BUDGET_GB, **options)
    trainer = trainer_for(enabled, tmp_path / "enabled")
    trainer.train()
    assert plan_of(enabled).segments and not same_weights(enabled, untouched)  # planned, and it trained
    trainer.save_model(str(tmp_path / "saved"))
    reloaded = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "saved"))
    assert reloaded.lm_head.weight is reloaded.transformer.wte.weight
    assert same_weights(reloaded, enabled)


def test_torch_save_round_trips_and_the_loaded_module_trains_bit_for_bit(tmp_path, options):
    model = tied_gpt2()
    opt = optimize(model, batch(), budget_gb=BUDGET_GB, **options)
    assert opt.plan.segments
    torch.save(opt, tmp_path / "opt.pt")
    loaded = torch.load(tmp_path / "opt.pt", weights_only=False)
    assert loaded.plan == opt.plan and same_weights(loaded, opt)
    assert loaded.original.lm_head.weight is loaded.original.transformer.wte.weight
    eager = copy.deepcopy(loaded.original)
    torch.manual_seed(3)
    loaded(**batch()).loss.backward()  # captures the graph again (no profiling) and runs the plan
    torch.manual_seed(3)
    eager(**batch()).loss.backward()
    assert loaded.graph_module is not None and loaded.plans
    grads = dict(eager.named_parameters())
    assert all(torch.equal(p.grad, grads[name].grad) for name, p in loaded.named_parameters())


def test_save_pretrained_safetensors_and_accelerate_save_the_models_tensors(tmp_path, options):
    from safetensors.torch import load_model, save_model

    model = tied_gpt2()
    opt = optimize(model, batch(), budget_gb=BUDGET_GB, **options)
    opt.save_pretrained(str(tmp_path / "pretrained"))  # the model's own: config written, tied weights once
    assert {"config.json", "model.safetensors"} <= set(os.listdir(tmp_path / "pretrained"))
    assert same_weights(transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "pretrained")), model)
    with pytest.raises(AttributeError):
        optimize(torch.nn.Linear(4, 4), (torch.randn(2, 4),), budget_gb=1.0, **FAST).save_pretrained

    save_model(opt, str(tmp_path / "opt.safetensors"))  # safetensors' own way for tied weights
    other = tied_gpt2()
    torch.nn.init.zeros_(other.lm_head.weight)
    load_model(other, str(tmp_path / "opt.safetensors"))
    assert same_weights(other, model)

    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    prepared, _ = accelerator.prepare(opt, torch.optim.AdamW(model.parameters()))
    accelerator.save_state(str(tmp_path / "state"))
    saved = {name: p.detach().clone() for name, p in model.state_dict().items()}
    with torch.no_grad():
        model.lm_head.weight.zero_()
    accelerator.load_state(str(tmp_path / "state"))
    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())


@pytest.mark.slow
def test_a_lightning_checkpoint_of_an_optimized_model_reloads(tmp_path, options):
    pl = pytest.importorskip("pytorch_lightning")

    class Lit(pl.LightningModule):
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.model = inner

        def training_step(self, rows: dict[str, torch.Tensor], index: int) -> torch.Tensor:
            return self.model(**rows).loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    opt = optimize(tied_gpt2(), batch(), budget_gb=BUDGET_GB, **options)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=str(tmp_path))
    trained = Lit(opt)
    trainer.fit(trained, torch.utils.data.DataLoader(Rows(), batch_size=4))
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    fresh = Lit(tied_gpt2())
    fresh.load_state_dict(torch.load(tmp_path / "last.ckpt", weights_only=False)["state_dict"])
    assert same_weights(fresh.model, opt.original) and not same_weights(fresh.model, tied_gpt2())


def test_a_pickled_cost_graph_carries_no_derived_caches_and_one_that_does_drops_them_on_load():
    """A saved optimized module holds its profiles; the replay facts cached on them are the
    code's that computed them, so a graph is rebuilt without them by the code that loads it."""
    import pickle

    from planner.core.costgraph import CostGraph, CostNode, Storage
    from planner.core.simulate import simulate

    nodes = (CostNode("x", "placeholder", kind="input", output_storages=(0,)),
             CostNode("y", "relu", input_names=("x",), output_storages=(1,), saved_storages=(1,), output_bytes=8,
                      requires_grad=True))
    graph = CostGraph(nodes, (Storage(0, 8, True), Storage(1, 8)), ("y",))
    peak = simulate(graph).peak_bytes
    assert "replay_facts" in vars(graph) and "replay_facts" not in vars(pickle.loads(pickle.dumps(graph)))
    stale = CostGraph.__new__(CostGraph)
    stale.__setstate__({**vars(graph), "replay_facts": object(), "index": {}})   # as an older pickle holds them
    assert "replay_facts" not in vars(stale) and simulate(stale).peak_bytes == peak
