"""Tiny Hugging Face models and inputs for every libai_zoo model class, shared by the model tests.

Each case builds a `transformers` model from a small random config (dropout 0, sizes that split
over tp = 2), the matching libai_zoo class, and a padded batch with labels.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import transformers

from libai_zoo import models
from libai_zoo.hf.rules import joined
from libai_zoo.layers import Router, VocabEmbedding

VOCAB, HIDDEN, HEADS, FFN, LAYERS, SEQ = 128, 32, 4, 64, 2, 12
TARGET = 8  # a sequence-to-sequence case's target length (its source: SEQ)
NO_DROPOUT = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


@dataclass
class Family:
    """A model family's test description: the transformers class, the zoo class, a tiny config with
    the family's distinguishing features on, and how its inputs and outputs look."""

    hf_class: type
    zoo_class: type
    make_config: Callable[[], transformers.PretrainedConfig]
    #: "causal", "mlm", "seq_cls", "encoder", "image_cls", "image"; "seq2seq" (labels: the targets and,
    #: shifted right, the decoder's inputs), "seq2seq_body" (decoder_input_ids), "text_encoder" (T5's encoder)
    kind: str
    #: padding positions hold the config's pad token and the first row is left-padded (RoBERTa
    #: counts its positions over the non-padding tokens)
    pad_tokens: bool = False
    #: parameters (name suffixes) transformers starts at zero, drawn from N(0, 0.2) by make_hf_model so
    #: that a zoo model leaving them out shows
    drawn: tuple[str, ...] = ()
    #: the LM head has weights of its own, config.json's tie_word_embeddings false: the hub's T5 1.1
    #: and mT5 checkpoints (transformers 5 ties every T5 head it builds; make_hf_model unties it)
    own_head: bool = False
    #: parameters (name suffixes) moved by a constant after drawing, (suffix, shift) pairs
    moved: tuple[tuple[str, float], ...] = ()

    @property
    def generates(self) -> bool:
        return self.kind in ("causal", "seq2seq")


def gpt2_config(**kw):
    return transformers.GPT2Config(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_inner=FFN,
                                   n_positions=64, bos_token_id=1, eos_token_id=2, resid_pdrop=0.0, embd_pdrop=0.0,
                                   attn_pdrop=0.0, **kw)


def llama_config(**kw):
    defaults = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                    num_key_value_heads=2, intermediate_size=FFN, max_position_embeddings=64, rope_theta=500000.0,
                    bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    return transformers.LlamaConfig(**{**defaults, **kw})


def qwen2_config():
    return transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                                    num_attention_heads=HEADS, num_key_value_heads=2, intermediate_size=FFN,
                                    max_position_embeddings=64, bos_token_id=1, eos_token_id=2)


def qwen3_config(**kw):
    """q/k norms per head (their weights drawn away from 1 in make_hf_model), head_dim 16 ≠ 32/4, a
    sliding window of 4 on the second layer."""
    defaults = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                    num_key_value_heads=2, head_dim=16, intermediate_size=FFN, max_position_embeddings=64,
                    use_sliding_window=True, sliding_window=4, max_window_layers=1, bos_token_id=1, eos_token_id=2,
                    tie_word_embeddings=False)
    return transformers.Qwen3Config(**{**defaults, **kw})


def mistral_config(**kw):
    """Every layer sees the last 4 positions (of 12), head_dim 16 ≠ 32/4."""
    defaults = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                    num_key_value_heads=2, head_dim=16, intermediate_size=FFN, max_position_embeddings=64,
                    sliding_window=4, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    return transformers.MistralConfig(**{**defaults, **kw})


def olmo2_config(**kw):
    """Norms on the branch outputs only, q/k norms over the whole projection (4 q heads, 2 KV heads)."""
    defaults = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                    num_key_value_heads=2, intermediate_size=FFN, max_position_embeddings=64, pad_token_id=0,
                    bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    return transformers.Olmo2Config(**{**defaults, **kw})


def mixtral_config(**kw):
    """4 experts of 16 neurons, top 2, a window of 4 (of 12), head_dim 16; the loss includes the
    auxiliary loss × 0.1 (output_router_logits)."""
    defaults = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                    num_key_value_heads=2, head_dim=16, intermediate_size=16, num_local_experts=4,
                    num_experts_per_tok=2, max_position_embeddings=64, sliding_window=4, output_router_logits=True,
                    router_aux_loss_coef=0.1, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    return transformers.MixtralConfig(**{**defaults, **kw})


