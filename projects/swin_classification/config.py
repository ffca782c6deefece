"""Train a small Swin Transformer from scratch on the UCI handwritten digits (8×8 grey images, 10
classes), with vit_classification's data and training.

    python tools/train.py projects/swin_classification/config.py
    torchrun --nproc_per_node=2 tools/train.py projects/swin_classification/config.py dist.pp=2 \
        train.micro_batch_size=32 train.output_dir=output/swin_classification_pp2   # a stage of each width
    python tools/train.py projects/swin_classification/config.py 'model=${models.swinv2}' \
        train.output_dir=output/swinv2_classification        # Swin V2: cosine attention, continuous bias

Each image is cut into 1×1 patches (an 8×8 map of 32 channels) attended in 4×4 windows, shifted
every second block; patch merging halves the map to 4×4 of 64 channels for the second stage (one
window). A stage per pipeline stage at pp2.
"""

from libai_zoo.config import LazyCall
from libai_zoo.models import SwinConfig, SwinForImageClassification, Swinv2Config, Swinv2ForImageClassification

from ..vit_classification.config import dataloader, dist, optim, train  # noqa: F401  (config keys)

sizes = dict(image_size=8, patch_size=1, num_channels=1, num_labels=10, embed_dim=32, depths=[2, 2],
             num_heads=[2, 4], window_size=4, mlp_ratio=2.0, drop_path_rate=0.1)
models = dict(swin=LazyCall(SwinForImageClassification)(config=LazyCall(SwinConfig)(**sizes)),
              swinv2=LazyCall(Swinv2ForImageClassification)(config=LazyCall(Swinv2Config)(**sizes)))
model = models["swin"]

train.output_dir = "output/swin_classification"
