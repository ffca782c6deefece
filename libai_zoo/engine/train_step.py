"""One optimizer step: micro-batches with gradient accumulation, mixed precision, clipping.

    for each micro-batch:  autocast forward -> loss × (its targets / all targets) -> backward
    finalize partial grads -> unscale (fp16) -> clip the global norm -> optimizer step -> zero grads

Weighting each micro-batch's mean loss by its share of the step's targets (labelled tokens for
language models, samples for classifiers) makes the step's loss the mean over every target of
the global batch, whatever the split into micro-batches and however the padding falls.
"""

from __future__ import annotations

import inspect
import logging

import torch
from torch import nn

from libai_zoo import dist
from libai_zoo.optim import clip_grad_norm_

logger = logging.getLogger("libai_zoo")

AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class TrainStep:
    """Callable on a list of micro-batches (dicts of tensors with labels); returns the step's metrics.

    ``amp_dtype`` None trains in the parameters' dtype; bf16 autocasts; fp16 autocasts with a
    dynamic loss scaler that skips a step whose gradients overflowed and lowers the scale. A step
    whose gradient norm is not finite is skipped in every mode.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, device: torch.device,
                 amp_dtype: torch.dtype | None = None, clip_grad_norm: float = 0.0):
        self.model, self.optimizer, self.device = model, optimizer, device
        self.amp_dtype, self.clip_grad_norm = amp_dtype, clip_grad_norm
        self.scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)
        accepts = inspect.signature(model.forward).parameters
        self._forward_kwargs = {"return_logits": False} if "return_logits" in accepts else {}

    def _weights(self, batches: list[dict]) -> list[float]:
        counter = getattr(self.model, "num_loss_targets", None)
        if counter is None or any("labels" not in b for b in batches):
            return [1.0 / len(batches)] * len(batches)
        counts = [int(counter(b["labels"])) for b in batches]
        total = sum(counts)
        if total == 0:
            raise ValueError("no labelled targets in this step's batches (every label is -100)")
        return [c / total for c in counts]

    def __call__(self, micro_batches: list[dict]) -> dict:
        batches = [{k: v.to(self.device, non_blocking=True) for k, v in b.items()} for b in micro_batches]
        loss = torch.zeros((), device=self.device)
        for batch, weight in zip(batches, self._weights(batches)):
            with torch.autocast(self.device.type, dtype=self.amp_dtype, enabled=self.amp_dtype is not None):
                micro_loss = self.model(**batch, **self._forward_kwargs).loss
            self.scaler.scale(micro_loss * weight).backward()
            loss += micro_loss.detach().float() * weight
        dist.finalize_grads(self.model)
        self.scaler.unscale_(self.optimizer)
        grad_norm = clip_grad_norm_(self.model.parameters(), self.clip_grad_norm)
        skipped = False
        if self.scaler.is_enabled():
            scale = self.scaler.get_scale()
            self.scaler.step(self.optimizer)  # skipped inside when a gradient overflowed
            self.scaler.update()
            skipped = self.scaler.get_scale() < scale
        elif torch.isfinite(grad_norm):
            self.optimizer.step()
        else:
            skipped = True
        if skipped:
            logger.warning("skipped the optimizer step: the gradient norm is %s", grad_norm.item())
        self.optimizer.zero_grad(set_to_none=True)
        metrics = {"loss": loss.item(), "grad_norm": grad_norm.item(), "skipped": float(skipped),
                   "samples": sum(_batch_size(b) for b in batches)}
        if all("input_ids" in b for b in batches):
            metrics["tokens"] = sum(b["input_ids"].numel() for b in batches)
        if self.scaler.is_enabled():
            metrics["loss_scale"] = self.scaler.get_scale()
        return metrics


def _batch_size(batch: dict) -> int:
    return next(iter(batch.values())).shape[0]