def qwen2_moe_config(**kw):
    """Layer 0 MoE (4 experts of 16 neurons, top 2 not renormalised, a shared expert of 32 behind
    its sigmoid gate), layer 1 dense (mlp_only_layers); biases on q, k, v; aux loss × 0.1 in the loss."""
    defaults = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                    num_key_value_heads=2, intermediate_size=FFN, moe_intermediate_size=16,
                    shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2, mlp_only_layers=[1],
                    max_position_embeddings=64, output_router_logits=True, router_aux_loss_coef=0.1,
                    bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    return transformers.Qwen2MoeConfig(**{**defaults, **kw})


def qwen3_moe_config(**kw):
    """Every 2nd layer MoE (decoder_sparse_step: layer 1; 4 experts of 16 neurons, top 2
    renormalised), per-head q/k norms, head_dim 16; aux loss × 0.1 in the loss."""
    defaults = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                    num_key_value_heads=2, head_dim=16, intermediate_size=FFN, moe_intermediate_size=16,
                    num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=2,
                    max_position_embeddings=64, output_router_logits=True, router_aux_loss_coef=0.1,
                    bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    return transformers.Qwen3MoeConfig(**{**defaults, **kw})


def olmoe_config(**kw):
    """8 experts of 16 neurons in every layer, top 2 not renormalised; q/k norms over the whole
    projection; aux loss × 0.1 in the loss."""
    defaults = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                    num_key_value_heads=2, intermediate_size=16, num_experts=8, num_experts_per_tok=2,
                    max_position_embeddings=64, output_router_logits=True, router_aux_loss_coef=0.1,
                    pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    return transformers.OlmoeConfig(**{**defaults, **kw})


#: DeepSeek-V3's yarn: an original context of 8 stretched 4× (the 12 positions pass it), mscale 0.707
#: against mscale_all_dim 1, so that both the cos/sin multiplier and the softmax's mscale² are ≠ 1
DEEPSEEK_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 8,
                 "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}


def deepseek_v3_config(**kw):
    """Multi-head latent attention (q latent 16, kv latent 12; per head 8 channels without positions,
    4 interleaved rotary ones shared by all heads' keys, values 6 wide) with yarn; layer 0 dense,
    layer 1 an MoE of 8 experts of 16 neurons in 4 groups (top 2 of the 2 best groups, weights
    normalised × 2.5) plus 2 shared experts (32 neurons); weights drawn 5× wider than the default, so
    that q·k is not near zero and the sigmoid scores spread. make_hf_model draws the correction bias."""
    defaults = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                    num_key_value_heads=HEADS, intermediate_size=FFN, moe_intermediate_size=16, q_lora_rank=16,
                    kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, n_routed_experts=8,
                    num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=2, routed_scaling_factor=2.5,
                    first_k_dense_replace=1, max_position_embeddings=32, rope_parameters=DEEPSEEK_YARN,
                    initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=None)
    return transformers.DeepseekV3Config(**{**defaults, **kw})


def gpt_oss_config(**kw):
    """4 experts of 16 neurons, top 2 (softmax over the two router logits, router bias), biases and
    the clamped SwiGLU (limit 0.5: weights drawn 5× wider than the default, so that the clamp
    bites), attention sinks, a window of 4 (of 12) on layer 0 (layer_types: sliding, full), YaRN
    with an original context of 16 (factor 4 = 64 / 16); aux loss × 0.1 in the loss."""
    rope = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "truncate": False, "original_max_position_embeddings": 16}
    defaults = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                    num_key_value_heads=2, head_dim=8, intermediate_size=16, num_local_experts=4,
                    num_experts_per_tok=2, max_position_embeddings=64, sliding_window=4, rope_parameters=rope,
                    swiglu_limit=0.5, initializer_range=0.1, output_router_logits=True, router_aux_loss_coef=0.1,
                    bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    return transformers.GptOssConfig(**{**defaults, **kw})


