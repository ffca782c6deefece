"""What evaluation reports: the mean loss over the test set, perplexity for language models and
accuracy for classifiers."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from transformers.modeling_outputs import ModelOutput

from libai_zoo.distributed import ContextParallel
from libai_zoo.parallel import Pipeline, context_parallel_part


@dataclass(frozen=True)
class Evaluation:
    """An evaluation after `iteration` steps: its results and the seconds it took."""

    iteration: int
    results: dict[str, float]
    seconds: float


class Evaluator:
    """Accumulates over batches (`process`), then `evaluate()` -> {"loss", ["perplexity"], ["accuracy"]}.

    The loss is averaged over targets as the training step does (the model's `num_loss_targets`);
    perplexity is reported when the loss is per token, accuracy counts argmax hits when there is
    one class label per sample."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self._loss_sum, self._targets, self._correct, self._samples = 0.0, 0, 0, 0
        self._language_model = False

    def process(self, model: nn.Module, batch: dict, outputs) -> None:
        """Add one batch: `model` (it implements the model contract) scored `outputs` on `batch`."""
        _, targets = model.split_batch(batch)
        count = int(model.num_loss_targets(targets))
        self._language_model = model.loss_unit == "token"
        loss = outputs.loss.float()
        stats = getattr(outputs, "router_stats", None)
        if stats is not None and model.has_aux_loss:  # the loss over the targets, as training logs it
            loss = loss - model.aux_loss(stats).float()
        self._loss_sum += loss.item() * count
        self._targets += count
        logits = getattr(outputs, "logits", None)
        if logits is not None and targets.dim() == 1 and logits.dim() == 2 and not targets.is_floating_point():
            self._correct += (logits.argmax(-1) == targets.to(logits.device)).sum().item()
            self._samples += targets.shape[0]

    def evaluate(self) -> dict[str, float]:
        if not self._targets:
            raise ValueError("the evaluator saw no batches: is the test dataset empty?")
        results = {"loss": self._loss_sum / self._targets}
        if self._language_model:
            results["perplexity"] = math.exp(min(results["loss"], 50.0))
        if self._samples:
            results["accuracy"] = self._correct / self._samples
        return results


@torch.no_grad()
def run_evaluation(model_parts: Sequence[nn.Module], loader, evaluator: Evaluator,
                   forward: Callable[..., object], *, device: torch.device, amp_dtype: torch.dtype | None,
                   max_batches: int | None = None) -> dict[str, float]:
    """Evaluate with ``forward(**batch)`` (outputs with ``.loss``, and ``.logits`` for accuracy) on
    `loader`, the model parts in eval mode (then back to train mode)."""
    was_training = [part.training for part in model_parts]
    for part in model_parts:
        part.eval()
    evaluator.reset()
    try:
        for i, batch in enumerate(loader):
            if max_batches is not None and i >= max_batches:
                break
            batch = {k: v.to(device) for k, v in batch.items()}
            with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                outputs = forward(**batch)
            evaluator.process(model_parts[0], batch, outputs)
    finally:
        for part, training in zip(model_parts, was_training):
            part.train(training)
    return evaluator.evaluate()


def pipelined_forward(pipeline: Pipeline, model: nn.Module) -> Callable[..., ModelOutput]:
    """``forward`` for `run_evaluation` through the pipeline's forward-only schedule: the batch's
    mean loss (no logits leave the last stage). `model` is one of this rank's model parts."""
    def forward(**batch: torch.Tensor) -> ModelOutput:
        inputs, targets = model.split_batch(batch)
        total = pipeline.eval_step(inputs, targets)
        return ModelOutput(loss=torch.tensor(total / float(model.num_loss_targets(targets))))
    return forward


def context_parallel_forward(forward: Callable[..., ModelOutput], model: nn.Module,
                             cp: ContextParallel) -> Callable[..., ModelOutput]:
    """``forward`` for `run_evaluation` under context parallelism: `forward` (the model, or
    `pipelined_forward`) runs this cp rank's part of the batch (`context_parallel_part`), and the
    loss is the mean over the whole sequences' targets (loss × targets summed over the cp group;
    a Mixture of Experts' auxiliary terms, the same on every cp rank, taken out first)."""
    def run(**batch: torch.Tensor) -> ModelOutput:
        part = context_parallel_part(batch, model, cp)
        count = model.num_loss_targets(model.split_batch(part)[1]).double()
        outputs = forward(**part)
        stats = getattr(outputs, "router_stats", None)
        loss = (outputs.loss - model.aux_loss(stats) if stats is not None and model.has_aux_loss
                else outputs.loss).double()
        totals = torch.stack([loss * count if count else torch.zeros_like(loss), count])  # no targets: mean NaN
        dist.all_reduce(totals, group=cp.group)
        return ModelOutput(loss=totals[0] / totals[1])
    return run
