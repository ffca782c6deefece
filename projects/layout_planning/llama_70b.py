"""Llama 3 70B at its published shape (sequence 8192, global batch 128 sequences, bf16), for
planning and dry runs at scale: the planner builds it on the meta device only (no memory).

    python tools/plan.py projects/layout_planning/llama_70b.py --world-size 64 --device h100
    python tools/plan.py projects/layout_planning/llama_70b.py --world-size 512 --dry-run \\
        dist.dp=8 dist.tp=8 dist.pp=8 train.zero_stage=1

The training data is the shipped corpus cut at this sequence length (a stand-in: the recipe is
for planning; train it on your own data).
"""

from libai_zoo.config import LazyCall, get_config
from libai_zoo.data import build_gpt_dataset
from libai_zoo.models import LlamaConfig, LlamaForCausalLM

train = get_config("common/train.py").train
dist = get_config("common/train.py").dist
optim = get_config("common/optim.py").optim

model = LazyCall(LlamaForCausalLM)(
    config=LazyCall(LlamaConfig)(
        vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
        num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0,
    )
)

dataloader = dict(
    train=LazyCall(build_gpt_dataset)(text_file="data/corpus/python_docs.txt", tokenizer_dir="data/tokenizer",
                                      seq_len=8192, cache_dir="output/cache"),
)

train.update(output_dir="output/llama_70b", micro_batch_size=1, global_batch_size=128, amp=dict(enabled=True))
