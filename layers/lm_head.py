"""The language-model head: hidden states -> vocabulary logits, split over the vocabulary, and the
loss computed on that split.

    h [B, S, hidden] -> column-parallel [hidden, S(V)] -> logits [B, S, V/tp] -> vocab-parallel CE

Training never gathers [B, S, V]: `loss` works on this rank's vocabulary slice
(`ParallelCrossEntropy`). `gather` makes the whole-vocabulary logits for callers that want them
(a Hugging Face forward, generation).
"""

from __future__ import annotations

import torch

from libai_zoo.dist.collectives import broadcast_, gather_from_tp

from .cross_entropy import ParallelCrossEntropy
from .embedding import vocabulary_problems
from .linear import Linear


class LMHead(Linear):
    """Projection onto the vocabulary (weight [V, hidden]; tie it to the token embedding if wanted).
    ``forward`` returns this rank's slice of the logits."""

    def __init__(self, hidden_size: int, vocab_size: int, bias: bool = False, *, ignore_index: int = -100,
                 device=None, dtype=None):
        super().__init__(hidden_size, vocab_size, bias, "col", sequence_parallel=False, device=device, dtype=dtype)
        self.loss_fn = ParallelCrossEntropy(ignore_index)

    def tp_problems(self, tp_size: int) -> list[str]:
        return vocabulary_problems(self.out_features, tp_size)

    def loss(self, logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        """Cross entropy of this rank's logits (from `forward`) against targets aligned with them
        (global vocabulary ids; ignore_index skipped), in float32."""
        return self.loss_fn(logits, targets.to(logits.device), reduction=reduction)

    def gather(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits over the whole vocabulary, on every tp rank."""
        return logits if self.tp is None else gather_from_tp(logits, self.tp, dim=-1)

    def agree(self, tokens: torch.Tensor) -> torch.Tensor:
        """The tokens tp rank 0 chose, on every tp rank (each rank samples from its own random
        stream; all must continue with the same sequence). Without tp, `tokens` as they are."""
        return tokens if self.tp is None else broadcast_(tokens, self.tp)
