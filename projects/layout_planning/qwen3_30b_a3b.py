"""Qwen3-30B-A3B at its published shape (48 layers, hidden 2048, 32 heads, 4 KV heads, head_dim 128,
128 experts of 768 neurons, 8 per token, vocabulary 151936; sequence 4096, global batch 512
sequences, bf16), for planning and dry runs at scale: built on the meta device only (no memory).

    python tools/plan.py projects/layout_planning/qwen3_30b_a3b.py --world-size 64 --device h100
    python tools/plan.py projects/layout_planning/qwen3_30b_a3b.py --world-size 64 --dry-run \\
        dist.dp=16 dist.ep=8 dist.tp=1 dist.pp=4 train.zero_stage=1

The training data is the shipped corpus cut at this sequence length (a stand-in: the recipe is
for planning; train it on your own data).
"""

from libai_zoo.config import LazyCall, get_config
from libai_zoo.data import build_gpt_dataset
from libai_zoo.models import Qwen3MoeConfig, Qwen3MoeForCausalLM

train = get_config("common/train.py").train
dist = get_config("common/train.py").dist
optim = get_config("common/optim.py").optim

model = LazyCall(Qwen3MoeForCausalLM)(
    config=LazyCall(Qwen3MoeConfig)(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
        num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=40960, rope_theta=1000000.0,
        rms_norm_eps=1e-6, router_aux_loss_coef=0.001, output_router_logits=True, tie_word_embeddings=False,
    )
)

dataloader = dict(
    train=LazyCall(build_gpt_dataset)(text_file="data/corpus/python_docs.txt", tokenizer_dir="data/tokenizer",
                                      seq_len=4096, cache_dir="output/cache"),
)

train.update(output_dir="output/qwen3_30b_a3b", micro_batch_size=1, global_batch_size=512, amp=dict(enabled=True))
