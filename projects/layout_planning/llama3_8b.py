"""Llama 3 8B at its published shape (32 layers, hidden 4096, 32 heads, 8 KV heads, vocabulary 128256;
sequence 8192, global batch 128 sequences as NVIDIA's benchmarks run it, bf16), for planning and
dry runs at scale (built on the meta device only).

    python tools/plan.py projects/layout_planning/llama3_8b.py --world-size 8 --device h100
"""

from libai_zoo.config import LazyCall
from libai_zoo.models import LlamaConfig

from .llama_70b import dataloader, dist, model, optim, train  # noqa: F401  (config keys)

model.config = LazyCall(LlamaConfig)(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0,
)
train.update(output_dir="output/llama3_8b")