def phi3_config(**kw):
    """LongRoPE with an original context of 8 (of the 12 positions: the long factors apply) and its
    cos/sin multiplier (sqrt(1 + ln 8 / ln 8)), 3/4 of each head's 8 channels rotating, grouped
    q/k/v (2 KV heads) in the fused qkv_proj; weights drawn 5× wider than the default, so that q·k
    (and with it where the positions rotate it) is not near zero."""
    defaults = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                    num_key_value_heads=2, intermediate_size=FFN, max_position_embeddings=64,
                    original_max_position_embeddings=8, partial_rotary_factor=0.75,
                    rope_scaling={"type": "longrope", "short_factor": [1.0, 1.3, 1.7], "long_factor": [2.0, 5.0, 11.0]},
                    initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=None)
    return transformers.Phi3Config(**{**defaults, **kw})


def phi3_short_config():
    """An original context of 16: the 12 positions take the short factors, generation passes 16 (and
    recomputes its cache with the long ones); all channels rotate; a window of 6 (Phi-3-mini's 2047)."""
    return phi3_config(original_max_position_embeddings=16, partial_rotary_factor=1.0, sliding_window=6,
                       rope_scaling={"type": "longrope", "short_factor": [1.5, 2.0, 3.0, 4.0],
                                     "long_factor": [0.25, 0.5, 30.0, 90.0]})


def granite_config(**kw):
    """Every multiplier far from 1 (the 1/64 softmax scale against 1/sqrt(8)); weights drawn 5× wider
    than the default, so that q·k is not near zero whatever its scale."""
    defaults = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                    num_key_value_heads=2, intermediate_size=FFN, max_position_embeddings=64, embedding_multiplier=12.0,
                    residual_multiplier=0.22, attention_multiplier=1 / 64, logits_scaling=8.0, initializer_range=0.1,
                    bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    return transformers.GraniteConfig(**{**defaults, **kw})


def smollm3_config(**kw):
    """Every 2nd layer without positions (SmolLM3's every 4th, in 2 layers), weights drawn 5× wider
    than the default (q·k not near zero); tied embeddings."""
    defaults = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                    num_key_value_heads=2, intermediate_size=FFN, max_position_embeddings=64,
                    no_rope_layer_interval=2, initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=None)
    return transformers.SmolLM3Config(**{**defaults, **kw})


def gemma_config(**kw):
    """(1 + w) norms (drawn away from 0 in make_hf_model), embeddings × sqrt(32), head_dim 16 ≠ 32/4, tied."""
    defaults = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                    num_key_value_heads=2, head_dim=16, intermediate_size=FFN, max_position_embeddings=64,
                    bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return transformers.GemmaConfig(**{**defaults, **kw})


#: Gemma 2 and 3 weights drawn 10× wider than their default: attention scores and logits of a few
#: units, so that the soft-caps (scores at ±1.5, logits at ±2) bite
GEMMA_WIDE = dict(initializer_range=0.2)


def gemma2_config(**kw):
    """Sandwich norms, softmax scale 64^-0.5 ≠ head_dim^-0.5, scores capped at ±1.5 and logits at
    ±2, a window of 4 on layer 1 (layer_types: sliding, full)."""
    defaults = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                    num_key_value_heads=2, head_dim=16, intermediate_size=FFN, max_position_embeddings=64,
                    query_pre_attn_scalar=64, attn_logit_softcapping=1.5, final_logit_softcapping=2.0,
                    sliding_window=4, bos_token_id=1, eos_token_id=2, pad_token_id=0, **GEMMA_WIDE)
    return transformers.Gemma2Config(**{**defaults, **kw})


#: Gemma 3's rotary bases: far apart, and the full layers' table scaled (as the 4B-27B models are)
GEMMA3_LOCAL_BASE, GEMMA3_GLOBAL_BASE = 10.0, 1e6


def gemma3_text_config(**kw):
    """Per-head (1 + w) q/k norms, sandwich norms, softmax scale 64^-0.5, a window of 4 on the
    sliding layer; the sliding layer rotates with base 10, the full one with base 1e6 scaled
    linearly by 4."""
    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": GEMMA3_LOCAL_BASE},
            "full_attention": {"rope_type": "linear", "rope_theta": GEMMA3_GLOBAL_BASE, "factor": 4.0}}
    defaults = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                    num_key_value_heads=2, head_dim=16, intermediate_size=FFN, max_position_embeddings=64,
                    query_pre_attn_scalar=64, sliding_window=4, layer_types=["sliding_attention", "full_attention"],
                    rope_parameters=rope, bos_token_id=1, eos_token_id=2, pad_token_id=0, **GEMMA_WIDE)
    return transformers.Gemma3TextConfig(**{**defaults, **kw})


