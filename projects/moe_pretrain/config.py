"""Pretrain a tiny Qwen3-MoE from scratch on the shipped corpus, on CPU: 4 layers, each MLP 8
experts of which a token takes 2, with transformers' load-balancing loss in the objective.

    python tools/train.py projects/moe_pretrain/config.py
    python tools/plot.py output/moe_pretrain          # loss, aux_loss (expert balance), lr, throughput
    torchrun --nproc_per_node=2 tools/train.py projects/moe_pretrain/config.py dist.tp=2 \
        train.output_dir=output/moe_pretrain_tp2
"""

from libai_zoo.config import LazyCall
from libai_zoo.models import Qwen3MoeConfig, Qwen3MoeForCausalLM

from ..gpt2_pretrain.config import dataloader, dist, hooks, optim, train  # noqa: F401  (config keys)

model = LazyCall(Qwen3MoeForCausalLM)(
    config=LazyCall(Qwen3MoeConfig)(
        vocab_size=8192,                # data/tokenizer
        max_position_embeddings=128,
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=128,      # each expert; 2 of 8 active: the active MLP is 256 wide
        norm_topk_prob=True,
        output_router_logits=True,      # loss = LM loss + router_aux_loss_coef × aux_loss
        router_aux_loss_coef=0.01,
        bos_token_id=0,                 # <|endoftext|>
        eos_token_id=0,
    )
)

train.output_dir = "output/moe_pretrain"
