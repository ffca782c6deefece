"""Fine-tune a Hugging Face Llama directory at 8,192 tokens per sequence with context parallelism:
each sequence split over two ranks (dist.cp=2), which all-gather each layer's keys and values.

    python tools/make_tiny_hf_model.py llama output/tiny_llama   # a stand-in: the hub is offline here
    torchrun --nproc_per_node=2 tools/train.py projects/long_context/config.py
    python tools/train.py projects/long_context/config.py dist.cp=1 \
        train.output_dir=output/long_context_cp1       # the same run in one process

Each rank holds 4,096 of every sample's 8,192 tokens (chunks r and 3 − r of four: the causal
attention's work balanced), so its activations are about half of a one-process run's; ZeRO would
shard the parameters over dp × cp. The tokenizer must be the model's own: data/tokenizer for the
stand-in (vocabulary 8192).
"""

from libai_zoo.config import LazyCall, get_config
from libai_zoo.data import build_gpt_dataset

train = get_config("common/train.py").train
dist = get_config("common/train.py").dist
optim = get_config("common/optim.py").optim

model = LazyCall("libai_zoo.models.AutoModelForCausalLM.from_pretrained")(path="output/tiny_llama", dtype="float32")

SEQ_LEN = 8192
dataloader = dict(
    train=LazyCall(build_gpt_dataset)(text_file="data/corpus/python_docs.txt", tokenizer_dir="data/tokenizer",
                                      seq_len=SEQ_LEN, cache_dir="output/cache"),
    test=LazyCall(build_gpt_dataset)(text_file="data/corpus/python_docs_valid.txt", tokenizer_dir="data/tokenizer",
                                     seq_len=SEQ_LEN, cache_dir="output/cache"),
    num_workers=0,
)

dist.cp = 2

optim.lr = 1e-3
optim.betas = (0.9, 0.95)

train.update(
    output_dir="output/long_context",
    max_iter=20,
    micro_batch_size=1,
    global_batch_size=2,
    log_period=5,
    checkpoint=dict(period=0),
    eval=dict(period=20, max_batches=None),
    scheduler=LazyCall("libai_zoo.optim.WarmupCosineLR")(warmup_iters=4, min_lr_ratio=0.1),
)
