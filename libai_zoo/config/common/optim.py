"""The optimizer: AdamW over parameter groups that exempt biases and norms from weight decay.

    cfg = get_config("common/optim.py")         # key: optim
    build_optimizer(cfg.optim, model_parts)     # the trainer: param_groups of the parts, then AdamW

Its keys and defaults: `AdamWConfig` in libai_zoo/config/schema.py. A recipe may swap the
optimizer: ``optim = LazyCall(torch.optim.SGD)(params=LazyCall(param_groups)(weight_decay=0.0), lr=0.1)``.
"""

from libai_zoo.config.schema import AdamWConfig

optim = AdamWConfig()
