"""test_convert.py's runs from a converted checkpoint: the model is the one `hf-to-zoo` recorded in
the checkpoint's config.yaml (the test sets it from there), the data one repeated random sequence,
its sizes overrides: dataloader.train.num_samples=... dataloader.train.seq_len=... dataloader.train.vocab=..."""

from libai_zoo.config import LazyCall, get_config
from test_convert import token_dataset

train = get_config("common/train.py").train
dist = get_config("common/train.py").dist
optim = get_config("common/optim.py").optim
model = "???"
dataloader = dict(train=LazyCall(token_dataset)(num_samples="???", seq_len="???", vocab="???"), shuffle=False)
