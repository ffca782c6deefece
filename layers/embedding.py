"""Token embedding with the vocabulary split over tensor parallelism."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from libai_zoo.distributed import TensorParallel, local
from libai_zoo.distributed.collectives import row_output

from .parallel_layer import ParallelLayer, indivisible


class VocabEmbedding(ParallelLayer, nn.Embedding):
    """`nn.Embedding` whose rows (the vocabulary) are split over tp.

    Each rank looks up the ids in its own range [start, end), writes zeros for the others, and
    one all-reduce sums the parts: [B, S] ids -> [B, S, P(h)] -> all-reduce -> [B, S, h].
    Under sequence parallelism that all-reduce becomes a reduce-scatter, so the output is already
    split over the sequence; pass ``sequence_parallel=False`` when the model adds position
    embeddings first and splits the sum itself (`SequenceScatter`).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None, *,
                 sequence_parallel: bool = True, device=None, dtype=None):
        super().__init__(num_embeddings, embedding_dim, padding_idx, device=device, dtype=dtype)
        self.sequence_parallel = sequence_parallel
        self.vocab_start, self.vocab_end = 0, num_embeddings

    def tp_problems(self, tp_size: int) -> list[str]:
        return vocabulary_problems(self.num_embeddings, tp_size)

    def shard_(self, tp: TensorParallel) -> None:
        tp.shard_parameter(self, "weight", 0)
        self.vocab_start, self.vocab_end = tp.local_range(self.num_embeddings)
        super().shard_(tp)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        tp = self.tp
        if tp is None:
            return F.embedding(input_ids, self.weight, self.padding_idx)
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local_ids = (input_ids - self.vocab_start).masked_fill_(outside, 0)
        padding_idx = None
        if self.padding_idx is not None and self.vocab_start <= self.padding_idx < self.vocab_end:
            padding_idx = self.padding_idx - self.vocab_start
        out = F.embedding(local_ids, local(self.weight), padding_idx)
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        return row_output(out, tp, self.sp)

    def extra_repr(self) -> str:
        split = "" if self.tp is None else f", rows=[{self.vocab_start}, {self.vocab_end})"
        return super().extra_repr() + split + self.parallel_repr()


class Embedding(ParallelLayer, nn.Embedding):
    """`nn.Embedding` replicated over tp: the small tables (positions, token types).

    Models add these to the token embeddings before the sequence-parallel region, so the default
    is ``sequence_parallel=False``; looked up on a sequence shard, its gradient is partial.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None, *,
                 sequence_parallel: bool = False, device=None, dtype=None):
        super().__init__(num_embeddings, embedding_dim, padding_idx, device=device, dtype=dtype)
        self.sequence_parallel = sequence_parallel

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, local(self.weight, partial_grad=self.sp), self.padding_idx)

    def extra_repr(self) -> str:
        return super().extra_repr() + self.parallel_repr()


def vocabulary_problems(vocab_size: int, tp_size: int) -> list[str]:
    """What a vocabulary split over tp (token embedding, LM head) needs."""
    padded = -(-vocab_size // tp_size) * tp_size
    return indivisible(vocab_size, tp_size, "vocabulary size",
                       f"pad the vocabulary to a multiple of tp (e.g. {padded}; the extra rows are never looked up "
                       f"and the tokenizer is unchanged), or lower tp")
