"""test_transformers_models.py's models that the zoo runs through transformers' own classes, one per
name of its SUITE (the test picks one as the model): built by transformers.AutoModelForCausalLM.from_config,
or read from the Hugging Face directory hf_dir/<name> (FROM_DIRECTORY); on a text file. The
directories, the text and its cache are overrides: hf_dir=... dataloader.train.text_file=...
dataloader.train.cache_dir=..."""

from pathlib import Path

import transformers

from libai_zoo.config import LazyCall, get_config
from libai_zoo.data import build_gpt_dataset
from libai_zoo.models import AutoModelForCausalLM
from test_transformers_models import FROM_DIRECTORY as _FROM_DIRECTORY
from test_transformers_models import SIZES as _SIZES
from test_transformers_models import SUITE as _SUITE


def _model(name: str):
    if name in _FROM_DIRECTORY:
        return LazyCall(AutoModelForCausalLM.from_pretrained)(path="${hf_dir}/" + name)
    cls, features = _SUITE[name]
    return LazyCall(transformers.AutoModelForCausalLM.from_config)(
        config=LazyCall(getattr(transformers, cls))(**dict(_SIZES, **features)))


hf_dir = "???"
train = get_config("common/train.py").train
dist = get_config("common/train.py").dist
optim = get_config("common/optim.py").optim
models = {name: _model(name) for name in _SUITE}
model = models["phi"]
dataloader = dict(train=LazyCall(build_gpt_dataset)(
    text_file="???", tokenizer_dir=str(Path(__file__).resolve().parents[3] / "data/tokenizer"), seq_len=16,
    cache_dir="???"))
