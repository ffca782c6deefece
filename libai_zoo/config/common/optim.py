"""The optimizer: AdamW over parameter groups that exempt biases and norms from weight decay.

    cfg = get_config("common/optim.py")         # key: optim
    cfg.optim.params.model = model              # the trainer does this, then instantiate(cfg.optim)
"""

import torch

from libai_zoo.config import LazyCall

optim = LazyCall(torch.optim.AdamW)(
    # libai_zoo.optim.param_groups(model, weight_decay): groups with and without weight decay;
    # `model` is filled in at build time.
    params=LazyCall("libai_zoo.optim.param_groups")(weight_decay=0.01),
    lr=1e-4,
    betas=(0.9, 0.999),
    eps=1e-8,
    weight_decay=0.01,              # for any group that sets none itself
)
