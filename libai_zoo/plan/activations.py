"""Analytic model of the activation memory of training: the bytes one rank saves for backward.

Every number here is a sum of tensors that autograd really keeps between a micro-batch's forward
and its backward in this repository's layers (read from `libai_zoo.layers` and checked with
`torch.autograd.graph.saved_tensors_hooks`, one count per storage, parameters excluded:
tests/test_planner_activations.py). Sizes per rank, per micro-batch:

    B micro-batch, S sequence, h hidden, t = tp
    T  = B·S            tokens a column-parallel linear sees (the whole sequence, gathered under SP)
    Tr = B·S/t under SP, else T: tokens of the residual stream (norms, residual dropout, residual adds)
    n, k = heads/t, KV heads/t; d head_dim; f = ffn/t
    a  = bytes of the compute dtype (4, or 2 under bf16/fp16 autocast); p = 4 (float32 parameters
         and residual stream: embeddings and residual adds stay float32 under autocast)

What this repository's layers do that a textbook (Megatron-LM's 34·sbh + 5·as²b) formula misses:

- Under sequence parallelism the all-gathered input of the column-parallel linears is saved whole
  (T·h, `gather_from_sp` keeps nothing, the matmul saves its gathered input); Megatron saves the
  local shard and gathers again in backward. Norms, dropout and residuals are divided by t.
- Under autocast each linear saves its own low-precision copy of its input (a copy per call: the
  gated MLP's gate and up each keep one) and of its weight (2 bytes per parameter of the layer,
  per micro-batch: autocast caches the cast of a leaf parameter only within one autocast region,
  and a tp-sharded weight's local tensor is no leaf, so it is cast at every use).
- RMSNorm computes in float32 and keeps its float32 normalized output beside its input.
- Rotary attention keeps new q and k (and a contiguous v): the same bytes as the fused qkv output
  that SDPA would otherwise keep, plus the cos/sin tables.
- Dropout keeps a mask of the input's dtype on CPU (a multiply by a float mask) and a bool mask on
  CUDA (`native_dropout`). Under tp (or in a parallel block) the row-parallel bias is added after
  the reduction in float32, so under autocast the residual-dropout input, hence its CPU mask, is float32.

Attention (`F.scaled_dot_product_attention`, causal, no padding mask) is modelled after the kernel
SDPA picks (`sdpa_backend`): the fused kernels (flash / memory-efficient / cuDNN on CUDA; CPU's
flash kernel) save q, k, v, the output and a float32 logsumexp, O(S); the math path saves the
S×S probabilities (and with dropout the mask and the dropped probabilities), O(S²). On CPU (torch
2.13) the flash kernel runs when attention dropout is 0 and the math path when it is not, and the
math path computes a bf16/fp16 input in float32 (its saved tensors are float32). On CUDA dropout
runs inside the fused kernels (only the RNG state is saved). For a device present on this machine
the choice is asked of torch; for one that is not (planning a GPU run on a laptop) CUDA is assumed
to run a fused kernel, which holds for bf16/fp16 (fp32 with grouped-query attention falls back to
math on CUDA, not modelled without a GPU).

Not modelled: padding/custom attention masks, cross-attention, KV caches (inference), activations
other than those that save their input (gelu, silu; relu saves its output, one tensor fewer),
position_ids given per sample (the rotary tables are then B times larger), and the transient
memory of backward itself (gradients, a recomputed checkpoint or loss chunk).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

from libai_zoo.layers import LMHead, RMSNorm

#: Bytes per element of the parameters and of the residual stream (float32 in this repository).
PARAM_BYTES = 4
#: Bytes of an index (int64 token ids, targets) and of a bool mask.
INDEX_BYTES, BOOL_BYTES = 8, 1
#: Bytes of a float32 statistic (norm mean/rstd, softmax logsumexp).
STAT_BYTES = 4


@dataclass(frozen=True)
class LayerShape:
    """What a TransformerLayer's saved activations depend on.

    ``row_bias``: the row-parallel projections (attention out, MLP down) have biases; it changes
    only the dtype of the residual-dropout mask on CPU under autocast (see the module docstring)."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    gated_mlp: bool
    norm: str  # "layernorm" | "rmsnorm"
    attention_dropout: float
    hidden_dropout: float
    parallel_block: bool
    pre_norm: bool
    rotary: bool
    row_bias: bool = True

    @classmethod
    def of(cls, layer: nn.Module) -> LayerShape:
        """Read from an (unsharded, possibly meta) `libai_zoo.layers.TransformerLayer`."""
        attn, mlp = layer.attn, layer.mlp
        return cls(hidden_size=layer.attn_norm.normalized_shape[-1], num_heads=attn.num_heads,
                   num_kv_heads=attn.num_kv_heads, head_dim=attn.head_dim, ffn_hidden_size=mlp.ffn_hidden_size,
                   gated_mlp=mlp.gate is not None,
                   norm="rmsnorm" if isinstance(layer.attn_norm, RMSNorm) else "layernorm",
                   attention_dropout=float(attn.dropout), hidden_dropout=float(layer.dropout.p),
                   parallel_block=bool(layer.parallel_block), pre_norm=layer.norm_position != "post",
                   rotary=attn.rotary is not None,
                   row_bias=attn.out.bias is not None or mlp.down.bias is not None)


