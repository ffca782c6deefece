"""Train a small ViT from scratch on the UCI handwritten digits (8×8 grey images, 10 classes).

    python tools/train.py projects/vit_classification/config.py

Each 8×8 image is cut into 2×2 patches: 16 patches plus the [CLS] token per image.
"""

from libai_zoo.config import LazyCall, get_config
from libai_zoo.data import DigitsDataset
from libai_zoo.models import ViTConfig, ViTForImageClassification

train = get_config("common/train.py").train
dist = get_config("common/train.py").dist
optim = get_config("common/optim.py").optim

model = LazyCall(ViTForImageClassification)(
    config=LazyCall(ViTConfig)(image_size=8, patch_size=2, num_channels=1, num_labels=10, hidden_size=64,
                               num_hidden_layers=4, num_attention_heads=4, intermediate_size=256,
                               hidden_dropout_prob=0.1))

dataloader = dict(
    train=LazyCall(DigitsDataset)(path="data/digits/digits.csv.gz", split="train"),
    test=LazyCall(DigitsDataset)(path="data/digits/digits.csv.gz", split="valid"),
)

optim.lr = 2e-3
optim.weight_decay = 0.05

train.update(
    output_dir="output/vit_classification",
    max_iter=1500,
    micro_batch_size=64,
    global_batch_size=64,
    log_period=50,
    checkpoint=dict(period=0),
    eval=dict(period=500, max_batches=None),
    best_metric="accuracy",
    scheduler=LazyCall("libai_zoo.optim.WarmupCosineLR")(warmup_iters=100),
)
