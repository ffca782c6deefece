"""The language-model head: hidden states -> vocabulary logits, split over the vocabulary, and the
loss computed on that split.

    h [B, S, hidden] -> column-parallel [hidden, S(V)] -> logits [B, S, V/tp] -> vocab-parallel CE

Some families reshape the logits: Granite divides them by ``logits_scaling`` (``logit_scale``
here is its inverse), Gemma 2 caps them at ±``logit_softcap`` (cap·tanh(z/cap)); both act on each
rank's slice, before the loss and before generation.

Training never gathers [B, S, V]: `loss` works on this rank's vocabulary slice
(`ParallelCrossEntropy`). `gather` makes the whole-vocabulary logits for callers that want them
(a Hugging Face forward, generation). `loss_from_hidden` goes further for large vocabularies: it
never holds more than one chunk of tokens' logits, in forward or backward.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.utils.checkpoint import checkpoint

from libai_zoo.distributed.collectives import broadcast_, gather_from_tp

from .cross_entropy import ParallelCrossEntropy
from .embedding import vocabulary_problems
from .linear import Linear

_in_two_chunks = False


@contextmanager
def chunked_in_two() -> Iterator[None]:
    """`LMHead.loss_from_hidden` splits the tokens it chunks (those above `LMHead.chunk_bytes` of
    logits) into two chunks, not `chunk_bytes`' many. The loss is the same sum and what backward
    keeps is the same storages (each chunk keeps a view of the hidden states): the seam through
    which the planner measures a chunked loss on fake tensors, where a chunk costs time, not memory."""
    global _in_two_chunks
    saved, _in_two_chunks = _in_two_chunks, True
    try:
        yield
    finally:
        _in_two_chunks = saved


class LMHead(Linear):
    """Projection onto the vocabulary (weight [V, hidden]; tie it to the token embedding if wanted).
    ``forward`` returns this rank's slice of the logits."""

    #: Above this many bytes of float32 logits (this rank's vocabulary slice), `loss_from_hidden`
    #: works in chunks of tokens: 256 MiB is 512 tokens of a 128k vocabulary.
    chunk_bytes: int = 256 * 2**20

    def __init__(self, hidden_size: int, vocab_size: int, bias: bool = False, *, ignore_index: int = -100,
                 logit_scale: float = 1.0, logit_softcap: float | None = None, device=None, dtype=None):
        super().__init__(hidden_size, vocab_size, bias, "col", sequence_parallel=False, device=device, dtype=dtype)
        self.loss_fn = ParallelCrossEntropy(ignore_index)
        self.logit_scale, self.logit_softcap = logit_scale, logit_softcap

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shape_logits(super().forward(x))

    def shape_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The family's scaling and soft-cap of projected logits (any slice of the vocabulary)."""
        if self.logit_scale != 1.0:
            logits = logits * self.logit_scale
        if self.logit_softcap is not None:
            logits = self.logit_softcap * torch.tanh(logits / self.logit_softcap)
        return logits

    def tp_problems(self, tp_size: int) -> list[str]:
        return vocabulary_problems(self.out_features, tp_size)

    def loss(self, logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        """Cross entropy of this rank's logits (from `forward`) against targets aligned with them
        (global vocabulary ids; ignore_index skipped), in float32."""
        return self.loss_fn(logits, targets.to(logits.device), reduction=reduction)

    def loss_from_hidden(self, hidden: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        """``loss(self(hidden), targets, reduction)`` without keeping the logits: when this rank's
        float32 logits would exceed `chunk_bytes`, the tokens go through the projection and the
        cross entropy in chunks, each under activation checkpointing (recomputed in backward), so
        one chunk's logits exist at a time (a 128k vocabulary's [B·S, V] float32 logits and their
        softmax are several GiB). Same loss and gradients, summed chunk by chunk."""
        tokens = hidden.shape[:-1].numel()
        per_chunk = self.tokens_per_chunk(self.weight.shape[0] // (self.tp.size if self.tp is not None else 1))
        if tokens <= per_chunk:
            return self.loss(self(hidden), targets, reduction)
        if _in_two_chunks:
            per_chunk = -(-tokens // 2)
        flat_hidden, flat_targets = hidden.flatten(0, -2), targets.flatten().to(hidden.device)
        total = sum(checkpoint(self._chunk_loss, flat_hidden[i:i + per_chunk], flat_targets[i:i + per_chunk],
                               use_reentrant=False) for i in range(0, tokens, per_chunk))
        if reduction == "sum":
            return total
        if reduction == "mean":
            return total / (flat_targets != self.loss_fn.ignore_index).sum()
        raise ValueError(f"loss_from_hidden reduces the loss: reduction 'mean' or 'sum', not {reduction!r}")

    def tokens_per_chunk(self, local_vocab: int) -> int:
        """Tokens whose float32 logits over `local_vocab` entries fit in `chunk_bytes`: above them the
        loss runs in chunks of this many (`loss_from_hidden`)."""
        return max(1, self.chunk_bytes // (4 * local_vocab))

    def _chunk_loss(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.loss(self(hidden), targets, reduction="sum")

    def gather(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits over the whole vocabulary, on every tp rank."""
        return logits if self.tp is None else gather_from_tp(logits, self.tp, dim=-1)

    def agree(self, tokens: torch.Tensor) -> torch.Tensor:
        """The tokens tp rank 0 chose, on every tp rank (each rank samples from its own random
        stream; all must continue with the same sequence). Without tp, `tokens` as they are."""
        return tokens if self.tp is None else broadcast_(tokens, self.tp)
