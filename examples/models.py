"""Example models used by the examples, benchmarks and tests.

``residual_mlp`` is an 8-block residual MLP; ``gpt2`` a HuggingFace ``GPT2LMHeadModel`` built
from a config (no download), dropout on, ``use_cache=False``.
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


def gpt2(batch: int = 8, seq_len: int = 256, layers: int = 4, seed: int = 0) -> tuple[nn.Module, dict[str, Any]]:
    """A small GPT-2 language model (dropout on) and a batch of token ids with labels."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=layers, n_embd=256, n_head=4, vocab_size=4096, n_positions=max(seq_len, 64),
        bos_token_id=0, eos_token_id=0, use_cache=False,
    )
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(config).train()
    ids = torch.randint(0, config.vocab_size, (batch, seq_len))
    return model, {"input_ids": ids, "labels": ids}


def llama(batch: int = 4, seq_len: int = 256, layers: int = 4, seed: int = 0) -> tuple[nn.Module, dict[str, Any]]:
    """A small Llama causal language model from a config, with token ids and labels."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=256, intermediate_size=704, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=4, vocab_size=4096, max_position_embeddings=max(seq_len, 64), use_cache=False,
        bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).train()
    ids = torch.randint(0, config.vocab_size, (batch, seq_len))
    return model, {"input_ids": ids, "labels": ids}


def bert(batch: int = 8, seq_len: int = 256, layers: int = 4, seed: int = 0) -> tuple[nn.Module, dict[str, Any]]:
    """A small BERT masked language model from a config (dropout on), with token ids and labels."""
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(
        hidden_size=256, intermediate_size=1024, num_hidden_layers=layers, num_attention_heads=4,
        vocab_size=4096, max_position_embeddings=max(seq_len, 64), pad_token_id=0,
    )
    torch.manual_seed(seed)
    model = BertForMaskedLM(config).train()
    ids = torch.randint(1, config.vocab_size, (batch, seq_len))
    return model, {"input_ids": ids, "labels": ids}
