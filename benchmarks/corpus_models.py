"""A corpus of model families no one tuned the planner on: HuggingFace families built from tiny
configs (no downloads) and hand-written patterns.

Each :class:`Family` has a ``name``, a ``group`` (``causal-lm``, ``encoder``, ``seq2seq``,
``vision`` or ``pattern``), a builder returning ``(model, example_inputs)`` (the model in
training mode, built from a fixed seed, dropout on where the family has it, language models
given ``labels`` so the model computes its own loss), an optional ``loss_fn`` (output -> scalar:
the criterion of a loop that takes the loss outside the model) and ``every_layer(model)``, a
copy of the model with each layer checkpointed: HuggingFace's own
``gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})``
where the family supports it, a hand-written equivalent otherwise (non-reentrant
``torch.utils.checkpoint``, RNG state preserved).

Sizes are tiny (2 layers, width 64, 4 x 64 tokens, vocabulary 1024, 4 x 32 x 32 images): one CPU
training step takes milliseconds. A family whose class the installed transformers lacks is left
out of :data:`FAMILIES` at import and named in :data:`SKIPPED` with the reason.

    python benchmarks/corpus_models.py            # lists the families
    python benchmarks/corpus_models.py --run      # builds each, times a (second) forward + backward

Example:
    >>> family = FAMILIES["interleaved"]
    >>> model, inputs = family.build()
    >>> family.group, model.training
    ('pattern', True)
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
for _path in (ROOT, ROOT / "examples", ROOT / "benchmarks"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

__all__ = ["FAMILIES", "GROUPS", "SKIPPED", "Family", "hf_every_layer", "checkpoint_modules"]

GROUPS = ("causal-lm", "encoder", "seq2seq", "vision", "pattern")
from corpus_hf_specs import (ATTN_DROP, BATCH, HAND_LAYERS, HEADS, HF_SPECS, IMAGE, LAYERS, LLAMA_LIKE,  # noqa: E402,F401
                             MORE_HF_SPECS, SEED, SEQ, VOCAB, WIDTH, lm_inputs)


@dataclasses.dataclass(frozen=True)
class Family:
    """One model family of the corpus."""

    name: str
    group: str
    #: what is built, in a few words (for tables)
    about: str
    #: ``() -> (model, example_inputs)``: the model in training mode, from a fixed seed
    builder: Callable[[], tuple[nn.Module, Any]]
    #: ``model -> model``: a copy with every layer checkpointed
    every_layer: Callable[[nn.Module], nn.Module]
    #: output -> scalar loss, for a criterion outside the model; None: the output's ``loss``
    loss_fn: Callable[[Any], torch.Tensor] | None = None
    #: how ``every_layer`` checkpoints: ``"hf"`` (``gradient_checkpointing_enable``) or ``"hand"``
    anchor: str = "hf"

    def build(self, batch_scale: int = 1) -> tuple[nn.Module, Any]:
        """The model (training mode, seeded) and its example inputs; ``batch_scale`` repeats
        every input tensor that many times along its first (batch) dimension, for a step that
        takes longer (the criteria outside the models repeat their targets to match)."""
        model, example = self.builder()
        return model, _repeat_batch(example, batch_scale)

    def loss(self, output: Any) -> torch.Tensor:
        """The scalar one training step's backward starts from."""
        if self.loss_fn is not None:
            return self.loss_fn(output)
        from profiling.measure import loss_of

        return loss_of(output)


def _repeat_batch(example: Any, times: int) -> Any:
    def repeated(value: Any) -> Any:
        return torch.cat([value] * times) if isinstance(value, torch.Tensor) and value.dim() > 0 else value

    if times == 1:
        return example
    if isinstance(example, dict):
        return {name: repeated(value) for name, value in example.items()}
    return tuple(repeated(value) for value in example)


