"""Column-parallel linears on a sequence-parallel input that keep only this rank's shard of it for
backward (Megatron-LM's LinearWithGradAccumulationAndAsyncCommunication).

    forward   x shards -> all-gather -> X -> X W_i^T + b_i for every projection i   (X freed after)
    backward  start all-gather of x (async) | dX = sum_i dY_i W_i             (overlapped)
              wait; start reduce-scatter of dX (async) | dW_i = dY_i^T X, db_i (overlapped); wait

`gather_from_sp` followed by `F.linear` would save the gathered X [B, S, h] for the weight gradient:
tp times the shard, so sequence parallelism's saving stopped growing with tp. Here X lives only
while the forward GEMMs run, and backward gathers it again. Several projections of one input (a
gated MLP's gate and up, the parallel block's attention and MLP, LoRA's A) and several inputs
synced together (Pythia's two norms, latent attention's latents) share one all-gather each way
and one reduce-scatter. A projection without a weight passes its gathered input through (latent
attention's rotary key).

Under autocast the GEMMs run in the autocast dtype as `F.linear` would: inputs, weights and biases
are cast to it, the shards saved in it (a bf16 run saves and gathers bf16), and gradients are
cast back to each tensor's own dtype (the input's gradient summed and reduce-scattered in it).
A gradient the current backward does not ask for is not computed: pipelining's zero-bubble
schedules run the input gradients and the weight gradients in two passes through this node,
the first needing no all-gather, the second no reduce-scatter.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd import Function

from .collectives import all_gather_async, reduce_scatter_async
from .tensor_parallel import TensorParallel

#: (index of the input it reads, weight or None to pass the gathered input through, bias or None)
Projection = tuple[int, torch.Tensor | None, torch.Tensor | None]


def gathered_linears(inputs: list[torch.Tensor], tp: TensorParallel, projections: list[Projection],
                     dim: int = 1) -> list[torch.Tensor]:
    """``F.linear(gather_from_sp(inputs[i]), weight, bias)`` for each projection, keeping only the
    local shards of the inputs for backward (module docstring). Inputs are split along `dim`."""
    device = inputs[0].device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
    index = tuple(i for i, _, _ in projections)
    params = [t for _, weight, bias in projections for t in (weight, bias)]
    with torch.autocast(device, enabled=False):
        return list(_GatheredLinears.apply(tp, dim, dtype, index, len(inputs), *inputs, *params))


def _cast(t: torch.Tensor | None, dtype: torch.dtype | None) -> torch.Tensor | None:
    """`t` in the autocast dtype, where autocast would cast it (floating point, not float64)."""
    if t is None or dtype is None or not t.is_floating_point() or t.dtype in (dtype, torch.float64):
        return t
    return t.to(dtype)


def wanted_gradients(ctx, needs_input_grad, present) -> list[bool]:
    """Per tensor argument of a custom autograd Function (`present`: False for an absent one, None):
    whether this backward pass computes its gradient, required at forward (`needs_input_grad`) and
    on the path of the current `backward`/`autograd.grad` (a split backward asks for the inputs'
    gradients and the weights' in two passes)."""
    nodes = iter(ctx.next_functions)  # one per tensor argument, the absent ones left out
    wanted = []
    for needs, given in zip(needs_input_grad, present):
        node = next(nodes)[0] if given else None
        if needs and node is not None:
            try:
                needs = torch._C._will_engine_execute_node(node)
            except RuntimeError:  # a leaf under autograd.grad: not answered, so computed
                pass
        wanted.append(bool(needs))
    return wanted


def _gather(shards: list[torch.Tensor | None], tp: TensorParallel, dim: int):
    """Start all-gathering the shards given (side by side, one collective per dtype); returns the
    function that waits for them and returns each gathered (None where no shard was given)."""
    groups: dict[torch.dtype, list[int]] = {}
    for i, shard in enumerate(shards):
        if shard is not None:
            groups.setdefault(shard.dtype, []).append(i)
    pending = [(ids, all_gather_async(torch.cat([shards[i] for i in ids], dim=-1) if len(ids) > 1 else shards[ids[0]],
                                      tp, dim))
               for ids in groups.values()]

    def wait() -> list[torch.Tensor | None]:
        whole = [None] * len(shards)
        for ids, gathering in pending:
            for i, part in zip(ids, gathering.wait().split([shards[i].shape[-1] for i in ids], dim=-1)):
                whole[i] = part
        return whole
    return wait


def _split(whole: torch.Tensor, widths: list[int]) -> list[torch.Tensor]:
    """The inputs' parts of a tensor they were joined in along the last dim."""
    return list(whole.split(widths, dim=-1)) if len(widths) > 1 else [whole]


class _GatheredLinears(Function):
    @staticmethod
    def forward(ctx, tp, dim, dtype, index, n_inputs, *tensors):
        inputs, weights, biases = tensors[:n_inputs], tensors[n_inputs::2], tensors[n_inputs + 1::2]
        # an input only passed through keeps its dtype, as gather_from_sp would give it
        projected = [any(j == i and w is not None for j, w in zip(index, weights)) for i in range(n_inputs)]
        shards = [_cast(x, dtype) if read else x for x, read in zip(inputs, projected)]
        weights_c = [_cast(w, dtype) for w in weights]
        widths = [x.shape[-1] for x in inputs]
        # autocast's cast of a part of the joined inputs is contiguous: the same GEMM (and rounding) as F.linear's
        whole = [w.contiguous() if x is not s else w for w, x, s in zip(_gather(shards, tp, dim)(), inputs, shards)]
        outputs = []
        for i, w, b in zip(index, weights_c, biases):
            outputs.append(whole[i].contiguous() if w is None else F.linear(whole[i], w, _cast(b, dtype)))
        del whole  # the gathered input lives no longer than the GEMMs
        needs = ctx.needs_input_grad[5:]
        weights_grad = any(needs[n_inputs + 2 * k] for k, w in enumerate(weights) if w is not None)
        inputs_grad = any(needs[:n_inputs])
        ctx.save_for_backward(*(x if weights_grad and read else None for x, read in zip(shards, projected)),
                              *(w if inputs_grad else None for w in weights_c))
        ctx.tp, ctx.dim, ctx.index, ctx.n_inputs = tp, dim, index, n_inputs
        ctx.dtypes = [t.dtype if t is not None else None for t in tensors]
        ctx.present = [t is not None for t in tensors]
        ctx.widths = widths
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grads):
        n, tp, dim, index = ctx.n_inputs, ctx.tp, ctx.dim, ctx.index
        saved = ctx.saved_tensors
        shards, weights = saved[:n], saved[n:]
        wanted = wanted_gradients(ctx, ctx.needs_input_grad[5:], ctx.present)
        want_x, want_w, want_b = wanted[:n], wanted[n::2], wanted[n + 1::2]
        dtypes = ctx.dtypes
        gathering = _gather(list(shards), tp, dim) if any(want_w) else None  # the shards projections read
        # input gradients first (they need no gathered input), the last projection's first, as
        # autograd would sum the gradients of separate linears
        grad_whole = [None] * n
        for k in reversed(range(len(index))):
            i = index[k]
            if not want_x[i]:
                continue
            g = grads[k] if weights[k] is None else (grads[k] @ weights[k])
            g = g.to(dtypes[i])
            grad_whole[i] = g if grad_whole[i] is None else grad_whole[i] + g
        scattering = None
        if any(want_x):
            shape = next(g for g in grad_whole if g is not None).shape[:-1]
            parts = [g if g is not None else grads[0].new_zeros(*shape, width, dtype=dtypes[i])
                     for i, (g, width) in enumerate(zip(grad_whole, ctx.widths))]
            scattering = reduce_scatter_async(parts[0] if n == 1 else torch.cat(parts, dim=-1), tp, dim)
        grad_params = [None] * (2 * len(index))
        if gathering is not None:
            whole = gathering()
            for k, i in enumerate(index):
                if want_w[k]:
                    g, x = grads[k].flatten(0, -2), whole[i].flatten(0, -2)
                    grad_params[2 * k] = torch.mm(x.t(), g).t().to(dtypes[n + 2 * k])
        for k in range(len(index)):
            if want_b[k]:
                grad_params[2 * k + 1] = grads[k].flatten(0, -2).sum(0).to(dtypes[n + 2 * k + 1])
        grad_inputs = [None] * n
        if scattering is not None:
            grad_inputs = [g if want else None for g, want in zip(_split(scattering.wait(), ctx.widths), want_x)]
        return (None,) * 5 + tuple(grad_inputs) + tuple(grad_params)
