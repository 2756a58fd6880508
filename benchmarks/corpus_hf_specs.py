"""The HuggingFace families of the corpus: each one's tiny config and example inputs, and the
layer classes a hand-written every-layer wraps where HuggingFace cannot checkpoint the family
(:mod:`corpus_models` builds them). Sizes: 2 layers, width 64, 4 x 64 tokens, vocabulary 1024,
4 x 32 x 32 images.

Example:
    >>> sorted({group for _, group, *_ in HF_SPECS})
    ['causal-lm', 'encoder', 'seq2seq', 'vision']
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["HF_SPECS", "MORE_HF_SPECS", "HAND_LAYERS", "LLAMA_LIKE", "lm_inputs", "SEED", "BATCH", "SEQ", "WIDTH", "LAYERS", "HEADS",
           "VOCAB", "IMAGE", "ATTN_DROP"]

SEED = 0
BATCH = 4
SEQ = 64
WIDTH = 64
LAYERS = 2
HEADS = 4
VOCAB = 1024
IMAGE = 32
#: attention dropout, where the family has it
ATTN_DROP = 0.1


def lm_inputs(generator: torch.Generator, vocab: int = VOCAB, low: int = 0) -> dict[str, Any]:
    ids = torch.randint(low, vocab, (BATCH, SEQ), generator=generator)
    return {"input_ids": ids, "labels": ids}


def seq2seq_inputs(generator: torch.Generator, vocab: int = VOCAB) -> dict[str, Any]:
    ids = torch.randint(3, vocab, (BATCH, SEQ), generator=generator)
    labels = torch.randint(3, vocab, (BATCH, SEQ), generator=generator)
    return {"input_ids": ids, "labels": labels}


def image_inputs(generator: torch.Generator, batch: int = BATCH, size: int = IMAGE) -> dict[str, Any]:
    return {"pixel_values": torch.randn(batch, 3, size, size, generator=generator),
            "labels": torch.randint(0, 10, (batch,), generator=generator)}


#: what every decoder config shares: no cache, token ids inside the vocabulary
DECODER = {"use_cache": False, "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0, "vocab_size": VOCAB}
#: Llama-style configs (hidden_size, intermediate_size, num_hidden_layers, heads, attention_dropout)
LLAMA_LIKE = {**DECODER, "hidden_size": WIDTH, "intermediate_size": 2 * WIDTH, "num_hidden_layers": LAYERS,
               "num_attention_heads": HEADS, "num_key_value_heads": HEADS // 2, "max_position_embeddings": 128,
               "attention_dropout": ATTN_DROP}
#: BERT-style encoder configs
BERT_LIKE = {"vocab_size": VOCAB, "hidden_size": WIDTH, "intermediate_size": 2 * WIDTH, "num_hidden_layers": LAYERS,
              "num_attention_heads": HEADS, "max_position_embeddings": 128, "pad_token_id": 0,
              "attention_probs_dropout_prob": ATTN_DROP}
#: BART-style seq2seq configs
BART_LIKE = {"vocab_size": VOCAB, "d_model": WIDTH, "encoder_layers": LAYERS, "decoder_layers": LAYERS,
              "encoder_attention_heads": HEADS, "decoder_attention_heads": HEADS, "encoder_ffn_dim": 2 * WIDTH,
              "decoder_ffn_dim": 2 * WIDTH, "max_position_embeddings": 128, "attention_dropout": ATTN_DROP,
              "dropout": 0.1, "use_cache": False, "pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2,
              "decoder_start_token_id": 2}

#: (name, group, model class, config class, config, inputs, about)
HF_SPECS: list[tuple[str, str, str, str, dict[str, Any], Callable[[torch.Generator], dict[str, Any]], str]] = [
    # causal language models
    ("gpt2", "causal-lm", "GPT2LMHeadModel", "GPT2Config",
     {**DECODER, "n_layer": LAYERS, "n_embd": WIDTH, "n_head": HEADS, "n_positions": 128, "attn_pdrop": ATTN_DROP},
     lm_inputs, "learned positions, Conv1D projections, tied head"),
    ("gpt_neo", "causal-lm", "GPTNeoForCausalLM", "GPTNeoConfig",
     {**DECODER, "num_layers": LAYERS, "hidden_size": WIDTH, "num_heads": HEADS, "max_position_embeddings": 128,
      "attention_types": [[["global", "local"], LAYERS // 2]], "window_size": 16, "attention_dropout": ATTN_DROP},
     lm_inputs, "global and local (windowed) attention layers"),
    ("gpt_neox", "causal-lm", "GPTNeoXForCausalLM", "GPTNeoXConfig",
     {**DECODER, "num_hidden_layers": LAYERS, "hidden_size": WIDTH, "num_attention_heads": HEADS,
      "intermediate_size": 2 * WIDTH, "max_position_embeddings": 128, "attention_dropout": ATTN_DROP,
      "hidden_dropout": 0.1, "use_parallel_residual": True},
     lm_inputs, "parallel residual, partial rotary"),
    ("gptj", "causal-lm", "GPTJForCausalLM", "GPTJConfig",
     {**DECODER, "n_layer": LAYERS, "n_embd": WIDTH, "n_head": HEADS, "n_positions": 128, "rotary_dim": 8,
      "attn_pdrop": ATTN_DROP},
     lm_inputs, "parallel attention and MLP, interleaved rotary"),
    ("codegen", "causal-lm", "CodeGenForCausalLM", "CodeGenConfig",
     {**DECODER, "n_layer": LAYERS, "n_embd": WIDTH, "n_head": HEADS, "n_positions": 128, "n_ctx": 128,
      "rotary_dim": 8, "attn_pdrop": ATTN_DROP},
     lm_inputs, "fused qkv in model-parallel layout, rotary"),
    ("opt", "causal-lm", "OPTForCausalLM", "OPTConfig",
     {**DECODER, "num_hidden_layers": LAYERS, "hidden_size": WIDTH, "num_attention_heads": HEADS,
      "ffn_dim": 2 * WIDTH, "word_embed_proj_dim": WIDTH, "max_position_embeddings": 128, "dropout": 0.1,
      "attention_dropout": ATTN_DROP, "pad_token_id": 1, "bos_token_id": 2, "eos_token_id": 2},
     functools.partial(lm_inputs, low=3), "learned offset positions, ReLU MLP"),
    ("bloom", "causal-lm", "BloomForCausalLM", "BloomConfig",
     {**DECODER, "n_layer": LAYERS, "hidden_size": WIDTH, "n_head": HEADS, "attention_dropout": ATTN_DROP,
      "hidden_dropout": 0.1},
     lm_inputs, "ALiBi, embedding LayerNorm"),
    ("falcon", "causal-lm", "FalconForCausalLM", "FalconConfig",
     {**DECODER, "num_hidden_layers": LAYERS, "hidden_size": WIDTH, "num_attention_heads": HEADS,
      "num_kv_heads": 1, "new_decoder_architecture": False, "multi_query": True, "parallel_attn": True,
      "bias": False, "attention_dropout": ATTN_DROP, "hidden_dropout": 0.1, "max_position_embeddings": 128},
     lm_inputs, "multi-query attention, parallel attention and MLP"),
    ("gpt_bigcode", "causal-lm", "GPTBigCodeForCausalLM", "GPTBigCodeConfig",
     {**DECODER, "n_layer": LAYERS, "n_embd": WIDTH, "n_head": HEADS, "n_positions": 128, "multi_query": True,
      "attn_pdrop": ATTN_DROP},
     lm_inputs, "multi-query attention, learned positions"),
    ("llama", "causal-lm", "LlamaForCausalLM", "LlamaConfig", LLAMA_LIKE, lm_inputs,
     "RMSNorm, rotary, SwiGLU, grouped-query attention"),
    ("mistral", "causal-lm", "MistralForCausalLM", "MistralConfig", {**LLAMA_LIKE, "sliding_window": 16},
     lm_inputs, "sliding-window attention"),
    ("mixtral", "causal-lm", "MixtralForCausalLM", "MixtralConfig",
     {**LLAMA_LIKE, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None,
      "router_aux_loss_coef": 0.01, "output_router_logits": True},
     lm_inputs, "sparse mixture of experts (4 experts, top 2), router loss"),
    ("qwen2", "causal-lm", "Qwen2ForCausalLM", "Qwen2Config", LLAMA_LIKE, lm_inputs,
     "qkv bias, grouped-query attention"),
    ("qwen3", "causal-lm", "Qwen3ForCausalLM", "Qwen3Config", {**LLAMA_LIKE, "head_dim": WIDTH // HEADS},
     lm_inputs, "query and key RMSNorm"),
    ("qwen2_moe", "causal-lm", "Qwen2MoeForCausalLM", "Qwen2MoeConfig",
     {**LLAMA_LIKE, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": WIDTH,
      "shared_expert_intermediate_size": 2 * WIDTH, "decoder_sparse_step": 1, "output_router_logits": True},
     lm_inputs, "mixture of experts with a shared expert"),
    ("qwen3_moe", "causal-lm", "Qwen3MoeForCausalLM", "Qwen3MoeConfig",
     {**LLAMA_LIKE, "head_dim": WIDTH // HEADS, "num_experts": 4, "num_experts_per_tok": 2,
      "moe_intermediate_size": WIDTH, "decoder_sparse_step": 1},
     lm_inputs, "mixture of experts, query and key RMSNorm"),
    ("gemma", "causal-lm", "GemmaForCausalLM", "GemmaConfig", {**LLAMA_LIKE, "head_dim": WIDTH // HEADS},
     lm_inputs, "GeGLU, scaled embeddings, (1 + w) RMSNorm"),
    ("gemma2", "causal-lm", "Gemma2ForCausalLM", "Gemma2Config",
     {**LLAMA_LIKE, "head_dim": WIDTH // HEADS, "sliding_window": 16},
     lm_inputs, "logit soft-capping, sandwich norms, alternating sliding window"),
    ("gemma3", "causal-lm", "Gemma3ForCausalLM", "Gemma3TextConfig",
     {**LLAMA_LIKE, "head_dim": WIDTH // HEADS, "sliding_window": 16},
     lm_inputs, "query and key norms, local and global rotary"),
    ("phi", "causal-lm", "PhiForCausalLM", "PhiConfig",
     {**LLAMA_LIKE, "num_key_value_heads": HEADS, "partial_rotary_factor": 0.5, "resid_pdrop": 0.1},
     lm_inputs, "parallel attention and MLP, partial rotary, dense head with bias"),
    ("phi3", "causal-lm", "Phi3ForCausalLM", "Phi3Config", {**LLAMA_LIKE, "pad_token_id": 0}, lm_inputs,
     "fused qkv and gate-up projections"),
    ("stablelm", "causal-lm", "StableLmForCausalLM", "StableLmConfig",
     {**LLAMA_LIKE, "partial_rotary_factor": 0.25}, lm_inputs, "LayerNorm, partial rotary"),
    ("olmo", "causal-lm", "OlmoForCausalLM", "OlmoConfig", {**LLAMA_LIKE, "pad_token_id": 1}, lm_inputs,
     "non-parametric LayerNorm"),
    ("olmo2", "causal-lm", "Olmo2ForCausalLM", "Olmo2Config", {**LLAMA_LIKE, "pad_token_id": 1}, lm_inputs,
     "post-norm RMSNorm, query and key norms"),
    ("granite", "causal-lm", "GraniteForCausalLM", "GraniteConfig",
     {**LLAMA_LIKE, "residual_multiplier": 0.5, "embedding_multiplier": 2.0, "logits_scaling": 4.0},
     lm_inputs, "scaled residuals, embeddings and logits"),
    # encoders (masked language models)
    ("bert", "encoder", "BertForMaskedLM", "BertConfig", BERT_LIKE, functools.partial(lm_inputs, low=1),
     "post-norm encoder, absolute positions, MLM head"),
    ("roberta", "encoder", "RobertaForMaskedLM", "RobertaConfig", {**BERT_LIKE, "pad_token_id": 1},
     functools.partial(lm_inputs, low=2), "positions offset past the padding index"),
    ("deberta_v2", "encoder", "DebertaV2ForMaskedLM", "DebertaV2Config",
     {**BERT_LIKE, "relative_attention": True, "position_buckets": 32, "max_relative_positions": 64,
      "pos_att_type": ["p2c", "c2p"], "position_biased_input": False},
     functools.partial(lm_inputs, low=1), "disentangled relative attention"),
    ("electra", "encoder", "ElectraForMaskedLM", "ElectraConfig", {**BERT_LIKE, "embedding_size": 32},
     functools.partial(lm_inputs, low=1), "generator: embeddings narrower than the layers"),
    ("distilbert", "encoder", "DistilBertForMaskedLM", "DistilBertConfig",
     {"vocab_size": VOCAB, "dim": WIDTH, "hidden_dim": 2 * WIDTH, "n_layers": LAYERS, "n_heads": HEADS,
      "max_position_embeddings": 128, "attention_dropout": ATTN_DROP, "pad_token_id": 0},
     functools.partial(lm_inputs, low=1), "no token types, tied MLM head"),
    ("albert", "encoder", "AlbertForMaskedLM", "AlbertConfig",
     {**BERT_LIKE, "embedding_size": 32, "num_hidden_groups": 1, "inner_group_num": 1},
     functools.partial(lm_inputs, low=1), "one layer's weights shared by every layer"),
    # sequence to sequence
    ("t5", "seq2seq", "T5ForConditionalGeneration", "T5Config",
     {"vocab_size": VOCAB, "d_model": WIDTH, "d_kv": WIDTH // HEADS, "d_ff": 2 * WIDTH, "num_layers": LAYERS,
      "num_decoder_layers": LAYERS, "num_heads": HEADS, "dropout_rate": 0.1, "use_cache": False,
      "decoder_start_token_id": 0, "pad_token_id": 0, "eos_token_id": 1},
     seq2seq_inputs, "relative position buckets, RMSNorm, no biases"),
    ("bart", "seq2seq", "BartForConditionalGeneration", "BartConfig", BART_LIKE, seq2seq_inputs,
     "post-norm encoder-decoder, learned positions"),
    ("marian", "seq2seq", "MarianMTModel", "MarianConfig",
     {**BART_LIKE, "pad_token_id": 1, "decoder_start_token_id": 1, "decoder_vocab_size": VOCAB},
     seq2seq_inputs, "sinusoidal positions, scaled embeddings"),
    ("whisper", "seq2seq", "WhisperForConditionalGeneration", "WhisperConfig",
     {"vocab_size": VOCAB, "num_mel_bins": 16, "d_model": WIDTH, "encoder_layers": LAYERS, "decoder_layers": LAYERS,
      "encoder_attention_heads": HEADS, "decoder_attention_heads": HEADS, "encoder_ffn_dim": 2 * WIDTH,
      "decoder_ffn_dim": 2 * WIDTH, "max_source_positions": 32, "max_target_positions": 64, "dropout": 0.1,
      "attention_dropout": ATTN_DROP, "use_cache": False, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
      "decoder_start_token_id": 1},
     lambda g: {"input_features": torch.randn(BATCH, 16, 64, generator=g),
                "labels": torch.randint(3, VOCAB, (BATCH, SEQ), generator=g)},
     "convolutional audio stem, encoder-decoder"),
    # vision
    ("vit", "vision", "ViTForImageClassification", "ViTConfig",
     {"image_size": IMAGE, "patch_size": 4, "num_channels": 3, "hidden_size": WIDTH, "num_hidden_layers": LAYERS,
      "num_attention_heads": HEADS, "intermediate_size": 2 * WIDTH, "hidden_dropout_prob": 0.1,
      "attention_probs_dropout_prob": ATTN_DROP, "num_labels": 10},
     image_inputs, "patch embedding, class token"),
    ("swin", "vision", "SwinForImageClassification", "SwinConfig",
     {"image_size": IMAGE, "patch_size": 2, "num_channels": 3, "embed_dim": 32, "depths": [2, 2],
      "num_heads": [2, 4], "window_size": 4, "mlp_ratio": 2.0, "attention_probs_dropout_prob": ATTN_DROP,
      "num_labels": 10},
     image_inputs, "shifted windows, patch merging"),
    ("convnext", "vision", "ConvNextForImageClassification", "ConvNextConfig",
     {"num_channels": 3, "patch_size": 2, "hidden_sizes": [32, 64], "depths": [2, 2], "num_stages": 2,
      "drop_path_rate": 0.1, "layer_scale_init_value": 1.0, "num_labels": 10},
     image_inputs, "depthwise convolutions, LayerNorm, stochastic depth"),
    ("resnet", "vision", "ResNetForImageClassification", "ResNetConfig",
     {"embedding_size": 16, "hidden_sizes": [32, 64], "depths": [2, 2], "layer_type": "basic", "num_labels": 10},
     functools.partial(image_inputs, batch=8, size=64),
     "BatchNorm, residual shortcuts (a stride-4 stem: 8 x 64 x 64 images)"),
]

#: families added to test the corpus's reach past the shapes above (same sizes)
MORE_HF_SPECS: list[tuple[str, str, str, str, dict[str, Any], Callable[[torch.Generator], dict[str, Any]], str]] = [
    ("deepseek_v3", "causal-lm", "DeepseekV3ForCausalLM", "DeepseekV3Config",
     {**LLAMA_LIKE, "num_key_value_heads": HEADS, "n_routed_experts": 4, "num_experts_per_tok": 2,
      "moe_intermediate_size": WIDTH, "n_shared_experts": 1, "first_k_dense_replace": 1, "kv_lora_rank": 16,
      "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16, "n_group": 1,
      "topk_group": 1},
     lm_inputs, "multi-head latent attention (keys filled slice by slice), a dense then a MoE layer"),
    ("starcoder2", "causal-lm", "Starcoder2ForCausalLM", "Starcoder2Config",
     {**LLAMA_LIKE, "sliding_window": 16, "residual_dropout": 0.1}, lm_inputs,
     "sliding window, LayerNorm, GELU MLP with biases"),
    ("cohere", "causal-lm", "CohereForCausalLM", "CohereConfig", {**LLAMA_LIKE, "use_qk_norm": False}, lm_inputs,
     "parallel attention and MLP, one LayerNorm, interleaved rotary"),
    ("olmoe", "causal-lm", "OlmoeForCausalLM", "OlmoeConfig",
     {**LLAMA_LIKE, "num_experts": 4, "num_experts_per_tok": 2, "pad_token_id": 1}, lm_inputs,
     "mixture of experts with query and key norms"),
    ("xglm", "causal-lm", "XGLMForCausalLM", "XGLMConfig",
     {"vocab_size": VOCAB, "d_model": WIDTH, "ffn_dim": 2 * WIDTH, "num_layers": LAYERS, "attention_heads": HEADS,
      "max_position_embeddings": 128, "attention_dropout": ATTN_DROP, "dropout": 0.1, "use_cache": False,
      "pad_token_id": 1},
     functools.partial(lm_inputs, low=2), "sinusoidal positions, scaled embeddings, pre-norm"),
    ("nemotron", "causal-lm", "NemotronForCausalLM", "NemotronConfig", {**LLAMA_LIKE, "partial_rotary_factor": 0.5},
     lm_inputs, "squared-ReLU MLP, (1 + w) LayerNorm, partial rotary"),
    ("granitemoe", "causal-lm", "GraniteMoeForCausalLM", "GraniteMoeConfig",
     {**LLAMA_LIKE, "num_local_experts": 4, "num_experts_per_tok": 2}, lm_inputs,
     "mixture of experts through batched expert matmuls"),
    ("mamba", "causal-lm", "MambaForCausalLM", "MambaConfig",
     {"vocab_size": VOCAB, "hidden_size": WIDTH, "state_size": 8, "num_hidden_layers": LAYERS, "use_cache": False,
      "pad_token_id": 0, "bos_token_id": 0, "eos_token_id": 0},
     lm_inputs, "state space: a selective scan, the reference loop over positions"),
    ("modernbert", "encoder", "ModernBertForMaskedLM", "ModernBertConfig",
     {"vocab_size": VOCAB, "hidden_size": WIDTH, "intermediate_size": 2 * WIDTH, "num_hidden_layers": LAYERS,
      "num_attention_heads": HEADS, "max_position_embeddings": 128, "attention_dropout": ATTN_DROP,
      "pad_token_id": 0, "local_attention": 16, "global_attn_every_n_layers": 2},
     functools.partial(lm_inputs, low=1), "local and global attention, rotary, GeGLU"),
    ("mpnet", "encoder", "MPNetForMaskedLM", "MPNetConfig", {**BERT_LIKE, "pad_token_id": 1},
     functools.partial(lm_inputs, low=2), "relative position buckets shared by every layer"),
    ("funnel", "encoder", "FunnelForMaskedLM", "FunnelConfig",
     {"vocab_size": VOCAB, "block_sizes": [1, 1], "d_model": WIDTH, "n_head": HEADS, "d_head": WIDTH // HEADS,
      "d_inner": 2 * WIDTH, "attention_dropout": ATTN_DROP, "num_decoder_layers": 1},
     functools.partial(lm_inputs, low=1), "pooled sequence between blocks, relative attention, a decoder"),
    ("wav2vec2", "encoder", "Wav2Vec2ForCTC", "Wav2Vec2Config",
     {"vocab_size": 32, "hidden_size": WIDTH, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
      "intermediate_size": 2 * WIDTH, "conv_dim": [32, 32], "conv_stride": [5, 2], "conv_kernel": [10, 3],
      "num_conv_pos_embeddings": 16, "num_conv_pos_embedding_groups": 4, "attention_dropout": ATTN_DROP,
      "mask_time_prob": 0.0, "pad_token_id": 0, "ctc_loss_reduction": "mean"},
     lambda g: {"input_values": torch.randn(BATCH, 4000, generator=g),
                "labels": torch.randint(1, 32, (BATCH, 20), generator=g)},
     "convolutional audio features, CTC loss"),
    ("pegasus", "seq2seq", "PegasusForConditionalGeneration", "PegasusConfig",
     {**BART_LIKE, "pad_token_id": 0, "decoder_start_token_id": 0, "eos_token_id": 1}, seq2seq_inputs,
     "pre-norm encoder-decoder, sinusoidal positions"),
    ("mbart", "seq2seq", "MBartForConditionalGeneration", "MBartConfig", BART_LIKE, seq2seq_inputs,
     "pre-norm encoder-decoder, final norms"),
    ("switch", "seq2seq", "SwitchTransformersForConditionalGeneration", "SwitchTransformersConfig",
     {"vocab_size": VOCAB, "d_model": WIDTH, "d_kv": WIDTH // HEADS, "d_ff": 2 * WIDTH, "num_layers": LAYERS,
      "num_decoder_layers": LAYERS, "num_heads": HEADS, "num_experts": 4, "expert_capacity": 64,
      "num_sparse_encoder_layers": 1, "num_sparse_decoder_layers": 1, "dropout_rate": 0.1, "use_cache": False,
      "decoder_start_token_id": 0, "pad_token_id": 0, "eos_token_id": 1},
     lambda g: {**seq2seq_inputs(g), "attention_mask": torch.ones(BATCH, SEQ, dtype=torch.long)},
     "top-1 routed experts with a capacity, T5 layout"),
    ("umt5", "seq2seq", "UMT5ForConditionalGeneration", "UMT5Config",
     {"vocab_size": VOCAB, "d_model": WIDTH, "d_kv": WIDTH // HEADS, "d_ff": 2 * WIDTH, "num_layers": LAYERS,
      "num_decoder_layers": LAYERS, "num_heads": HEADS, "dropout_rate": 0.1, "use_cache": False,
      "decoder_start_token_id": 0, "pad_token_id": 0, "eos_token_id": 1},
     seq2seq_inputs, "relative position buckets in every layer, gated GELU"),
    ("deit", "vision", "DeiTForImageClassification", "DeiTConfig",
     {"image_size": IMAGE, "patch_size": 4, "hidden_size": WIDTH, "num_hidden_layers": LAYERS,
      "num_attention_heads": HEADS, "intermediate_size": 2 * WIDTH, "attention_probs_dropout_prob": ATTN_DROP,
      "num_labels": 10},
     image_inputs, "class and distillation tokens"),
    ("beit", "vision", "BeitForImageClassification", "BeitConfig",
     {"image_size": IMAGE, "patch_size": 4, "hidden_size": WIDTH, "num_hidden_layers": LAYERS,
      "num_attention_heads": HEADS, "intermediate_size": 2 * WIDTH, "attention_probs_dropout_prob": ATTN_DROP,
      "use_relative_position_bias": True, "drop_path_rate": 0.1, "num_labels": 10},
     image_inputs, "relative position bias added to the attention mask, layer scale, mean pooling"),
    ("dinov2", "vision", "Dinov2ForImageClassification", "Dinov2Config",
     {"image_size": IMAGE, "patch_size": 4, "hidden_size": WIDTH, "num_hidden_layers": LAYERS,
      "num_attention_heads": HEADS, "mlp_ratio": 2, "attention_probs_dropout_prob": ATTN_DROP,
      "drop_path_rate": 0.1, "num_labels": 10},
     image_inputs, "interpolated positions, layer scale, stochastic depth"),
    ("convnextv2", "vision", "ConvNextV2ForImageClassification", "ConvNextV2Config",
     {"patch_size": 2, "hidden_sizes": [32, 64], "depths": [2, 2], "num_stages": 2, "drop_path_rate": 0.1,
      "num_labels": 10},
     image_inputs, "global response normalisation"),
    ("regnet", "vision", "RegNetForImageClassification", "RegNetConfig",
     {"embedding_size": 16, "hidden_sizes": [32, 64], "depths": [1, 2], "groups_width": 8, "num_labels": 10},
     functools.partial(image_inputs, batch=8, size=64), "grouped convolutions, squeeze-excitation, BatchNorm"),
    ("mobilenet_v2", "vision", "MobileNetV2ForImageClassification", "MobileNetV2Config",
     {"image_size": 64, "depth_multiplier": 0.25, "num_labels": 10},
     functools.partial(image_inputs, batch=8, size=64), "inverted residuals, depthwise convolutions, ReLU6"),
    ("segformer", "vision", "SegformerForImageClassification", "SegformerConfig",
     {"num_encoder_blocks": 2, "depths": [1, 1], "sr_ratios": [2, 1], "hidden_sizes": [16, 32],
      "num_attention_heads": [1, 2], "patch_sizes": [7, 3], "strides": [4, 2], "mlp_ratios": [2, 2],
      "attention_probs_dropout_prob": ATTN_DROP, "drop_path_rate": 0.1, "num_labels": 10},
     functools.partial(image_inputs, size=64), "overlapping patches, reduced-key attention, Mix-FFN"),
    ("clip", "vision", "CLIPModel", "CLIPConfig",
     {"text_config": {"vocab_size": VOCAB, "hidden_size": WIDTH, "intermediate_size": 2 * WIDTH,
                      "num_hidden_layers": LAYERS, "num_attention_heads": HEADS, "max_position_embeddings": 64,
                      "attention_dropout": ATTN_DROP},
      "vision_config": {"image_size": IMAGE, "patch_size": 4, "hidden_size": WIDTH, "intermediate_size": 2 * WIDTH,
                        "num_hidden_layers": LAYERS, "num_attention_heads": HEADS, "attention_dropout": ATTN_DROP},
      "projection_dim": 32},
     lambda g: {"input_ids": torch.randint(1, VOCAB, (BATCH, 16), generator=g),
                "pixel_values": torch.randn(BATCH, 3, IMAGE, IMAGE, generator=g), "return_loss": True},
     "text and image towers, contrastive loss"),
]

#: families HuggingFace cannot checkpoint (``supports_gradient_checkpointing`` is False): the
#: layer classes the hand-written every-layer wraps
HAND_LAYERS = {"convnext": ("ConvNextLayer",), "resnet": ("ResNetBasicLayer",), "albert": ("AlbertLayer",),
               "mpnet": ("MPNetLayer",), "funnel": ("FunnelLayer",), "convnextv2": ("ConvNextV2Layer",),
               "regnet": ("RegNetYLayer", "RegNetXLayer"), "mobilenet_v2": ("MobileNetV2InvertedResidual",)}
