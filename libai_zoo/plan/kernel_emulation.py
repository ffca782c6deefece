"""The planned run's device, kernels and expert group emulated on fake CPU tensors: what makes a
model measured here (`activations.SavedActivations`) run as it would on the device and the
layout it is planned for. Nothing here measures; everything here is chosen through a seam the
layers own, never by replacing a function of torch or of a layer module.

- **Kernels** (`TargetKernels`, for a CUDA run): fake CPU tensors run what CPU runs (its SDPA
  kernel choice, its dropout). For CUDA the kernels whose saved tensors differ are swapped (a
  `TorchFunctionMode`): dropout runs as `native_dropout` (a bool mask, as CUDA's fused dropout)
  and SDPA runs the kernel `sdpa_backend` names for CUDA, a fused one measured as CPU's flash
  kernel (q, k, v, output and a float32 logsumexp: what flash, memory-efficient and cuDNN
  attention keep; their RNG state is a few bytes), or with values narrower than the keys (latent
  attention, which flash cannot run) as the memory-efficient kernel CUDA then runs, the math path
  as torch's math decomposition (as on CPU: in float32, a float dropout mask). Autocast is CPU's:
  its lower-precision list holds the matmuls and SDPA, as CUDA's does; the float32 lists differ
  in ops these layers already run in float32.
- **Masks under context parallelism**: attention's lower-right causal biases (torch's
  `causal_lower_right`, a tensor subclass holding no data, which the fake mode cannot make) are
  made outside the fake mode, through the layer module's mask factory
  (`context_attention.causal_biases_made_by`).
- **Routing** (a Mixture-of-Experts layer), which fake tensors do not have, is a stated assumption
  (`Shapes.routing_imbalance`): the counts per expert an MoE layer makes (`moe.routing_counted_by`,
  the layer's one place of counting) are balanced (the T·k slots of T tokens spread evenly over
  the experts, `balanced_counts`), and the integer bookkeeping on them runs on real tensors
  (`RealBookkeeping`, around each `MoE` layer's forward); in the expert group's exchange
  (`expert_parallel.counts_exchanged_by`) every rank is taken to route alike, so the counts a rank
  receives are those it sends, times the imbalance factor (the most loaded rank receives that
  many times its fair share of T·k rows; 1.0: balanced). The layer's own code then runs as
  usual: router, sorting, the all-to-all of the rows (the fake group's), the experts on as many
  rows as they receive (expert by expert unless in bf16: on fake tensors the layer runs the
  grouped GEMM only where its meta kernel does, as CUDA). Capacity dropping (a data-dependent
  selection) is not emulated.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.nn.attention.bias import CausalBias, causal_lower_right
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from libai_zoo.distributed import ExpertParallel, expert_parallel
from libai_zoo.layers import MoE, context_attention, moe


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
    dropout, CUDA runs a fused kernel (fp32 with grouped-query attention, which falls back to
    math on CUDA, is not told apart without a GPU)."""
    present = device_type == "cpu" or (device_type == "cuda" and torch.cuda.is_available())
    asked = _asked_backend(device_type, dtype, num_heads, num_kv_heads, head_dim, dropout) if present else None
    if asked is not None:
        return asked
    if device_type == "cpu":
        return "math" if dropout > 0 else "fused"
    return "fused"