def gemma3_multimodal_config(**text):
    """A Gemma3ForConditionalGeneration (the 4B-27B checkpoints): the gemma3 text model (changed by
    `text`) and a one-layer vision tower."""
    vision = transformers.SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=16, patch_size=4)
    return transformers.Gemma3Config(text_config=gemma3_text_config(**text), vision_config=vision,
                                     mm_tokens_per_image=4)


def gpt_neox_config(**kw):
    """Sequential residual (Megatron's RoPE GPT), half of each head's channels rotating."""
    defaults = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                    intermediate_size=FFN, max_position_embeddings=64, use_parallel_residual=False,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
                    hidden_dropout=0.0, attention_dropout=0.0, bos_token_id=1, eos_token_id=2)
    return transformers.GPTNeoXConfig(**{**defaults, **kw})


def bert_config(**kw):
    return transformers.BertConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                                   num_attention_heads=HEADS, intermediate_size=FFN, max_position_embeddings=64,
                                   num_labels=3, **NO_DROPOUT, **kw)


def roberta_config():
    """The encoder's activation is ReLU: the MLM head's is GELU whatever it is; 14
    positions, as roberta-base's 514 = padding_idx + 1 + 512."""
    return transformers.RobertaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                                      num_attention_heads=HEADS, intermediate_size=FFN, max_position_embeddings=SEQ + 2,
                                      type_vocab_size=1, num_labels=3, hidden_act="relu", **NO_DROPOUT)


#: 8 buckets up to distance 16: the encoder's 12 positions fall in exact (distance < 2) and
#: logarithmic buckets on both sides, the decoder's 8 in exact (< 4) and logarithmic ones
T5_SIZES = dict(vocab_size=VOCAB, d_model=HIDDEN, d_kv=8, d_ff=FFN, num_layers=LAYERS, num_heads=HEADS,
                relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=0.0,
                decoder_start_token_id=0)


def t5_config(**kw):
    """T5 1.0: ReLU MLP, the head tied to the shared table, the decoder's output × d_model^-0.5."""
    return transformers.T5Config(**{**T5_SIZES, **kw})


def t5_v1_1_config(**kw):
    """T5 1.1: gated GELU MLP, the head its own (own_head), the decoder's output unscaled."""
    return t5_config(feed_forward_proj="gated-gelu", tie_word_embeddings=False, **kw)


def mt5_config(**kw):
    """mT5: T5 1.1's architecture (gated GELU by default), its head tied to the shared table as
    transformers 5 builds it, and yet the decoder's output unscaled (T5's own classes scale a tied
    head's input; the hub's untied mT5 heads are T5 1.1's case). Weights drawn at half transformers'
    scale: unscaled logits of about 10, not 30, whose float32 rounding stays well within the parity
    tolerance at tp2."""
    return transformers.MT5Config(**{**T5_SIZES, "initializer_factor": 0.5, **kw})


def vit_config():
    return transformers.ViTConfig(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                  intermediate_size=FFN, image_size=12, patch_size=4, num_labels=3, **NO_DROPOUT)


#: Swin's bias table and positions start at zero; Swin V2's bias MLP and temperatures (all ln 10) are
#: drawn too, so that the bias varies with the offset and the temperature with the head
SWIN_DRAWN = ("relative_position_bias_table", "position_embeddings")
SWINV2_DRAWN = ("continuous_position_bias_mlp.0.weight", "continuous_position_bias_mlp.2.weight", "logit_scale")
#: Swin V2's temperatures from 10 (exp of transformers' ln 10) down to about 2: at 10 the scores span
#: ±10 and float32 rounds transformers' own outputs ~1e-5 away from exact (float64) ones
SWINV2_MOVED = (("logit_scale", -math.log(5.0)),)

