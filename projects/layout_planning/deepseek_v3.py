"""DeepSeek-V3 671B at its published shape (61 layers, the first 3 dense; hidden 7168, 128 heads of
multi-head latent attention; 256 routed experts of 2048 neurons, 8 per token in 4 of 8 groups, 1
shared; vocabulary 129280; sequence 4096, global batch 15360 sequences, bf16 here where DeepSeek
trained in FP8), for planning and dry runs at scale: built on the meta device only (no memory).
The multi-token-prediction layer is not part of the model (transformers skips it too).

    python tools/plan.py projects/layout_planning/deepseek_v3.py --world-size 1024 --device h100
    python tools/plan.py projects/layout_planning/deepseek_v3.py --world-size 1024 --dry-run \\
        dist.dp=128 dist.ep=32 dist.tp=8 dist.pp=1 train.zero_stage=3

The training data is the shipped corpus cut at this sequence length (a stand-in: the recipe is
for planning; train it on your own data).
"""

from libai_zoo.config import LazyCall, get_config
from libai_zoo.data import build_gpt_dataset
from libai_zoo.models import DeepseekV3Config, DeepseekV3ForCausalLM

train = get_config("common/train.py").train
dist = get_config("common/train.py").dist
optim = get_config("common/optim.py").optim

model = LazyCall(DeepseekV3ForCausalLM)(
    config=LazyCall(DeepseekV3Config)(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=61, first_k_dense_replace=3, num_attention_heads=128, num_key_value_heads=128,
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8, n_group=8, topk_group=4,
        norm_topk_prob=True, routed_scaling_factor=2.5, max_position_embeddings=4096, rope_theta=10000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=False,
    )
)

dataloader = dict(
    train=LazyCall(build_gpt_dataset)(text_file="data/corpus/python_docs.txt", tokenizer_dir="data/tokenizer",
                                      seq_len=4096, cache_dir="output/cache"),
)

train.update(output_dir="output/deepseek_v3", micro_batch_size=1, global_batch_size=15360, amp=dict(enabled=True))