def _rows(target: torch.Tensor, rows: int, device: torch.device) -> torch.Tensor:
    """``target`` repeated along its first dimension to ``rows`` rows (a batch repeated by
    :meth:`Family.build`'s ``batch_scale`` repeats its targets the same way)."""
    if target.shape[0] == rows:
        return target.to(device)
    times = -(-rows // target.shape[0])
    return torch.cat([target] * times)[:rows].to(device)


# --------------------------------------------------------------------------- every-layer anchors


def hf_every_layer(model: nn.Module) -> nn.Module:
    """A deep copy of a HuggingFace model with ``gradient_checkpointing_enable`` (non-reentrant)."""
    copied = copy.deepcopy(model)
    with warnings.catch_warnings():  # newer releases also name it activation_checkpointing_enable
        warnings.filterwarnings("ignore", message=".*gradient_checkpointing_enable.*", category=FutureWarning)
        copied.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return copied.train(model.training)


def _checkpointed(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)


def checkpoint_modules(model: nn.Module, *class_names: str) -> nn.Module:
    """A deep copy of ``model`` in which every submodule whose class is named in ``class_names``
    runs under non-reentrant ``torch.utils.checkpoint`` (RNG state preserved): the hand-written
    every-layer of a family HuggingFace cannot checkpoint, or whose layers are not one list."""
    copied = copy.deepcopy(model)
    found = 0
    for module in copied.modules():
        if type(module).__name__ in class_names:
            module.forward = functools.partial(_checkpointed, module.forward)  # type: ignore[method-assign]
            found += 1
    if not found:
        raise ValueError(f"{type(model).__name__} has no submodule of class {', '.join(class_names)}")
    return copied.train(model.training)


def _hand_every_layer(*class_names: str) -> Callable[[nn.Module], nn.Module]:
    """``model -> checkpoint_modules(model, *class_names)``."""
    return lambda model: checkpoint_modules(model, *class_names)


# --------------------------------------------------------------------------- HuggingFace builders


def _hf(model_class: str, config_class: str, config: dict[str, Any], inputs: Callable[[Any], dict[str, Any]]
        ) -> Callable[[], tuple[nn.Module, dict[str, Any]]]:
    def build() -> tuple[nn.Module, dict[str, Any]]:
        import transformers

        cfg = getattr(transformers, config_class)(**config)
        torch.manual_seed(SEED)
        model = getattr(transformers, model_class)(cfg).train()
        generator = torch.Generator().manual_seed(SEED + 1)
        return model, inputs(generator)

    return build




# --------------------------------------------------------------------------- hand-written patterns


class InterleavedLists(nn.Module):
    """Layers written as a loop body over three module lists, not as one list of blocks:
    ``x = x + drop(proj[i](gelu(enc[i](ln[i](x)))))``, then a classifier head and its loss."""

    def __init__(self, width: int = WIDTH, hidden: int = 4 * WIDTH, layers: int = 4, classes: int = 10,
                 dropout: float = 0.1) -> None:
        super().__init__()
        self.ln = nn.ModuleList(nn.LayerNorm(width) for _ in range(layers))
        self.enc = nn.ModuleList(nn.Linear(width, hidden) for _ in range(layers))
        self.proj = nn.ModuleList(nn.Linear(hidden, width) for _ in range(layers))
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(width, classes)
        #: checkpoint each loop body (the hand-written every-layer sets it on a copy)
        self.checkpoint_body = False

    def body(self, i: int, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.proj[i](F.gelu(self.enc[i](self.ln[i](x)))))

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        for i in range(len(self.ln)):
            if self.checkpoint_body and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(self.body, i, x, use_reentrant=False)
            else:
                x = self.body(i, x)
        return F.cross_entropy(self.head(x).flatten(0, 1), target.flatten())


def _interleaved() -> tuple[nn.Module, tuple[Any, ...]]:
    torch.manual_seed(SEED)
    model = InterleavedLists().train()
    generator = torch.Generator().manual_seed(SEED + 1)
    x = torch.randn(8, SEQ, WIDTH, generator=generator)
    return model, (x, torch.randint(0, 10, (8, SEQ), generator=generator))


def _interleaved_every_layer(model: nn.Module) -> nn.Module:
    copied = copy.deepcopy(model)
    copied.checkpoint_body = True
    return copied.train(model.training)


def _fixed_targets(shape: tuple[int, ...], high: int) -> torch.Tensor:
    return torch.randint(0, high, shape, generator=torch.Generator().manual_seed(SEED + 2))


#: the target of the criterion-outside family: next tokens of a Llama with no labels
_OUTSIDE_TARGET = _fixed_targets((BATCH, SEQ), VOCAB)


def _criterion_outside_loss(output: Any) -> torch.Tensor:
    logits = output.logits
    return F.cross_entropy(logits.flatten(0, 1), _rows(_OUTSIDE_TARGET, logits.shape[0], logits.device).flatten())


def _criterion_outside() -> tuple[nn.Module, dict[str, Any]]:
    model, inputs = _hf("LlamaForCausalLM", "LlamaConfig", LLAMA_LIKE, lm_inputs)()
    return model, {"input_ids": inputs["input_ids"]}


class TiedLM(nn.Module):
    """A small pre-norm transformer language model whose output head is the embedding's weight
    (``F.linear(h, self.embed.weight)``), attention by ``F.scaled_dot_product_attention``
    (causal, dropout on), its own loss on the shifted tokens."""

    def __init__(self, vocab: int = VOCAB, width: int = WIDTH, layers: int = LAYERS, heads: int = HEADS) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(TiedLMBlock(width, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(width)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        logits = F.linear(self.norm(h), self.embed.weight)
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


class TiedLMBlock(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width), nn.Dropout(0.1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, w = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=ATTN_DROP if self.training else 0.0)
        x = x + self.out(a.transpose(1, 2).reshape(b, t, w))
        return x + self.mlp(self.ln2(x))


def _tied_lm() -> tuple[nn.Module, tuple[Any, ...]]:
    torch.manual_seed(SEED)
    model = TiedLM().train()
    return model, (torch.randint(0, VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(SEED + 1)),)


def _dict_outputs() -> tuple[nn.Module, dict[str, Any]]:
    from models import two_tower

    return two_tower(batch=256, image_size=16, width=WIDTH, depth=LAYERS + 1, seed=SEED)


class InplaceBlock(nn.Module):
    """conv → BatchNorm → ReLU(inplace) → conv → BatchNorm, skip added in place, ReLU in place."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.skip = (nn.Identity() if stride == 1 and cin == cout
                     else nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x)))))
        out += self.skip(x)
        return self.relu(out)


class InplaceCNN(nn.Module):
    """A BatchNorm CNN whose ReLUs run in place (``nn.ReLU(inplace=True)``), returning logits."""

    def __init__(self, widths: tuple[int, ...] = (16, 32), per_stage: int = 2, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, widths[0], 3, 1, 1, bias=False), nn.BatchNorm2d(widths[0]),
                                  nn.ReLU(inplace=True))
        blocks, cin = [], widths[0]
        for k, w in enumerate(widths):
            blocks += [InplaceBlock(cin, w, 1 if k == 0 else 2)] + [InplaceBlock(w, w, 1) for _ in range(per_stage - 1)]
            cin = w
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)).mean(dim=(2, 3)))


_CNN_TARGET = _fixed_targets((8,), 10)


def _cnn_loss(logits: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, _rows(_CNN_TARGET, logits.shape[0], logits.device))


def _bn_inplace_cnn() -> tuple[nn.Module, tuple[Any, ...]]:
    torch.manual_seed(SEED)
    model = InplaceCNN().train()
    return model, (torch.randn(8, 3, IMAGE, IMAGE, generator=torch.Generator().manual_seed(SEED + 1)),)


_MSE_TARGET = torch.randn(256, WIDTH, generator=torch.Generator().manual_seed(SEED + 2))


def _mlp_mse_loss(output: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, _rows(_MSE_TARGET, output.shape[0], output.device))


def _residual_mlp() -> tuple[nn.Module, tuple[Any, ...]]:
    from models import ResidualMLP

    torch.manual_seed(SEED)
    model = ResidualMLP(width=WIDTH, hidden=4 * WIDTH, blocks=4, classes=WIDTH).train()
    return model, (torch.randn(256, WIDTH, generator=torch.Generator().manual_seed(SEED + 1)),)


def _nn_transformer() -> tuple[nn.Module, tuple[Any, ...]]:
    from models import nn_transformer

    return nn_transformer(batch=BATCH, seq_len=SEQ, layers=LAYERS, width=WIDTH, seed=SEED)


def _every_k(model: nn.Module) -> nn.Module:
    from common import checkpoint_every_k

    return checkpoint_every_k(model, 1)


_PATTERNS: list[Family] = [
    Family("interleaved", "pattern", "4 layers as a loop body over three ModuleLists (ln, enc, proj), dropout",
           _interleaved, _interleaved_every_layer, anchor="hand"),
    Family("criterion_outside", "pattern", "Llama without labels; cross-entropy on its logits outside the model",
           _criterion_outside, hf_every_layer, loss_fn=_criterion_outside_loss),
    Family("tied_lm", "pattern", "transformer LM whose head is the embedding weight, SDPA with dropout",
           _tied_lm, _hand_every_layer("TiedLMBlock"), anchor="hand"),
    Family("dict_outputs", "pattern", "keyword inputs, a dict output with a loss (two towers, fused)",
           _dict_outputs, _hand_every_layer("ResidualBlock"), anchor="hand"),
    Family("bn_inplace_cnn", "pattern", "BatchNorm CNN with in-place ReLU and in-place skip add, criterion outside",
           _bn_inplace_cnn, _hand_every_layer("InplaceBlock"), loss_fn=_cnn_loss,
           anchor="hand"),
    Family("residual_mlp", "pattern", "residual MLP returning a tensor, MSE criterion outside",
           _residual_mlp, _every_k, loss_fn=_mlp_mse_loss, anchor="hand"),
    Family("nn_transformer", "pattern", "torch.nn.Transformer between embeddings; loss: sum of the logits",
           _nn_transformer, _hand_every_layer("TransformerEncoderLayer", "TransformerDecoderLayer"), anchor="hand"),
]


def _registry() -> tuple[dict[str, Family], dict[str, str]]:
    import transformers

    available = set(dir(transformers))
    families: dict[str, Family] = {}
    skipped: dict[str, str] = {}
    for name, group, model_class, config_class, config, inputs, about in sorted([*HF_SPECS, *MORE_HF_SPECS], key=lambda spec: GROUPS.index(spec[1])):
        missing = [c for c in (model_class, config_class) if c not in available]
        if missing:
            skipped[name] = f"transformers {transformers.__version__} has no {' or '.join(missing)}"
            continue
        hand = HAND_LAYERS.get(name)
        every = _hand_every_layer(*hand) if hand else hf_every_layer
        families[name] = Family(name, group, f"{model_class}: {about}", _hf(model_class, config_class, config, inputs),
                                every, anchor="hand" if hand else "hf")
    if "LlamaForCausalLM" not in available:
        skipped["criterion_outside"] = f"transformers {transformers.__version__} has no LlamaForCausalLM"
    families.update({f.name: f for f in _PATTERNS if f.name not in skipped})
    return families, skipped


#: every family of the corpus, by name
FAMILIES, SKIPPED = _registry()


def main() -> None:
    parser = argparse.ArgumentParser(description="List the corpus's model families; --run steps each once.")
    parser.add_argument("--run", action="store_true", help="build each family and time a forward + backward (the second)")
    parser.add_argument("--families", nargs="*", default=None)
    args = parser.parse_args()
    names = args.families or list(FAMILIES)
    for name, reason in SKIPPED.items():
        print(f"{name}: skipped ({reason})")
    for name in names:
        family = FAMILIES[name]
        line = f"{name:18s} {family.group:10s} {family.anchor:4s} {family.about}"
        if args.run:
            try:
                t0 = time.perf_counter()
                model, inputs = family.build()
                built_s = time.perf_counter() - t0
                args_, kwargs = (inputs, {}) if isinstance(inputs, tuple) else ((), inputs)
                family.loss(model(*args_, **kwargs)).backward()  # the first step pays for lazy setup
                t0 = time.perf_counter()
                family.loss(model(*args_, **kwargs)).backward()
                step_s = time.perf_counter() - t0
                params = sum(p.numel() for p in model.parameters())
                line = (f"{name:18s} {family.group:10s} build {built_s:6.3f} s  step {step_s:6.3f} s  "
                        f"{params:>9,} params")
            except Exception as exc:  # noqa: BLE001 - one line per failing family
                line = f"{name:18s} {family.group:10s} FAILED: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
