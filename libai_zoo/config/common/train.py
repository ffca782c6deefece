"""The run: `train` (loop, precision, memory, checkpoints, evaluation) and `dist` (the layout).

    cfg = get_config("common/train.py")         # keys: train, dist
    python tools/train.py RECIPE.py train.max_iter=100 train.amp.enabled=true dist.tp=2

Every key, its type, its default and what it does: `TrainConfig` and `DistConfig` in
libai_zoo/config/schema.py (the one place each default is stated).
"""

from libai_zoo.config.schema import DistConfig, TrainConfig

train = TrainConfig()
dist = DistConfig()
