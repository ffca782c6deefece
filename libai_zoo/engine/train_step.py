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
from contextlib import nullcontext

import torch
from torch import nn

from libai_zoo import dist
from libai_zoo.optim import clip_grad_norm_
from libai_zoo.parallel import DataParallel, Pipeline

logger = logging.getLogger("libai_zoo")

AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class TrainStep:
    """Callable on a list of micro-batches (dicts of tensors with labels); returns the step's metrics.

    ``amp_dtype`` None trains in the parameters' dtype; bf16 autocasts; fp16 autocasts with a
    dynamic loss scaler that skips a step whose gradients overflowed and lowers the scale. A step
    whose gradient norm is not finite is skipped in every mode. ``data_parallel`` reduces
    gradients over dp (and counts targets over it); ``pipeline`` runs the micro-batches through
    the pipeline schedule instead of one forward/backward each.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, device: torch.device,
                 amp_dtype: torch.dtype | None = None, clip_grad_norm: float = 0.0,
                 data_parallel: DataParallel | None = None, pipeline: Pipeline | None = None):
        self.model, self.optimizer, self.device = model, optimizer, device
        self.amp_dtype, self.clip_grad_norm = amp_dtype, clip_grad_norm
        self.data_parallel, self.pipeline = data_parallel, pipeline
        self.dp = data_parallel.ctx.dp if data_parallel is not None else 1
        if pipeline is not None and amp_dtype == torch.float16:
            raise ValueError("fp16 loss scaling is not available under pipeline parallelism: use train.amp.dtype=bf16")
        self.scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)
        accepts = inspect.signature(model.forward).parameters
        self._forward_kwargs = {"return_logits": False} if "return_logits" in accepts else {}

    def _counts(self, batches: list[dict]) -> tuple[list[float], float]:
        """Targets per micro-batch and their total over the global batch."""
        counts = [float(count_targets(self.model, b)) for b in batches]
        total = torch.tensor(sum(counts), dtype=torch.float64, device=self.device)
        if self.data_parallel is not None:
            self.data_parallel.all_reduce_sum(total)
        if total.item() == 0:
            raise ValueError("no labelled targets in this step's batches (every label is -100)")
        return counts, total.item()

    def _autocast(self):
        return torch.autocast(self.device.type, dtype=self.amp_dtype, enabled=self.amp_dtype is not None)

    def __call__(self, micro_batches: list[dict]) -> dict:
        batches = [{k: v.to(self.device, non_blocking=True) for k, v in b.items()} for b in micro_batches]
        counts, total = self._counts(batches)
        loss = torch.zeros((), device=self.device)
        if self.pipeline is not None:
            local = {k: torch.cat([b[k] for b in batches]) for k in batches[0]}
            shifted = "shift_labels" in local
            with self._autocast():
                summed = self.pipeline.step(local["input_ids"], local["shift_labels" if shifted else "labels"],
                                            loss_scale=self.dp / total, shifted=shifted)
            loss += self.pipeline.broadcast_loss(summed) / self.dp
            self.pipeline.sync_tied_grads()
        else:
            for i, (batch, count) in enumerate(zip(batches, counts)):
                context = self.data_parallel.micro_batch(last=i == len(batches) - 1) \
                    if self.data_parallel is not None else nullcontext()
                with context:
                    with self._autocast():
                        micro_loss = self.model(**batch, **self._forward_kwargs).loss
                    # Each rank's share of the global mean; the dp reduction averages, hence × dp.
                    self.scaler.scale(micro_loss * (count * self.dp / total)).backward()
                loss += micro_loss.detach().float() * (count / total)
        if self.data_parallel is not None:
            self.data_parallel.reduce_gradients(self.model)
            self.data_parallel.all_reduce_sum(loss)
        dist.finalize_grads(self.model)
        self.scaler.unscale_(self.optimizer)
        pp_group = [self.pipeline.pp_group] if self.pipeline is not None else []
        excluded = self.pipeline.tied_duplicates() if self.pipeline is not None else []
        grad_norm = clip_grad_norm_(self.model.parameters(), self.clip_grad_norm, sum_over=pp_group, exclude=excluded)
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
                   "samples": sum(_batch_size(b) for b in batches) * self.dp}
        if all("input_ids" in b for b in batches):
            metrics["tokens"] = sum(b["input_ids"].numel() for b in batches) * self.dp
        if self.scaler.is_enabled():
            metrics["loss_scale"] = self.scaler.get_scale()
        return metrics


def _batch_size(batch: dict) -> int:
    return next(iter(batch.values())).shape[0]


def count_targets(model: nn.Module, batch: dict) -> int:
    """The terms the batch's mean loss averages over: the model's count of labelled tokens
    (`num_loss_targets`), or the samples for models and batches without one."""
    counter = getattr(model, "num_loss_targets", None)
    if counter is None or ("labels" not in batch and "shift_labels" not in batch):
        return _batch_size(batch)
    return int(counter(batch))
