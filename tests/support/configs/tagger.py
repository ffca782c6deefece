"""test_model_contract.py's user-written model, a token tagger, on its random tagging data; another
of that module's models is an override: model._target_=test_model_contract.ScaledTagger."""

from libai_zoo.config import LazyCall, get_config
from test_model_contract import TaggingData, TinyTagger

train = get_config("common/train.py").train
dist = get_config("common/train.py").dist
optim = get_config("common/optim.py").optim
model = LazyCall(TinyTagger)()
dataloader = dict(train=LazyCall(TaggingData)(), shuffle=False)
