"""A two-layer GPT-2 without dropout on a text corpus read in order (test_text_datasets.py); the
corpus and its token cache are overrides: dataloader.train.path=... dataloader.train.cache_dir=...,
and dataloader.train.streaming=true reads it as a stream."""

from pathlib import Path

from libai_zoo.config import LazyCall, get_config
from libai_zoo.data import build_text_dataset
from libai_zoo.models import GPT2Config, GPT2LMHeadModel

_TOKENIZER = str(Path(__file__).resolve().parents[3] / "data/tokenizer")

train = get_config("common/train.py").train
dist = get_config("common/train.py").dist
optim = get_config("common/optim.py").optim
model = LazyCall(GPT2LMHeadModel)(config=LazyCall(GPT2Config)(
    vocab_size=8192, n_positions=16, n_embd=32, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0,
    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
dataloader = dict(train=LazyCall(build_text_dataset)(path="???", tokenizer_dir=_TOKENIZER, seq_len=16,
                                                     cache_dir="???", streaming=False),
                  shuffle=False, num_workers=0)
train.update(max_iter=6, micro_batch_size=2, global_batch_size=4, log_period=1, checkpoint=dict(period=3))
optim.lr = 1e-3
