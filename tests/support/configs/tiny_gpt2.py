"""A two-layer GPT-2 on a text file (test_trainer.py). The text and its token cache are overrides:
dataloader.train.text_file=... dataloader.train.cache_dir=... (the test set reads the same)."""

from pathlib import Path

from libai_zoo.config import LazyCall, get_config
from libai_zoo.data import build_gpt_dataset
from libai_zoo.models import GPT2Config, GPT2LMHeadModel

_TOKENIZER = str(Path(__file__).resolve().parents[3] / "data/tokenizer")

train = get_config("common/train.py").train
dist = get_config("common/train.py").dist
optim = get_config("common/optim.py").optim
model = LazyCall(GPT2LMHeadModel)(config=LazyCall(GPT2Config)(
    vocab_size=8192, n_positions=32, n_embd=32, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0))
dataloader = dict(train=LazyCall(build_gpt_dataset)(text_file="???", tokenizer_dir=_TOKENIZER, seq_len=32,
                                                    cache_dir="???"),
                  test=LazyCall(build_gpt_dataset)(text_file="${dataloader.train.text_file}", tokenizer_dir=_TOKENIZER,
                                                   seq_len=32, cache_dir="${dataloader.train.cache_dir}"))