#: Three stages (widths 32, 64, 128; heads 2, 4, 4, so tp = 2 splits each) on a 10 × 10 patch grid with
#: windows of 3: stage 1 pads 10 to 12 and shifts its second block, stage 2 (5 × 5 after merging)
#: pads to 6 and shifts, stage 3 (3 × 3) is one window, unshifted; stochastic depth (off in eval).
#: Weights drawn 5× wider than the default: the features then move the logits far more than 1e-3,
#: and Swin V2's output norms (res-post-norm), which divide the gradient by a branch output's spread,
#: keep float32's noise well under 1e-5
SWIN_SIZES = dict(image_size=20, patch_size=2, embed_dim=32, depths=[2, 2, 1], num_heads=[2, 4, 4], window_size=3,
                  mlp_ratio=2.0, drop_path_rate=0.2, initializer_range=0.1, num_labels=3, **NO_DROPOUT)


def swin_config(**kw):
    """Swin with learned absolute positions."""
    return transformers.SwinConfig(**{**SWIN_SIZES, "use_absolute_embeddings": True, **kw})


def swinv2_config(**kw):
    """Swin V2 fits its window to the nominal resolutions 10, 5, 2 (grid // 2^stage): its stage 3 runs
    2 × 2 windows over its 3 × 3 map padded to 4 × 4; stage 2's position bias pre-trained at windows of 4."""
    return transformers.Swinv2Config(**{**SWIN_SIZES, "pretrained_window_sizes": [0, 4, 0], **kw})


