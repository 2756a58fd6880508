"""Example models used by the examples, benchmarks and tests.

``residual_mlp`` is an 8-block residual MLP; ``tied_autoencoder`` an MLP autoencoder whose
decoder runs the encoder's weights transposed; ``gpt2`` a HuggingFace ``GPT2LMHeadModel`` built
from a config (no download), dropout on, ``use_cache=False``. Every builder returns
``(model, example_inputs)`` with the model in training mode; HuggingFace models come from configs
only (GPT-2, Llama, Mistral, BERT, T5, Whisper, ViT, ResNet), plus ``torch.nn.Transformer``
(``nn_transformer``), a CNN with BatchNorm and skip connections (``cnn``), a model taking
keyword arguments and returning a dict (``two_tower``) and a GPT-2-XL-sized model on the meta
device for fake-tensor planning (``gpt2_meta``).

Example:
    >>> model, inputs = cnn(batch=2, image_size=8, widths=(8,))
    >>> tuple(model(*inputs).shape)
    (2, 10)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class ResidualBlock(nn.Module):
    def __init__(self, width: int, hidden: int, dropout: float) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.down(torch.nn.functional.gelu(self.up(self.norm(x)))))


class ResidualMLP(nn.Module):
    """``blocks`` residual blocks of LayerNorm → Linear → GELU → Linear → Dropout, then a head."""

    def __init__(self, width: int = 256, hidden: int = 1024, blocks: int = 8, classes: int = 10,
                 dropout: float = 0.1) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[ResidualBlock(width, hidden, dropout) for _ in range(blocks)])
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


def residual_mlp(batch: int = 2048, seed: int = 0) -> tuple[nn.Module, tuple[Any, ...]]:
    """The 8-block residual MLP and a batch of inputs."""
    torch.manual_seed(seed)
    model = ResidualMLP().train()
    return model, (torch.randn(batch, 256),)


class TiedAutoencoder(nn.Module):
    """An MLP autoencoder over tokens: ``layers // 2`` encoder linears, then a decoder that runs
    the same weights transposed (tied), GELU between them, mean-squared reconstruction loss."""

    def __init__(self, width: int = 512, hidden: int = 2048, layers: int = 6) -> None:
        super().__init__()
        sizes = [width] + [hidden] * (layers // 2)
        self.encoder = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes, sizes[1:]))
        self.decoder_biases = nn.ParameterList(nn.Parameter(torch.zeros(a)) for a in sizes[:-1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for layer in self.encoder:
            h = torch.nn.functional.gelu(layer(h))
        for i in reversed(range(len(self.encoder))):
            h = torch.nn.functional.linear(h, self.encoder[i].weight.t(), self.decoder_biases[i])
            if i > 0:
                h = torch.nn.functional.gelu(h)
        return torch.nn.functional.mse_loss(h, x)


def tied_autoencoder(batch: int = 16, tokens: int = 256, width: int = 512, hidden: int = 2048, layers: int = 6,
                     seed: int = 0) -> tuple[nn.Module, tuple[Any, ...]]:
    """The tied-weight MLP autoencoder (6 layers, width 512, hidden 2048) and 16 x 256 tokens."""
    torch.manual_seed(seed)
    model = TiedAutoencoder(width, hidden, layers).train()
    return model, (torch.randn(batch, tokens, width),)


def gpt2(batch: int = 8, seq_len: int = 256, layers: int = 4, seed: int = 0, width: int = 256,
         vocab: int = 4096, heads: int = 4, attention_dropout: float = 0.1) -> tuple[nn.Module, dict[str, Any]]:
    """A small GPT-2 language model (dropout on) and a batch of token ids with labels."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=layers, n_embd=width, n_head=heads, vocab_size=vocab, n_positions=max(seq_len, 64),
        bos_token_id=0, eos_token_id=0, use_cache=False, attn_pdrop=attention_dropout,
    )
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(config).train()
    ids = torch.randint(0, config.vocab_size, (batch, seq_len))
    return model, {"input_ids": ids, "labels": ids}