def _device_type(device: str | torch.device | None) -> str:
    """The device type the prediction is for: the given one, else this machine's (CUDA if present)."""
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device).type


def _compute_bytes(amp_dtype: torch.dtype | None) -> int:
    """Bytes per element of what the matmuls compute in: the autocast dtype, else float32."""
    return PARAM_BYTES if amp_dtype is None else amp_dtype.itemsize


def _mask_bytes(device_type: str, input_bytes: int) -> int:
    """Bytes per element of a dropout mask: bool from CUDA's fused dropout, the input's dtype on CPU."""
    return BOOL_BYTES if device_type == "cuda" else input_bytes


def _asked_backend(device_type: str, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int,
                   dropout: float) -> str | None:
    """torch's own choice (`torch._fused_sdp_choice` on tiny tensors); None from a torch without it."""
    q = torch.zeros(1, num_heads, 64, head_dim, dtype=dtype, device=device_type)
    kv = torch.zeros(1, num_kv_heads, 64, head_dim, dtype=dtype, device=device_type)
    try:
        choice = torch._fused_sdp_choice(q, kv, kv, None, dropout, True, scale=None,
                                         enable_gqa=num_heads != num_kv_heads)
    except (AttributeError, TypeError, RuntimeError):
        return None
    return "math" if choice == torch.nn.attention.SDPBackend.MATH.value else "fused"


@functools.lru_cache(maxsize=None)
def sdpa_backend(device_type: str, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int,
                 dropout: float) -> str:
    """"fused" (flash, memory-efficient, cuDNN, CPU flash: O(S) saved) or "math" (O(S²) saved):
    the kernel `F.scaled_dot_product_attention` picks for a causal self-attention without mask.

    Asked of torch (`torch._fused_sdp_choice` on tiny tensors) when `device_type` is present on
    this machine; otherwise the rule of torch 2.13: CPU runs its flash kernel unless there is
    dropout, CUDA runs a fused kernel."""
    present = device_type == "cpu" or (device_type == "cuda" and torch.cuda.is_available())
    asked = _asked_backend(device_type, dtype, num_heads, num_kv_heads, head_dim, dropout) if present else None
    if asked is not None:
        return asked
    if device_type == "cpu":
        return "math" if dropout > 0 else "fused"
    return "fused"