CASES = {
    "gpt2": Family(transformers.GPT2LMHeadModel, models.GPT2LMHeadModel, gpt2_config, "causal"),
    "gpt2_body": Family(transformers.GPT2Model, models.GPT2Model, gpt2_config, "encoder"),
    "llama": Family(transformers.LlamaForCausalLM, models.LlamaForCausalLM, llama_config, "causal"),
    "llama_tied_bias": Family(transformers.LlamaForCausalLM, models.LlamaForCausalLM,
                            lambda: llama_config(tie_word_embeddings=True, attention_bias=True, mlp_bias=True,
                                                 num_key_value_heads=4), "causal"),
    # Llama 3.1's frequency rescaling: with head_dim 8 and an original context of 16 positions one
    # frequency is kept, one blended and two divided by the factor.
    "llama3_rope": Family(transformers.LlamaForCausalLM, models.LlamaForCausalLM,
                        lambda: llama_config(rope_parameters={
                            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 16}), "causal"),
    "llama_linear_rope": Family(transformers.LlamaForCausalLM, models.LlamaForCausalLM,
                              lambda: llama_config(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0,
                                                                    "factor": 4.0}), "causal"),
    "qwen2": Family(transformers.Qwen2ForCausalLM, models.LlamaForCausalLM, qwen2_config, "causal"),
    "gpt_neox": Family(transformers.GPTNeoXForCausalLM, models.GPTNeoXForCausalLM, gpt_neox_config, "causal"),
    "gpt_neox_tied": Family(transformers.GPTNeoXForCausalLM, models.GPTNeoXForCausalLM,
                          lambda: gpt_neox_config(tie_word_embeddings=True, hidden_act="gelu_new",
                                                  rope_parameters={"rope_type": "default", "rope_theta": 500000.0,
                                                                   "partial_rotary_factor": 1.0}), "causal"),
    "pythia": Family(transformers.GPTNeoXForCausalLM, models.GPTNeoXForCausalLM,
                   lambda: gpt_neox_config(use_parallel_residual=True), "causal"),
    "qwen3": Family(transformers.Qwen3ForCausalLM, models.Qwen3ForCausalLM, qwen3_config, "causal"),
    "qwen3_tied": Family(transformers.Qwen3ForCausalLM, models.Qwen3ForCausalLM,
                       lambda: qwen3_config(tie_word_embeddings=True, use_sliding_window=False), "causal"),
    # One KV head (Gemma 3 270M's count): at tp = 2 both ranks hold it, each with two of the q heads.
    "qwen3_one_kv_head": Family(transformers.Qwen3ForCausalLM, models.Qwen3ForCausalLM,
                              lambda: qwen3_config(num_key_value_heads=1), "causal"),
    "mistral": Family(transformers.MistralForCausalLM, models.MistralForCausalLM, mistral_config, "causal"),
    "olmo2": Family(transformers.Olmo2ForCausalLM, models.Olmo2ForCausalLM, olmo2_config, "causal"),
    "mixtral": Family(transformers.MixtralForCausalLM, models.MixtralForCausalLM, mixtral_config, "causal"),
    "qwen2_moe": Family(transformers.Qwen2MoeForCausalLM, models.Qwen2MoeForCausalLM, qwen2_moe_config, "causal"),
    "qwen3_moe": Family(transformers.Qwen3MoeForCausalLM, models.Qwen3MoeForCausalLM, qwen3_moe_config, "causal"),
    "olmoe": Family(transformers.OlmoeForCausalLM, models.OlmoeForCausalLM, olmoe_config, "causal"),
    "deepseek_v3": Family(transformers.DeepseekV3ForCausalLM, models.DeepseekV3ForCausalLM, deepseek_v3_config,
                        "causal"),
    "gpt_oss": Family(transformers.GptOssForCausalLM, models.GptOssForCausalLM, gpt_oss_config, "causal",
                    drawn=("gate_up_proj_bias", "down_proj_bias")),
    "gemma": Family(transformers.GemmaForCausalLM, models.GemmaForCausalLM, gemma_config, "causal"),
    "gemma2": Family(transformers.Gemma2ForCausalLM, models.Gemma2ForCausalLM, gemma2_config, "causal"),
    "gemma3": Family(transformers.Gemma3ForCausalLM, models.Gemma3ForCausalLM, gemma3_text_config, "causal"),
    "phi3": Family(transformers.Phi3ForCausalLM, models.Phi3ForCausalLM, phi3_config, "causal"),
    "phi3_short": Family(transformers.Phi3ForCausalLM, models.Phi3ForCausalLM, phi3_short_config, "causal"),
    "granite": Family(transformers.GraniteForCausalLM, models.GraniteForCausalLM, granite_config, "causal"),
    "smollm3": Family(transformers.SmolLM3ForCausalLM, models.SmolLM3ForCausalLM, smollm3_config, "causal"),
    "gpt_neox_body": Family(transformers.GPTNeoXModel, models.GPTNeoXModel, gpt_neox_config, "encoder"),
    "llama_body": Family(transformers.LlamaModel, models.LlamaModel, llama_config, "encoder"),
    "bert": Family(transformers.BertModel, models.BertModel, bert_config, "encoder"),
    "bert_mlm": Family(transformers.BertForMaskedLM, models.BertForMaskedLM, bert_config, "mlm"),
    "bert_cls": Family(transformers.BertForSequenceClassification, models.BertForSequenceClassification,
                     bert_config, "seq_cls"),
    "roberta": Family(transformers.RobertaModel, models.RobertaModel, roberta_config, "encoder", pad_tokens=True),
    "roberta_mlm": Family(transformers.RobertaForMaskedLM, models.RobertaForMaskedLM, roberta_config, "mlm",
                        pad_tokens=True),
    "roberta_cls": Family(transformers.RobertaForSequenceClassification, models.RobertaForSequenceClassification,
                        roberta_config, "seq_cls", pad_tokens=True),
    "t5": Family(transformers.T5ForConditionalGeneration, models.T5ForConditionalGeneration, t5_config, "seq2seq"),
    "t5_v1_1": Family(transformers.T5ForConditionalGeneration, models.T5ForConditionalGeneration, t5_v1_1_config,
                    "seq2seq", own_head=True),
    "mt5": Family(transformers.MT5ForConditionalGeneration, models.MT5ForConditionalGeneration, mt5_config, "seq2seq"),
    "t5_body": Family(transformers.T5Model, models.T5Model, t5_config, "seq2seq_body"),
    "t5_encoder": Family(transformers.T5EncoderModel, models.T5EncoderModel, t5_v1_1_config, "text_encoder"),
    "vit": Family(transformers.ViTModel, models.ViTModel, vit_config, "image"),
    "vit_cls": Family(transformers.ViTForImageClassification, models.ViTForImageClassification, vit_config,
                    "image_cls"),
    "swin": Family(transformers.SwinModel, models.SwinModel, swin_config, "image", drawn=SWIN_DRAWN),
    "swin_cls": Family(transformers.SwinForImageClassification, models.SwinForImageClassification, swin_config,
                     "image_cls", drawn=SWIN_DRAWN),
    "swinv2": Family(transformers.Swinv2Model, models.Swinv2Model, swinv2_config, "image", drawn=SWINV2_DRAWN,
                   moved=SWINV2_MOVED),
    "swinv2_cls": Family(transformers.Swinv2ForImageClassification, models.Swinv2ForImageClassification,
                       swinv2_config, "image_cls", drawn=SWINV2_DRAWN, moved=SWINV2_MOVED),
}


