"""A linear layer's three GEMMs in float8 (torchao's float8 training), with each scale taken over
the whole tensor the one-process layer would scale, though this rank holds only its part of it.

torchao scales a GEMM's operands dynamically from their absolute maximum: per tensor
("tensorwise"), or per row along the dimension the GEMM sums over ("rowwise"). Under tensor
parallelism a rank holds part of an operand: a column layer's weight rows and output gradient
columns, a row layer's input and weight columns, a sequence-parallel token shard. Where the
scaled extent is split, the local maximum is all-reduced (MAX) over the tp group before the
cast (torchao's ``reduce_amax``), so every rank casts with the one-process scale, and fp8 at tp2
computes what fp8 in one process computes, up to the order of the sums.

GEMMs of a [M, K] input and a [N, K] weight (M tokens, K in, N out):

    forward      y  = x · wᵀ       x scaled along K,  w along K
    grad input   dx = dy · w       dy along N,        w along N
    grad weight  dw = dyᵀ · x      dy along M,        x along M

The recipe's cast configs (torchao's `Float8LinearConfig`) say which of the six operands are cast,
to which float8 type, at which granularity; an operand already in float8 (a weight FSDP2 gathered
in float8) is used as it is. A gradient the backward does not need (LoRA's frozen base weight; the
other pass of a zero-bubble schedule's split backward) is not computed.

One exception to the one-process scales: a column layer whose rows several ranks share
(`Linear.replicate_rows_`, KV heads fewer than tp) holds a partial output gradient for them, so its
gradient's scale, the maximum over ranks, bounds the one-process one without equalling it.
"""

from __future__ import annotations

import torch
from torch.autograd import Function

from .gathered_linear import wanted_gradients
from .tensor_parallel import TensorParallel

#: The GEMM dimensions of each operand's 2-D form.
_DIMS = {"x": ("M", "K"), "w_t": ("K", "N"), "dy": ("M", "N")}


def float8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config,
                  tp: TensorParallel | None = None, split: frozenset[str] = frozenset()) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with its GEMMs in float8 by torchao's `config` (a
    `Float8LinearConfig`); `split`: the GEMM dimensions ("M", "K", "N") this rank holds a part of
    over `tp`, whose scales are reduced over its group. Under autocast the input and the output
    are in the autocast dtype, as ``F.linear``'s."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        x = x.to(torch.get_autocast_dtype(device))
    with torch.autocast(device, enabled=False):
        # 2-D in and out: an output that is a view made inside the Function could not be reduced in place
        y = _Float8Matmul.apply(x.reshape(-1, x.shape[-1]), weight.t(), config, tp, split)
        y = y.view(*x.shape[:-1], y.shape[-1])
        return y if bias is None else y + bias.to(y.dtype)


def mm_config(config):
    """torchao's per-GEMM settings (emulation, fast accumulation, padding) of `config`."""
    from torchao.float8.float8_training_tensor import LinearMMConfig, ScaledMMConfig
    gemms = (config.gemm_config_output, config.gemm_config_grad_input, config.gemm_config_grad_weight)
    return LinearMMConfig(*(ScaledMMConfig(config.emulate, g.use_fast_accum, False, config.pad_inner_dim)
                            for g in gemms))


def _cast(t: torch.Tensor, operand: str, axis: int, cast_config, role, config, mm, tp, split):
    """`t` (the 2-D `operand`) in float8 by `cast_config`, scaled along `axis` (0 or -1) when rowwise (over
    all of it when tensorwise), its maximum reduced over tp where that extent is split; as it is
    when already float8 or when the recipe leaves it in high precision (`mm`: `mm_config(config)`)."""
    from torchao.float8.config import ScalingGranularity, ScalingType
    from torchao.float8.distributed_utils import tensor_already_casted_to_fp8
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    if tensor_already_casted_to_fp8(t) or cast_config.scaling_type is ScalingType.DISABLED:
        return t
    rowwise = cast_config.scaling_granularity is ScalingGranularity.AXISWISE
    scaled = {_DIMS[operand][axis]} if rowwise else set(_DIMS[operand])
    reduce = tp is not None and bool(scaled & split)
    return hp_tensor_to_float8_dynamic(
        t, cast_config.target_dtype, mm, reduce_amax=reduce, gemm_input_role=role,
        device_mesh=tp.mesh if reduce else None, scaling_granularity=cast_config.scaling_granularity,
        axiswise_dim=axis if rowwise else None, round_scales_to_power_of_2=config.round_scales_to_power_of_2)


class _Float8Matmul(Function):
    """x [M, K] · w_t [K, N] in float8 (module docstring); saves the operands as given."""

    @staticmethod
    def forward(ctx, x, w_t, config, tp, split):
        from torchao.float8.float8_training_tensor import GemmInputRole
        ctx.save_for_backward(x, w_t)
        ctx.config, ctx.tp, ctx.split = config, tp, split
        ctx.mm = mm = mm_config(config)
        xq = _cast(x, "x", -1, config.cast_config_input, GemmInputRole.INPUT, config, mm, tp, split)
        wq = _cast(w_t, "w_t", 0, config.cast_config_weight, GemmInputRole.WEIGHT, config, mm, tp, split)
        return torch.mm(xq, wq)

    @staticmethod
    def backward(ctx, dy):
        from torchao.float8.float8_training_tensor import GemmInputRole
        x, w_t = ctx.saved_tensors
        c, mm, tp, split = ctx.config, ctx.mm, ctx.tp, ctx.split
        dx = dw_t = None
        input_grad, weight_grad = wanted_gradients(ctx, ctx.needs_input_grad[:2], (True, True))
        if input_grad:
            dyq = _cast(dy, "dy", -1, c.cast_config_grad_output, GemmInputRole.GRAD_OUTPUT, c, mm, tp, split)
            wq = _cast(w_t, "w_t", -1, c.cast_config_weight_for_grad_input, GemmInputRole.WEIGHT, c, mm, tp, split)
            dx = torch.mm(dyq, wq.t())
        if weight_grad:
            dyq = _cast(dy, "dy", 0, c.cast_config_grad_output_for_grad_weight, GemmInputRole.GRAD_OUTPUT, c, mm, tp,
                        split)
            xq = _cast(x, "x", 0, c.cast_config_input_for_grad_weight, GemmInputRole.INPUT, c, mm, tp, split)
            dw_t = torch.mm(dyq.t(), xq).t()
        return dx, dw_t, None, None, None