class TargetKernels(TorchFunctionMode):
    """On fake CPU tensors, run dropout and SDPA as CUDA would (see the module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.dropout:
            return self._dropout(*args, **kwargs)
        if func is F.scaled_dot_product_attention:
            return self._attention(*args, **kwargs)
        return func(*args, **kwargs)

    @staticmethod
    def _dropout(x, p=0.5, training=True, inplace=False):
        if not training or p == 0.0:
            return x
        return torch.native_dropout(x, p, True)[0]

    @staticmethod
    def _attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if isinstance(attn_mask, CausalBias):  # lower-right causal (cp's chunks): a flag to CUDA's fused kernels
            attn_mask, is_causal = None, True
        if torch.is_autocast_enabled("cpu"):  # what autocast would do to SDPA's inputs
            dtype = torch.get_autocast_dtype("cpu")
            q, k, v = (t.to(dtype) for t in (q, k, v))
            if attn_mask is not None and attn_mask.is_floating_point():
                attn_mask = attn_mask.to(dtype)
        if attn_mask is not None and attn_mask.dtype == torch.bool:  # CUDA's SDPA turns it into an additive mask
            attn_mask = torch.zeros(attn_mask.shape, dtype=q.dtype).masked_fill_(~attn_mask, float("-inf"))
        backend = sdpa_backend("cuda", q.dtype, q.shape[1], k.shape[1], q.shape[-1], float(dropout_p))
        # values narrower than the keys (latent attention), or a bias that is learned (T5's position
        # bias): flash cannot run them, CUDA runs its memory-efficient kernel
        if backend == "fused" and (v.shape[-1] != q.shape[-1] or (attn_mask is not None and attn_mask.requires_grad)):
            return torch.ops.aten._scaled_dot_product_efficient_attention(
                q, k, v, attn_mask, True, dropout_p, is_causal, scale=scale)[0]
        if backend == "fused":
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q, k, v, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]
        return torch.ops.aten._scaled_dot_product_attention_math(
            q, k, v, attn_mask, dropout_p, is_causal, None, scale=scale, enable_gqa=enable_gqa)[0]


def balanced_counts(slots: torch.Tensor, num_experts: int) -> torch.Tensor:
    """The counts per expert of `slots` spread evenly over `num_experts` experts (the first ones one
    more), a real int64 tensor whatever `slots` is (`moe.routing_counted_by`'s counter). The layer's
    own counting runs too, on the fake slots, for the work the device does; its values are dropped."""
    moe.count_slots(slots, num_experts)
    total = slots.numel()
    with unset_fake_temporarily():
        return total // num_experts + (torch.arange(num_experts) < total % num_experts).long()


def symmetric_exchange(imbalance: float) -> Callable[[torch.Tensor, torch.Tensor, ExpertParallel], None]:
    """The expert group's exchange of (real) counts when every rank routes alike: each rank receives
    what it sends, times `imbalance` (`expert_parallel.counts_exchanged_by`'s exchange)."""
    def exchange(received: torch.Tensor, counts: torch.Tensor, ep: ExpertParallel) -> None:
        with unset_fake_temporarily():
            received.copy_(torch.ceil(counts.double() * imbalance).to(received.dtype))
    return exchange


def real_causal_bias(queries: int, keys: int) -> torch.Tensor:
    """torch's lower-right causal bias, made outside the fake mode, which cannot make it
    (`context_attention.causal_biases_made_by`'s factory)."""
    with unset_fake_temporarily():
        return causal_lower_right(queries, keys)


class RealBookkeeping(TorchFunctionMode):
    """Inside an MoE layer on fake tensors: every call whose tensors are all plain real tensors
    (the balanced counts and what is computed from them), and `torch.arange`, runs outside the fake
    mode, so the layer's own code can size its buffers from the counts."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        if all(type(x) is torch.Tensor for x in tensors) and (tensors or func is torch.arange):
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        return func(*args, **kwargs)


@contextmanager
def _real_bookkeeping_in(layers: list[nn.Module]) -> Iterator[None]:
    """Each of `layers` runs its forward under `RealBookkeeping` (forward hooks: entered before
    the forward, left after it, whether it returns or raises)."""
    entered: list[RealBookkeeping] = []

    def enter(module, args):
        entered.append(RealBookkeeping())
        entered[-1].__enter__()

    def leave(module, args, output):
        entered.pop().__exit__(None, None, None)

    handles = []
    try:
        for layer in layers:
            handles.append(layer.register_forward_pre_hook(enter))
            handles.append(layer.register_forward_hook(leave, always_call=True))
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def emulated(model: nn.Module, *, device: str, routing_imbalance: float) -> Iterator[None]:
    """Meanwhile `model` (on fake CPU tensors) runs as it would on `device` ("cuda" or "cpu"): its
    kernels (`TargetKernels` for CUDA), its cp masks, and its MoE layers' routing under the stated
    assumption, their expert group's exchange included (the module docstring)."""
    with ExitStack() as stack:
        if device == "cuda":
            stack.enter_context(TargetKernels())
        stack.enter_context(context_attention.causal_biases_made_by(real_causal_bias))
        stack.enter_context(moe.routing_counted_by(balanced_counts))
        stack.enter_context(expert_parallel.counts_exchanged_by(symmetric_exchange(routing_imbalance)))
        stack.enter_context(_real_bookkeeping_in([m for m in model.modules() if isinstance(m, MoE)]))
        yield