def make_hf_model(case: Family, seed: int = 0):
    """The transformers model, its norm weights drawn away from their initial value (1, or 0 for
    Gemma's (1 + w)): a norm the zoo applied without its weight, or not at all, would then show; so
    are a router's selection biases (0), and the case's `drawn` parameters; its `moved` ones moved."""
    torch.manual_seed(seed)
    model = case.hf_class(case.make_config()).eval()
    if case.own_head:
        model.lm_head.weight = torch.nn.Parameter(torch.randn_like(model.lm_head.weight) * 0.2)
        model.config.tie_word_embeddings = False
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name.lower() and name.endswith("weight") or name.endswith(case.drawn):
                param.add_(torch.randn_like(param) * 0.2)
            for suffix, shift in case.moved:
                if name.endswith(suffix):
                    param.add_(shift)
        for name, buffer in model.named_buffers():  # DeepSeek-V3's starts at 0: make it steer the routing
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.1)
    return model


def image_tokens(config: transformers.PretrainedConfig) -> int:
    """The tokens of an image model's output: ViT's patches and [CLS]; the patches of Swin's last
    stage (each stage after the first halves the side, rounding up)."""
    side = config.image_size // config.patch_size
    if not hasattr(config, "depths"):
        return side ** 2 + 1
    for _ in config.depths[1:]:
        side = (side + 1) // 2
    return side ** 2


