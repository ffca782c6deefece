"""Pretrain a tiny GPT-2 on the shipped corpus (Python standard-library docstrings), on CPU.

    python tools/train.py projects/gpt2_pretrain/config.py
    python tools/train.py projects/gpt2_pretrain/config.py train.max_iter=2000 model.config.n_layer=6 \
    train.output_dir=output/gpt2_6_layers          # another model: another directory
"""

from libai_zoo.config import LazyCall, get_config
from libai_zoo.engine import GenerateSample
from libai_zoo.models import GPT2Config, GPT2LMHeadModel

from ..common.corpus_lm_data import dataloader  # noqa: F401  (a config key)

train = get_config("common/train.py").train
dist = get_config("common/train.py").dist
optim = get_config("common/optim.py").optim

model = LazyCall(GPT2LMHeadModel)(
    config=LazyCall(GPT2Config)(
        vocab_size=8192,            # data/tokenizer
        n_positions=128,
        n_embd=128,
        n_layer=4,
        n_head=4,
        bos_token_id=0,             # <|endoftext|>
        eos_token_id=0,
    )
)

optim.lr = 2e-3
optim.betas = (0.9, 0.95)

train.update(
    output_dir="output/gpt2_pretrain",
    max_iter=400,
    micro_batch_size=16,
    global_batch_size=16,
    log_period=25,
    checkpoint=dict(period=200),
    eval=dict(period=200, max_batches=None),
    scheduler=LazyCall("libai_zoo.optim.WarmupCosineLR")(warmup_iters=40, min_lr_ratio=0.1),
)

# After training, the model continues a prompt: a look at what it learned.
hooks = [LazyCall(GenerateSample)(tokenizer="data/tokenizer", prompt="Return the", max_new_tokens=30)]
