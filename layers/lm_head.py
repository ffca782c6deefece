"""The language-model head: hidden states -> vocabulary logits -> loss, split over the vocabulary.

    h [B, S, hidden] -> column-parallel [hidden, S(V)] -> logits [B, S, V/tp] -> vocab-parallel CE

The loss is computed on this rank's vocabulary slice (`ParallelCrossEntropy`), so training never
gathers [B, S, V]; the logits handed back are gathered to the whole vocabulary, as callers of a
Hugging Face model expect, unless ``return_logits=False`` says nobody needs them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from libai_zoo.dist.collectives import broadcast_, gather_from_tp

from .cross_entropy import ParallelCrossEntropy
from .embedding import vocabulary_problems
from .linear import Linear


class LMHead(Linear):
    """Projection onto the vocabulary (weight [V, hidden], tie it to the token embedding if wanted)."""

    def __init__(self, hidden_size: int, vocab_size: int, bias: bool = False, *, ignore_index: int = -100,
                 device=None, dtype=None):
        super().__init__(hidden_size, vocab_size, bias, "col", sequence_parallel=False, device=device, dtype=dtype)
        self.loss_fn = ParallelCrossEntropy(ignore_index)

    def tp_problems(self, tp_size: int) -> list[str]:
        return vocabulary_problems(self.out_features, tp_size)

    def forward(self, hidden_states: torch.Tensor, labels: torch.Tensor | None = None, *, shift: bool = False,
                logits_to_keep: int = 0, return_logits: bool = True
                ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(loss, logits). ``shift``: position t predicts labels[t + 1] (causal LM);
        ``logits_to_keep=n`` projects only the last n positions (generation)."""
        if logits_to_keep:
            if labels is not None:
                raise ValueError("logits_to_keep computes the last positions only: it cannot take labels")
            hidden_states = hidden_states[:, -logits_to_keep:]
        logits = super().forward(hidden_states)
        loss = None
        if labels is not None:
            if shift:
                labels = F.pad(labels, (0, 1), value=self.loss_fn.ignore_index)[..., 1:]
            loss = self.loss_fn(logits, labels.to(logits.device))
        if not return_logits:
            return loss, None
        return loss, logits if self.tp is None else gather_from_tp(logits, self.tp, dim=-1)

    def agree(self, tokens: torch.Tensor) -> torch.Tensor:
        """The tokens tp rank 0 chose, on every tp rank (each rank samples from its own random
        stream; all must continue with the same sequence). Without tp, `tokens` as they are."""
        return tokens if self.tp is None else broadcast_(tokens, self.tp)
