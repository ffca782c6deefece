"""Llama 2 7B at its published shape (sequence 4096, global batch 1024 sequences = 4M tokens, bf16),
for planning and dry runs at scale (built on the meta device only).

    python tools/plan.py projects/layout_planning/llama_7b.py --world-size 64 --device h100
"""

from libai_zoo.config import LazyCall
from libai_zoo.models import LlamaConfig

from .llama_70b import dataloader, dist, model, optim, train  # noqa: F401  (config keys)

model.config = LazyCall(LlamaConfig)(
    vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=32, max_position_embeddings=4096,
)
dataloader["train"].seq_len = 4096
train.update(output_dir="output/llama_7b", global_batch_size=1024)