def layer_activation_bytes(shape: LayerShape, micro_batch: int, seq_len: int, *, tp: int = 1,
                           sequence_parallel: bool = False, checkpointed: bool = False,
                           amp_dtype: torch.dtype | None = None, device: str | torch.device | None = None,
                           low_precision_weights: bool = False) -> int:
    """Bytes one rank's copy of the layer saves for backward for one micro-batch (checkpointed: only
    what the checkpoint keeps, i.e. its input). ``low_precision_weights``: the parameters are
    already in the autocast dtype (FSDP2's bf16 ``param_dtype``, ZeRO 1-3 under bf16 AMP), so no
    matmul keeps a cast copy of its weight.

    Training mode (dropout on when its p > 0), causal self-attention without a padding mask.
    ``device`` (default: CUDA if this machine has it, else CPU) picks the attention kernel and the
    dropout-mask dtype (module docstring); predict a GPU run with ``device="cuda"``."""
    dev = _device_type(device)
    sp = sequence_parallel and tp > 1
    if seq_len % tp and sp:
        raise ValueError(f"sequence parallelism needs seq_len ({seq_len}) divisible by tp ({tp})")
    h, p, a = shape.hidden_size, PARAM_BYTES, _compute_bytes(amp_dtype)
    T = micro_batch * seq_len
    Tr = micro_batch * (seq_len // tp) if sp else T
    if checkpointed:
        return Tr * h * p  # the checkpoint's input: the residual stream entering the layer
    n, k, d, f = shape.num_heads // tp, shape.num_kv_heads // tp, shape.head_dim, shape.ffn_hidden_size // tp
    mlp_inputs = 2 if shape.gated_mlp else 1  # column-parallel linears reading the MLP's input
    blocks = 1 if shape.parallel_block else 2  # (norm, column input, residual dropout) groups

    total = 0
    # Norms (one per block): the norm's input, the residual stream (float32), and its statistics.
    # Post-norm saves the same: the residual sum each norm reads, and the layer input as column input.
    if shape.norm == "layernorm":
        total += blocks * (Tr * h * p + 2 * Tr * STAT_BYTES)  # input; mean and rstd
    else:
        total += blocks * (Tr * h * p + Tr * STAT_BYTES + Tr * h * 4)  # input; rstd; float32 normalized x
    # Column-parallel inputs (whole sequence: gathered under SP): float32, one tensor shared by the
    # linears of a block; under autocast a low-precision copy per linear.
    col_linears = 1 + mlp_inputs  # qkv, up [, gate]
    total += blocks * T * h * p if a == p else col_linears * T * h * a
    # Low-precision weight copies kept by each matmul under autocast (this rank's slices).
    if a != p and not low_precision_weights:
        total += a * h * ((n + 2 * k) * d + n * d + (mlp_inputs + 1) * f)  # qkv, out, gate/up, down
    # Attention.
    backend = sdpa_backend(dev, torch.float32 if amp_dtype is None else amp_dtype, shape.num_heads,
                           shape.num_kv_heads, d, shape.attention_dropout)
    if backend == "fused":
        total += T * (n + 2 * k) * d * a  # q, k, v (views of the qkv output, or rotary's new q, k and v)
        total += T * n * d * a  # attention output, which is also the out projection's input
        total += micro_batch * n * seq_len * STAT_BYTES  # logsumexp (float32)
    else:
        m = 4 if dev == "cpu" else a  # CPU's math path computes bf16/fp16 in float32
        total += 2 * T * n * d * m  # scaled q and k (k expanded to every head)
        if micro_batch == 1 and n == k and m == a and not shape.rotary:
            total += T * (n + 2 * k) * d * a  # v: at B=1 a view of the fused qkv output, which it keeps whole
        else:
            total += T * n * d * m  # v, copied to [B·n, S, d] (expanded to every head)
        scores = micro_batch * n * seq_len * seq_len
        total += scores * m  # softmax probabilities [B, n, S, S]
        if shape.attention_dropout > 0:
            total += scores * (_mask_bytes(dev, m) + m)  # dropout mask; dropped probabilities (P·V's input)
        total += T * n * d * a  # the output transposed to [B, S, n·d]: the out projection's input
    if shape.rotary:  # cos/sin tables [1, S, d]: float32 as computed, or cast per use for q and k
        total += 2 * seq_len * d * 4 if a == 4 else 4 * seq_len * d * a
    # MLP: the activation's input and output (gated: gate output, its activation, up output, product).
    total += (4 if shape.gated_mlp else 2) * T * f * a
    # Residual dropout masks (one per block), on this rank's tokens.
    if shape.hidden_dropout > 0:
        bias_after_reduce = shape.row_bias and (tp > 1 or shape.parallel_block)
        total += blocks * Tr * h * _mask_bytes(dev, p if bias_after_reduce else a)
    return total


def embedding_activation_bytes(hidden_size: int, micro_batch: int, seq_len: int, *, tp: int,
                               sequence_parallel: bool, amp_dtype: torch.dtype | None, dropout: float,
                               position_embedding: bool = False, device: str | torch.device | None = None) -> int:
    """Bytes the first stage (token embedding [+ learned positions], dropout) saves for backward,
    per rank and micro-batch. Its output, the first layer's input, is counted with that layer.

    ``position_embedding``: GPT-2's arrangement, a learned position table (it keeps its [1, S]
    position ids) added before dropout and the sequence split (`SequenceScatter`); without it,
    Llama's: the vocabulary embedding's reduce-scatter splits the sequence.
    Embeddings are not autocast: their output, and the dropout mask on it, are float32. GPT-2
    applies dropout before splitting the sequence (SP), so the mask covers the whole sequence."""
    dev = _device_type(device)
    T = micro_batch * seq_len
    total = T * INDEX_BYTES  # the token ids the lookup's backward scatters by (tp: this rank's local ids)
    if tp > 1:
        total += T * BOOL_BYTES  # ids outside this rank's vocabulary slice (masked_fill_ keeps the mask)
    if position_embedding:
        total += seq_len * INDEX_BYTES  # position ids [1, S]
    if dropout > 0:
        total += T * hidden_size * _mask_bytes(dev, PARAM_BYTES)
    if position_embedding and sequence_parallel and tp > 1 and micro_batch == 1:
        # At B=1 the sequence split is a view (nothing to make contiguous): the first layer's input
        # keeps the whole-sequence embedding alive, not its 1/tp (which the layer counts).
        total += (T - T // tp) * hidden_size * PARAM_BYTES
    return total


def head_activation_bytes(hidden_size: int, vocab_size: int, micro_batch: int, seq_len: int, *, tp: int,
                          sequence_parallel: bool, amp_dtype: torch.dtype | None, norm: str,
                          chunk_bytes: int | None = None, device: str | torch.device | None = None,
                          low_precision_weights: bool = False) -> int:
    """final norm + LM head + vocab-parallel cross entropy, as models/causal_lm.py's head_loss runs
    it (chunked when large); ``low_precision_weights`` as in `layer_activation_bytes`.

    Per rank and micro-batch. ``chunk_bytes`` defaults to `LMHead.chunk_bytes`: above it (this
    rank's float32 logits) the loss runs in checkpointed chunks, which keep only their inputs (the
    normed hidden states and the targets); one chunk's logits and softmax are then recomputed in
    backward, transient memory not counted here."""
    if chunk_bytes is None:
        chunk_bytes = LMHead.chunk_bytes
    sp = sequence_parallel and tp > 1
    h, p, a = hidden_size, PARAM_BYTES, _compute_bytes(amp_dtype)
    T = micro_batch * seq_len
    Tr = micro_batch * (seq_len // tp) if sp else T
    V = vocab_size // tp
    total = Tr * h * p  # the final norm's input (last layer's output)
    if norm == "layernorm":
        total += 2 * Tr * STAT_BYTES  # mean and rstd
    else:
        total += Tr * STAT_BYTES + Tr * h * 4  # rstd; float32 normalized x
    total += T * INDEX_BYTES  # the targets (shifted labels; tp: this rank's local ids), kept by the loss
    chunked = T > max(1, chunk_bytes // (4 * V))
    # the mean's denominator: the count of targets (int64 scalar), or F.cross_entropy's total weight
    total += INDEX_BYTES if chunked or tp > 1 else STAT_BYTES
    if chunked:
        return total + T * h * p  # each chunk's checkpoint keeps its slice of the normed hidden states
    total += T * h * a  # the head's input: the normed hidden states (gathered under SP), or their autocast copy
    if a != p and not low_precision_weights:
        total += V * h * a  # the head weight's autocast copy
    total += T * V * 4  # float32 log-softmax (tp=1) or softmax (vocab-parallel) over this rank's vocabulary
    if tp > 1:
        total += 2 * T * BOOL_BYTES  # target in this rank's slice; target not ignored
    return total
