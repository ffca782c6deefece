"""A cp rank's part of a causal LM's micro-batch: what context parallelism hands each rank of a
sample (the train step, the evaluator and the planner's measurement all cut batches here)."""

from __future__ import annotations

import torch

from libai_zoo.distributed import ContextParallel
from libai_zoo.models import TrainableModel


def context_parallel_part(batch: dict[str, torch.Tensor], model: TrainableModel,
                          cp: ContextParallel) -> dict[str, torch.Tensor]:
    """This cp rank's part of a causal LM's micro-batch (every cp rank of a dp rank reads the same
    samples): each [B, S] input cut into the rank's two chunks along the sequence (`cp.split`), the
    targets shifted over the whole sequence first and then cut (``shift_labels``: a shift inside a
    chunk would score its last token against the next chunk's first), and the global positions
    (``position_ids``: the batch's own, restarting for packed samples, else 0..S-1), which rotary
    and learned positions, and attention's causal rule, then read."""
    inputs, targets = model.split_batch(batch)
    ids = inputs[model.main_input_name]
    if "position_ids" not in inputs:
        inputs["position_ids"] = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    for key, value in inputs.items():
        if value.shape[:2] != ids.shape:
            raise ValueError(f"under context parallelism every input is cut along the sequence, but {key} has "
                             f"shape {tuple(value.shape)}, not [batch, sequence] = {tuple(ids.shape)} (a 2-D "
                             f"attention_mask of padding is; mark packed samples by restarting position_ids, not a "
                             f"4-D mask)")
    part = {key: cp.split(value, 1) for key, value in inputs.items()}
    part["shift_labels"] = cp.split(targets, 1)
    return part