def llama(batch: int = 4, seq_len: int = 256, layers: int = 4, seed: int = 0, width: int = 256,
          vocab: int = 4096, heads: int = 4, attention_dropout: float = 0.0) -> tuple[nn.Module, dict[str, Any]]:
    """A small Llama causal language model from a config, with token ids and labels."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=width, intermediate_size=704 * width // 256, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=heads, vocab_size=vocab, max_position_embeddings=max(seq_len, 64), use_cache=False,
        bos_token_id=0, eos_token_id=0, pad_token_id=0, attention_dropout=attention_dropout,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).train()
    ids = torch.randint(0, config.vocab_size, (batch, seq_len))
    return model, {"input_ids": ids, "labels": ids}


def mistral(batch: int = 4, seq_len: int = 256, layers: int = 2, seed: int = 0, width: int = 512,
            vocab: int = 4096, heads: int = 8, attention_dropout: float = 0.1) -> tuple[nn.Module, dict[str, Any]]:
    """A small Mistral causal language model (grouped-query attention, sliding window) from a
    config, with token ids and labels."""
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(
        hidden_size=width, intermediate_size=7 * width // 2, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=max(heads // 4, 1), vocab_size=vocab, max_position_embeddings=max(seq_len, 64),
        use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0, attention_dropout=attention_dropout,
    )
    torch.manual_seed(seed)
    model = MistralForCausalLM(config).train()
    ids = torch.randint(0, config.vocab_size, (batch, seq_len))
    return model, {"input_ids": ids, "labels": ids}


def bert(batch: int = 8, seq_len: int = 256, layers: int = 4, seed: int = 0, width: int = 256,
         vocab: int = 4096, heads: int = 4, attention_dropout: float = 0.1) -> tuple[nn.Module, dict[str, Any]]:
    """A small BERT masked language model from a config (dropout on), with token ids and labels."""
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(
        hidden_size=width, intermediate_size=4 * width, num_hidden_layers=layers, num_attention_heads=heads,
        vocab_size=vocab, max_position_embeddings=max(seq_len, 64), pad_token_id=0,
        attention_probs_dropout_prob=attention_dropout,
    )
    torch.manual_seed(seed)
    model = BertForMaskedLM(config).train()
    ids = torch.randint(1, config.vocab_size, (batch, seq_len))
    return model, {"input_ids": ids, "labels": ids}


def t5(batch: int = 4, seq_len: int = 64, layers: int = 2, width: int = 128, vocab: int = 2048,
       seed: int = 0) -> tuple[nn.Module, dict[str, Any]]:
    """A small T5 encoder-decoder (``T5ForConditionalGeneration``) from a config, dropout on.

    Inputs are keyword arguments (token ids and labels; the decoder inputs are the shifted labels).
    """
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(
        vocab_size=vocab, d_model=width, d_kv=width // 4, d_ff=4 * width, num_layers=layers,
        num_decoder_layers=layers, num_heads=4, dropout_rate=0.1, use_cache=False,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
    )
    torch.manual_seed(seed)
    model = T5ForConditionalGeneration(config).train()
    ids = torch.randint(2, config.vocab_size, (batch, seq_len))
    labels = torch.randint(2, config.vocab_size, (batch, seq_len))
    return model, {"input_ids": ids, "labels": labels}


def whisper(batch: int = 2, frames: int = 128, layers: int = 2, width: int = 128, vocab: int = 1024,
            target_len: int = 32, seed: int = 0) -> tuple[nn.Module, dict[str, Any]]:
    """A small Whisper speech encoder-decoder from a config, with log-mel features and labels.

    ``frames`` is the feature length (the encoder's two convolutions halve it).
    """
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    config = WhisperConfig(
        vocab_size=vocab, num_mel_bins=32, d_model=width, encoder_layers=layers, decoder_layers=layers,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=4 * width,
        decoder_ffn_dim=4 * width, max_source_positions=frames // 2, max_target_positions=max(64, target_len),
        dropout=0.1, use_cache=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        decoder_start_token_id=1,
    )
    torch.manual_seed(seed)
    model = WhisperForConditionalGeneration(config).train()
    features = torch.randn(batch, config.num_mel_bins, frames)
    labels = torch.randint(3, config.vocab_size, (batch, target_len))
    return model, {"input_features": features, "labels": labels}


def vit(batch: int = 8, image_size: int = 64, layers: int = 2, width: int = 128,
        seed: int = 0) -> tuple[nn.Module, dict[str, Any]]:
    """A small ViT image classifier from a config (dropout on), with images and labels."""
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(
        image_size=image_size, patch_size=8, num_channels=3, hidden_size=width, num_hidden_layers=layers,
        num_attention_heads=4, intermediate_size=4 * width, hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1, num_labels=10,
    )
    torch.manual_seed(seed)
    model = ViTForImageClassification(config).train()
    pixels = torch.randn(batch, 3, image_size, image_size)
    return model, {"pixel_values": pixels, "labels": torch.randint(0, 10, (batch,))}


def hf_resnet(batch: int = 8, image_size: int = 64, widths: tuple[int, ...] = (32, 64), depth: int = 2,
              seed: int = 0) -> tuple[nn.Module, dict[str, Any]]:
    """A small HuggingFace ResNet (BatchNorm, residual shortcuts) from a config, images and labels."""
    from transformers import ResNetConfig, ResNetForImageClassification

    config = ResNetConfig(
        embedding_size=max(8, widths[0] // 2), hidden_sizes=list(widths), depths=[depth] * len(widths), layer_type="basic",
        num_labels=10,
    )
    torch.manual_seed(seed)
    model = ResNetForImageClassification(config).train()
    pixels = torch.randn(batch, 3, image_size, image_size)
    return model, {"pixel_values": pixels, "labels": torch.randint(0, 10, (batch,))}


class Seq2SeqTransformer(nn.Module):
    """``torch.nn.Transformer`` (batch first, dropout on) between two embeddings and a head."""

    def __init__(self, vocab: int = 512, width: int = 128, layers: int = 2) -> None:
        super().__init__()
        self.src_embed = nn.Embedding(vocab, width)
        self.tgt_embed = nn.Embedding(vocab, width)
        self.transformer = nn.Transformer(
            d_model=width, nhead=4, num_encoder_layers=layers, num_decoder_layers=layers,
            dim_feedforward=4 * width, dropout=0.1, batch_first=True,
        )
        self.head = nn.Linear(width, vocab)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1], device=tgt.device)
        out = self.transformer(self.src_embed(src), self.tgt_embed(tgt), tgt_mask=mask, tgt_is_causal=True)
        return self.head(out)


def nn_transformer(batch: int = 8, seq_len: int = 64, layers: int = 2, width: int = 128,
                   seed: int = 0) -> tuple[nn.Module, tuple[Any, ...]]:
    """``torch.nn.Transformer`` in a small sequence-to-sequence model, with source and target ids."""
    torch.manual_seed(seed)
    model = Seq2SeqTransformer(width=width, layers=layers).train()
    src = torch.randint(0, 512, (batch, seq_len))
    tgt = torch.randint(0, 512, (batch, seq_len))
    return model, (src, tgt)


class BasicBlock(nn.Module):
    """conv → BatchNorm → ReLU → conv → BatchNorm, plus a (projected) skip connection."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.skip = (
            nn.Identity() if stride == 1 and cin == cout
            else nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.skip(x))


