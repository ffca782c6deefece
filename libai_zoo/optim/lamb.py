"""LAMB (You et al., 2020): Adam whose update is rescaled per parameter by a trust ratio.

    m, v   = Adam moments of the gradient (bias-corrected)
    u      = m / (sqrt(v) + eps) + weight_decay * w
    w     -= lr * (||w|| / ||u||) * u        (trust ratio 1 where either norm is 0)

The trust ratio keeps each layer's step proportional to its weight norm, which is what lets
BERT train with batches of tens of thousands of samples.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer


class Lamb(Optimizer):
    """LAMB with decoupled weight decay inside the trust ratio, as in the paper's Algorithm 2."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.01):
        if lr <= 0 or eps <= 0 or not all(0 <= b < 1 for b in betas):
            raise ValueError(f"invalid LAMB hyper-parameters: lr={lr}, betas={betas}, eps={eps}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(param)
                    state["exp_avg_sq"] = torch.zeros_like(param)
                state["step"] += 1
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.lerp_(param.grad, 1 - beta1)
                v.mul_(beta2).addcmul_(param.grad, param.grad, value=1 - beta2)
                m_hat = m / (1 - beta1 ** state["step"])
                v_hat = v / (1 - beta2 ** state["step"])
                update = m_hat / (v_hat.sqrt() + group["eps"])
                if group["weight_decay"]:
                    update.add_(param, alpha=group["weight_decay"])
                weight_norm, update_norm = _norm(param), _norm(update)
                trust = torch.where((weight_norm > 0) & (update_norm > 0), weight_norm / update_norm,
                                    torch.ones_like(weight_norm))
                param.sub_(update * (group["lr"] * trust))
        return loss


def _norm(tensor: torch.Tensor) -> torch.Tensor:
    """The norm of the whole tensor, also when it is a shard (a DTensor reduces over its mesh)."""
    norm = tensor.norm()
    return norm.full_tensor() if isinstance(norm, DTensor) else norm
