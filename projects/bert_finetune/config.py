"""Fine-tune a Hugging Face BERT directory for sequence classification: is a window of corpus
text in its natural word order, or shuffled? (data/corpus, via `datasets`).

    python tools/make_tiny_hf_model.py bert output/tiny_bert     # a stand-in: the hub is offline here
    python tools/train.py projects/bert_finetune/config.py
    python tools/train.py projects/bert_finetune/config.py model.path=/path/to/bert \
        train.output_dir=output/bert_finetune_yours                  # your own

A new classification head is initialised (strict=False) and the best checkpoint by validation
accuracy is kept as output_dir/model_best.
"""

from libai_zoo.config import LazyCall, get_config
from libai_zoo.data import build_text_classification_dataset

train = get_config("common/train.py").train
dist = get_config("common/train.py").dist
optim = get_config("common/optim.py").optim

model = LazyCall("libai_zoo.models.AutoModelForSequenceClassification.from_pretrained")(
    path="output/tiny_bert", dtype="float32", strict=False, num_labels=2)

dataloader = dict(
    train=LazyCall(build_text_classification_dataset)(text_file="data/corpus/python_docs.txt",
                                                      tokenizer_dir="data/tokenizer", max_length=48, seed=0),
    test=LazyCall(build_text_classification_dataset)(text_file="data/corpus/python_docs_valid.txt",
                                                     tokenizer_dir="data/tokenizer", max_length=48, seed=0),
)

optim.lr = 5e-4

train.update(
    output_dir="output/bert_finetune",
    max_iter=400,
    micro_batch_size=32,
    global_batch_size=32,
    log_period=50,
    checkpoint=dict(period=0),
    eval=dict(period=100, max_batches=None),
    best_metric="accuracy",
    scheduler=LazyCall("libai_zoo.optim.WarmupLinearLR")(warmup_iters=40),
)