class SmallResNet(nn.Module):
    """A CNN with BatchNorm and skip connections: a stem, ``len(widths)`` stages, pooling, a head."""

    def __init__(self, widths: tuple[int, ...] = (32, 64, 128), classes: int = 10, blocks_per_stage: int = 2) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, widths[0], 3, 1, 1, bias=False), nn.BatchNorm2d(widths[0]),
                                  nn.ReLU())
        blocks = []
        cin = widths[0]
        for k, w in enumerate(widths):
            blocks += [BasicBlock(cin, w, 1 if k == 0 else 2)]
            blocks += [BasicBlock(w, w, 1) for _ in range(blocks_per_stage - 1)]
            cin = w
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)).mean(dim=(2, 3)))


def cnn(batch: int = 16, image_size: int = 32, widths: tuple[int, ...] = (32, 64, 128), blocks_per_stage: int = 2,
        seed: int = 0) -> tuple[nn.Module, tuple[Any, ...]]:
    """A small ResNet-style CNN (BatchNorm, skip connections) and a batch of images."""
    torch.manual_seed(seed)
    model = SmallResNet(widths, blocks_per_stage=blocks_per_stage).train()
    return model, (torch.randn(batch, 3, image_size, image_size),)


class TwoTower(nn.Module):
    """Takes keyword arguments and returns a dict: an image tower and a token tower, fused.

    ``forward(image=..., tokens=..., target=None)`` returns ``{"logits", "embedding", "loss"?}``.
    """

    def __init__(self, width: int = 128, vocab: int = 512, classes: int = 10, depth: int = 4) -> None:
        super().__init__()
        self.image = nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1), nn.GELU(), nn.Flatten(), nn.LazyLinear(width))
        self.tokens = nn.Embedding(vocab, width)
        self.fuse = nn.Sequential(nn.Linear(2 * width, width),
                                  *[ResidualBlock(width, 4 * width, 0.1) for _ in range(depth)])
        self.head = nn.Linear(width, classes)

    def forward(self, image: torch.Tensor, tokens: torch.Tensor,
                target: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        joint = torch.cat([self.image(image), self.tokens(tokens).mean(dim=1)], dim=-1)
        embedding = self.fuse(joint)
        logits = self.head(embedding)
        out = {"logits": logits, "embedding": embedding}
        if target is not None:
            out["loss"] = torch.nn.functional.cross_entropy(logits, target)
        return out


def two_tower(batch: int = 256, image_size: int = 32, width: int = 128, depth: int = 4,
              seed: int = 0) -> tuple[nn.Module, dict[str, Any]]:
    """A model called with keyword arguments that returns a dict (with a ``loss``)."""
    torch.manual_seed(seed)
    model = TwoTower(width, depth=depth).train()
    image = torch.randn(batch, 3, image_size, image_size)
    with torch.no_grad():
        model(image=image[:1], tokens=torch.zeros(1, 4, dtype=torch.long))  # materialise the lazy layer
    tokens = torch.randint(0, 512, (batch, 16))
    return model, {"image": image, "tokens": tokens, "target": torch.randint(0, 10, (batch,))}


def gpt2_meta(batch: int = 8, seq_len: int = 2048, layers: int = 48, width: int = 1600, heads: int = 25,
              vocab: int = 50257) -> tuple[nn.Module, dict[str, Any]]:
    """A GPT-2 (XL-sized by default: 48 layers, width 1600, 1.6e9 parameters) on the meta device.

    Nothing is allocated: parameters and inputs are meta tensors, only shapes and dtypes. Plan
    it with fake-tensor profiling (``profile_graph(..., fake=True, target="h100")``).
    """
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=layers, n_embd=width, n_head=heads, vocab_size=vocab, n_positions=max(seq_len, 1024),
        bos_token_id=0, eos_token_id=0, use_cache=False,
    )
    with torch.device("meta"):
        model = GPT2LMHeadModel(config).train()
    ids = torch.zeros(batch, seq_len, dtype=torch.long, device="meta")
    return model, {"input_ids": ids, "labels": ids}
