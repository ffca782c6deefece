"""Pretrain a transformers model the zoo has no class for: transformers' own Phi (phi-2's
architecture: attention and MLP side by side, rotary on half of each head, LayerNorm with biases),
made trainable through its own declarations, with gpt2_pretrain's data and training.

    python tools/train.py projects/any_transformers/config.py
    torchrun --nproc_per_node=2 tools/train.py projects/any_transformers/config.py dist.dp=2 train.zero_stage=3 \
    train.micro_batch_size=8 train.activation_checkpoint.enabled=true train.output_dir=output/any_transformers_zero3
    torchrun --nproc_per_node=2 tools/train.py projects/any_transformers/config.py dist.tp=2 \
    train.output_dir=output/any_transformers_tp2
    torchrun --nproc_per_node=2 tools/train.py projects/any_transformers/config.py dist.pp=2 \
    train.micro_batch_size=8 train.output_dir=output/any_transformers_pp2
"""

import transformers

from libai_zoo.config import LazyCall

from ..gpt2_pretrain.config import dataloader, dist, hooks, optim, train  # noqa: F401  (config keys)

# transformers' own class and config: any causal LM of transformers' Auto mapping goes here (or
# LazyCall(libai_zoo.models.AutoModelForCausalLM.from_pretrained)(path=...) for a directory)
model = LazyCall(transformers.AutoModelForCausalLM.from_config)(
    config=LazyCall(transformers.PhiConfig)(
        vocab_size=8192,            # data/tokenizer
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        partial_rotary_factor=0.5,
        max_position_embeddings=128,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        bos_token_id=0,             # <|endoftext|>
        eos_token_id=0,
    )
)

train.output_dir = "output/any_transformers"
