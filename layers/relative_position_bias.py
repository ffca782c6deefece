"""T5's relative position bias (Raffel et al., 2020, §2.1): one learned scalar per head and bucket
of the distance key − query, added to the attention scores.

    distance d = key − query -> bucket (exact for small |d|, logarithmically wider up to
    max_distance, one bucket beyond; bidirectional: separate buckets for keys after the query,
    else later keys share bucket 0) -> table [num_buckets, heads] -> bias [1, heads, S_q, S_k]

The table is split over tp along the heads, as `Attention` splits them (a rank's heads are one
contiguous block): each rank computes only its own heads' bias. It depends on positions alone,
so it is computed once per forward for all the layers that share it, on the whole sequence even
under sequence parallelism (attention sees the whole sequence of its heads).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from libai_zoo.distributed import TensorParallel, local

from .parallel_layer import ParallelLayer, indivisible


def relative_position_bucket(distance: torch.Tensor, *, bidirectional: bool, num_buckets: int,
                             max_distance: int) -> torch.Tensor:
    """The bucket of each distance key − query: half of the buckets (of each direction when
    bidirectional) count exact distances, the other half grow logarithmically up to
    `max_distance`, and farther keys share the last one. Causal: a later key (d > 0) is bucket 0."""
    if bidirectional:
        num_buckets //= 2
        bucket = (distance > 0).long() * num_buckets
        distance = distance.abs()
    else:
        bucket = torch.zeros_like(distance)
        distance = (-distance).clamp(min=0)
    exact = num_buckets // 2
    # exact + log(d / exact) / log(max_distance / exact) of the logarithmic buckets (d = 0 is exact: masked)
    logarithmic = exact + (torch.log(distance.float() / exact) / math.log(max_distance / exact)
                           * (num_buckets - exact)).long()
    logarithmic = logarithmic.clamp(max=num_buckets - 1)
    return bucket + torch.where(distance < exact, distance, logarithmic)


class RelativePositionBias(ParallelLayer, nn.Module):
    """T5's bucketed relative position bias: the table `weight` [num_buckets, num_heads] (transformers'
    ``relative_attention_bias``, an nn.Embedding of the buckets), split over tp along the heads.
    ``bidirectional``: an encoder's (keys on both sides of the query); False: a decoder's."""

    sequence_parallel = False  # it computes from positions, never from a sequence shard

    def __init__(self, num_heads: int, num_buckets: int = 32, max_distance: int = 128, *,
                 bidirectional: bool = True, device=None, dtype=None):
        super().__init__()
        self.num_heads, self.num_buckets, self.max_distance = num_heads, num_buckets, max_distance
        self.bidirectional = bidirectional
        self.weight = nn.Parameter(torch.empty(num_buckets, num_heads, device=device, dtype=dtype))
        nn.init.normal_(self.weight)

    def tp_problems(self, tp_size: int) -> list[str]:
        return indivisible(self.num_heads, tp_size, "num_heads of a relative position bias",
                           "choose a tp that divides the number of heads")

    def shard_(self, tp: TensorParallel) -> None:
        tp.shard_parameter(self, "weight", 1)
        super().shard_(tp)

    def forward(self, query_length: int, key_length: int, past: int = 0) -> torch.Tensor:
        """The bias [1, this rank's heads, query_length, key_length] of queries at positions
        past, ..., past + query_length − 1 against keys at 0, ..., key_length − 1 (generation: the
        new tokens after `past` cached ones), in the table's dtype."""
        device = self.weight.device
        queries = torch.arange(past, past + query_length, device=device)[:, None]
        keys = torch.arange(key_length, device=device)[None, :]
        buckets = relative_position_bucket(keys - queries, bidirectional=self.bidirectional,
                                           num_buckets=self.num_buckets, max_distance=self.max_distance)
        return F.embedding(buckets, local(self.weight)).permute(2, 0, 1).unsqueeze(0)

    def extra_repr(self) -> str:
        kind = "bidirectional" if self.bidirectional else "causal"
        return (f"buckets={self.num_buckets}, max_distance={self.max_distance}, heads={self.num_heads}, "
                f"{kind}{self.parallel_repr()}")