def make_inputs(case: Family, seed: int = 1, batch: int = 2) -> tuple[dict, torch.Tensor]:
    """(forward kwargs with labels, mask of the positions to compare: padding excluded; an image
    model's output tokens, all compared: ViT's 9 patches + [CLS] split over tp = 2)."""
    g = torch.Generator().manual_seed(seed)
    if case.kind.startswith("image"):
        config = case.make_config()
        side = config.image_size
        inputs = {"pixel_values": torch.randn(batch, config.num_channels, side, side, generator=g)}
        if case.kind == "image_cls":
            inputs["labels"] = torch.randint(0, config.num_labels, (batch,), generator=g)
        return inputs, torch.ones(batch, image_tokens(config), dtype=torch.bool)
    ids = torch.randint(3, VOCAB, (batch, SEQ), generator=g)
    mask = torch.ones_like(ids)
    mask[-1, -4:] = 0  # the last sequence is shorter: right padding
    if case.pad_tokens:
        mask[0, :2] = 0  # and the first left-padded
        ids = ids.masked_fill(mask == 0, case.make_config().pad_token_id)
    inputs = {"input_ids": ids, "attention_mask": mask}
    if case.kind == "causal":
        inputs["labels"] = ids.masked_fill(mask == 0, -100)
    elif case.kind == "mlm":
        chosen = (torch.rand(ids.shape, generator=g) < 0.3) & mask.bool()
        chosen[0, mask[0].argmax()] = True  # the first token
        inputs["labels"] = ids.masked_fill(~chosen, -100)
    elif case.kind == "seq_cls":
        inputs["labels"] = torch.randint(0, 3, (batch,), generator=g)
    elif case.kind.startswith("seq2seq"):
        labels = torch.randint(3, VOCAB, (batch, TARGET), generator=g)
        labels[-1, -2:] = -100  # the shorter target: not scored, pad tokens in the decoder's inputs
        inputs["labels"] = labels
        if case.kind == "seq2seq_body":
            inputs = unscored(case, inputs)
    if case.hf_class.__name__.startswith("Bert"):
        inputs["token_type_ids"] = (torch.arange(SEQ) >= SEQ // 2).long().expand(batch, -1).clone()
    return inputs, mask.bool()


def unscored(case: Family, inputs: dict) -> dict:
    """`inputs` for a forward without a loss: no labels; a sequence-to-sequence model's decoder
    inputs made from them instead (transformers' rule: shifted right, the start token first, -100
    as the pad token)."""
    inputs = dict(inputs)
    labels = inputs.pop("labels", None)
    if case.kind.startswith("seq2seq") and labels is not None:
        config = case.make_config()
        shifted = torch.cat([torch.full_like(labels[:, :1], config.decoder_start_token_id), labels[:, :-1]], dim=1)
        inputs["decoder_input_ids"] = shifted.masked_fill(shifted == -100, config.pad_token_id)
    return inputs


def hf_generate(hf_model, ids: torch.Tensor, **kwargs) -> torch.Tensor:
    """transformers' greedy generation (its MoE models asked for no auxiliary loss: theirs fails
    while generating, its mask covering the cached positions too)."""
    if getattr(hf_model.config, "output_router_logits", False):
        kwargs["output_router_logits"] = False
    return hf_model.generate(ids, do_sample=False, eos_token_id=None, **kwargs)


def main_output(out) -> torch.Tensor:
    """The tensor to compare: logits of a task model, last hidden state of a body."""
    return out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state


def hf_checkpoint_grads(hf_model, directory) -> dict[str, torch.Tensor]:
    """The transformers model's gradients under its checkpoint names (transformers 5 may name its
    modules differently from the files it writes): saved as if they were the weights, buffers left out."""
    import copy

    from safetensors.torch import load_file

    grads = copy.deepcopy(hf_model)
    with torch.no_grad():
        for param, original in zip(grads.parameters(), hf_model.parameters()):
            param.copy_(original.grad)
    grads.save_pretrained(directory)
    buffers = {name for name, _ in hf_model.named_buffers()}  # they have no gradient (a router's selection bias)
    return {name: t for name, t in load_file(f"{directory}/model.safetensors").items() if name not in buffers}


def hf_named_grads(zoo_model) -> dict[str, torch.Tensor]:
    """The zoo model's gradients under Hugging Face names (through its own weight map)."""
    params = dict(zoo_model.named_parameters())
    pieces = []
    for rule in zoo_model.hf_weight_map().rules:
        if rule.zoo not in params:  # a buffer (DeepSeek-V3's e_score_correction_bias)
            continue
        grad = params[rule.zoo].grad
        if grad is not None:
            grad = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
            pieces += rule.save(grad).items()
    return joined(pieces)


def zoo_model(name: str, **changes) -> torch.nn.Module:
    """Family `name`'s libai_zoo model, freshly initialised, its config changed by `changes` (the
    trainer's tests give it the tokenizer's vocabulary and enough layers for their pipelines); the
    config's per-layer lists (`layer_types`, ...) repeat to a new `num_hidden_layers`."""
    case = CASES[name]
    config = case.make_config()
    values, layers = config.to_dict(), changes.get("num_hidden_layers", config.num_hidden_layers)
    values.update({key: (value * layers)[:layers] for key, value in values.items()
                   if isinstance(value, list) and len(value) == config.num_hidden_layers})
    return case.zoo_class(type(config)(**{**values, **changes}))


def uneven_router(name: str, **changes) -> torch.nn.Module:
    """`zoo_model(name, **changes)` whose routers send every token to expert 0 and none to the last
    two experts (the rest share the second choice), at any layout: drawn so by `init_parameter`, the
    token embeddings share one direction d, which the routers' first row follows and their last two
    rows oppose. Expert parallelism then meets uneven splits, empty experts and ranks sent nothing."""
    model = zoo_model(name, **changes)
    base = type(model)

    def init_parameter(self, name: str, module: torch.nn.Module, tensor: torch.Tensor, generator) -> None:
        base.init_parameter(self, name, module, tensor, generator)
        d = torch.ones(tensor.shape[-1]) / tensor.shape[-1] ** 0.5
        if isinstance(module, VocabEmbedding):
            tensor += 0.1 * d
        elif isinstance(module, Router) and name.endswith("weight"):
            tensor[0] += d
            tensor[-2:] -= d

    model.__class__ = type(f"Uneven{base.__name__}", (base,), {"init_parameter": init_parameter})
    return model
