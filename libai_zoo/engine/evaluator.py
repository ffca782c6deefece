"""What evaluation reports: the mean loss over the test set, perplexity for language models and
accuracy for classifiers."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from transformers.modeling_outputs import ModelOutput

from .train_step import count_targets


class Evaluator:
    """Accumulates over batches (`process`), then `evaluate()` -> {"loss", ["perplexity"], ["accuracy"]}.

    The loss is averaged over targets as the training step does (`num_loss_targets` of the model);
    accuracy counts argmax hits when there is one class label per sample."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self._loss_sum, self._targets, self._correct, self._samples = 0.0, 0, 0, 0
        self._language_model = False

    def process(self, model, batch: dict, outputs) -> None:
        labels = batch.get("labels", batch.get("shift_labels"))
        count = count_targets(model, batch)
        self._language_model = getattr(model, "loss_targets", "samples") != "samples"
        self._loss_sum += outputs.loss.float().item() * count
        self._targets += count
        logits = getattr(outputs, "logits", None)
        if logits is not None and labels.dim() == 1 and logits.dim() == 2 and not labels.is_floating_point():
            self._correct += (logits.argmax(-1) == labels.to(logits.device)).sum().item()
            self._samples += labels.shape[0]

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
def run_evaluation(model, loader, evaluator: Evaluator, *, device: torch.device, amp_dtype: torch.dtype | None,
                   max_batches: int | None = None, forward: Callable[[dict], object] | None = None) -> dict[str, float]:
    """Evaluate `model` on `loader` in eval mode (then back to train mode). ``forward(batch)`` returns
    outputs with ``.loss`` (and ``.logits``); default: ``model(**batch)``."""
    forward = forward or (lambda batch: model(**batch))
    was_training = model.training
    model.eval()
    evaluator.reset()
    try:
        for i, batch in enumerate(loader):
            if max_batches is not None and i >= max_batches:
                break
            batch = {k: v.to(device) for k, v in batch.items()}
            with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                outputs = forward(batch)
            evaluator.process(model, batch, outputs)
    finally:
        model.train(was_training)
    return evaluator.evaluate()


def pipelined_forward(pipeline, model) -> Callable[[dict], ModelOutput]:
    """``forward`` for `run_evaluation` through the pipeline's forward-only schedule: the batch's
    mean loss (a causal LM; no logits leave the last stage). `model` is this rank's merged stages."""
    def forward(batch: dict) -> ModelOutput:
        shifted = "shift_labels" in batch
        total = pipeline.eval_step(batch["input_ids"], batch["shift_labels" if shifted else "labels"], shifted=shifted)
        return ModelOutput(loss=torch.tensor(total / count_targets(model, batch)))
    return forward
