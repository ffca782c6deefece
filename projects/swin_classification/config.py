"""Train a small Swin Transformer from scratch on the UCI handwritten digits (8×8 grey images, 10
classes), next to ViT's recipe.

    python tools/train.py projects/swin_classification/config.py
    torchrun --nproc_per_node=2 tools/train.py projects/swin_classification/config.py dist.pp=2 \
        train.micro_batch_size=32 train.output_dir=output/swin_classification_pp2   # a stage of each width
    python tools/train.py projects/swin_classification/config.py 'model=${models.swinv2}' \
        train.output_dir=output/swinv2_classification        # Swin V2: cosine attention, continuous bias

Each image is cut into 1×1 patches (an 8×8 map of 32 channels) attended in 4×4 windows, shifted
every second block; patch merging halves the map to 4×4 of 64 channels for the second stage (one
window). A stage per pipeline stage at pp2.
"""

from libai_zoo.config import LazyCall, get_config
from libai_zoo.data import DigitsDataset
from libai_zoo.models import SwinConfig, SwinForImageClassification, Swinv2Config, Swinv2ForImageClassification

train = get_config("common/train.py").train
dist = get_config("common/train.py").dist
optim = get_config("common/optim.py").optim

sizes = dict(image_size=8, patch_size=1, num_channels=1, num_labels=10, embed_dim=32, depths=[2, 2],
             num_heads=[2, 4], window_size=4, mlp_ratio=2.0, drop_path_rate=0.1)
models = dict(swin=LazyCall(SwinForImageClassification)(config=LazyCall(SwinConfig)(**sizes)),
              swinv2=LazyCall(Swinv2ForImageClassification)(config=LazyCall(Swinv2Config)(**sizes)))
model = models["swin"]

dataloader = dict(
    train=LazyCall(DigitsDataset)(path="data/digits/digits.csv.gz", split="train"),
    test=LazyCall(DigitsDataset)(path="data/digits/digits.csv.gz", split="valid"),
)

optim.lr = 2e-3
optim.weight_decay = 0.05

train.update(
    output_dir="output/swin_classification",
    max_iter=1500,
    micro_batch_size=64,
    global_batch_size=64,
    log_period=50,
    checkpoint=dict(period=0),
    eval=dict(period=500, max_batches=None),
    best_metric="accuracy",
    scheduler=LazyCall("libai_zoo.optim.WarmupCosineLR")(warmup_iters=100),
)
