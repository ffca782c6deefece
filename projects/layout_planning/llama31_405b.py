"""Llama 3.1 405B at its published shape (126 layers, hidden 16384, 128 heads, 8 KV heads, SwiGLU
53248, vocabulary 128256; sequence 8192, global batch 1536 sequences as NVIDIA's recipe trains it,
bf16), for planning and dry runs at scale (built on the meta device only).

    python tools/plan.py projects/layout_planning/llama31_405b.py --world-size 512 --device h100
    python tools/plan.py projects/layout_planning/llama31_405b.py --world-size 512 --dry-run \\
        dist.dp=4 dist.cp=2 dist.tp=8 dist.pp=8 train.zero_stage=1
"""

from libai_zoo.config import LazyCall
from libai_zoo.models import LlamaConfig

from .llama_70b import dataloader, dist, model, optim, train  # noqa: F401  (config keys)

model.config = LazyCall(LlamaConfig)(
    vocab_size=128256, hidden_size=16384, intermediate_size=53248, num_hidden_layers=126, num_attention_heads=128,
    num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0,
)
train.update(output_dir="output/llama31_405b", global_batch_size=1536)
