"""A Hugging Face checkpoint trained on a text file (test_lora.py, test_accelerate.py): the checkpoint,
the text and its token cache are overrides, model.path=... dataloader.train.text_file=...
dataloader.train.cache_dir=..."""

from pathlib import Path

from libai_zoo.config import LazyCall, get_config
from libai_zoo.data import build_gpt_dataset

_TOKENIZER = str(Path(__file__).resolve().parents[3] / "data/tokenizer")

train = get_config("common/train.py").train
dist = get_config("common/train.py").dist
optim = get_config("common/optim.py").optim
model = LazyCall("libai_zoo.models.AutoModelForCausalLM.from_pretrained")(path="???", dtype="float32")
dataloader = dict(train=LazyCall(build_gpt_dataset)(text_file="???", tokenizer_dir=_TOKENIZER, seq_len=16,
                                                    cache_dir="???"))
