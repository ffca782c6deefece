"""Fine-tune a Hugging Face Llama directory as a causal language model on the shipped corpus.

    python tools/make_tiny_hf_model.py llama output/tiny_llama   # a stand-in: the hub is offline here
    python tools/train.py projects/llama_finetune/config.py
    torchrun --nproc_per_node=2 tools/train.py projects/llama_finetune/config.py dist.tp=2 \
        train.output_dir=output/llama_finetune_tp2

The tokenizer must be the model's own: data/tokenizer for the stand-in (vocabulary 8192).
"""

from libai_zoo.config import LazyCall, get_config
from libai_zoo.engine import GenerateSample

from ..common.corpus_lm_data import dataloader  # noqa: F401  (a config key)

train = get_config("common/train.py").train
dist = get_config("common/train.py").dist
optim = get_config("common/optim.py").optim

model = LazyCall("libai_zoo.models.AutoModelForCausalLM.from_pretrained")(path="output/tiny_llama", dtype="float32")

optim.lr = 1e-3
optim.betas = (0.9, 0.95)

train.update(
    output_dir="output/llama_finetune",
    max_iter=300,
    micro_batch_size=16,
    global_batch_size=16,
    log_period=25,
    checkpoint=dict(period=150),
    eval=dict(period=150, max_batches=None),
    scheduler=LazyCall("libai_zoo.optim.WarmupCosineLR")(warmup_iters=30, min_lr_ratio=0.1),
)

hooks = [LazyCall(GenerateSample)(tokenizer="data/tokenizer", prompt="Return the", max_new_tokens=30)]
