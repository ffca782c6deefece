"""Fine-tune the pretrained tiny T5 to answer questions about docstrings (sequence to sequence: the
conversation so far in, the reply out), LiBai's Couplets in spirit.

    python tools/train.py projects/t5_pretrain/config.py                     # pretrain it first (2 min)
    python tools/convert zoo-to-hf output/t5_pretrain output/t5_pretrained    # its newest checkpoint, as transformers'
    python tools/train.py projects/t5_finetune/config.py
"""

from libai_zoo.config import LazyCall
from libai_zoo.data import build_seq2seq_dataset, sentinel_tokenizer
from libai_zoo.engine import GenerateSample

from ..llama_finetune.config import dist, optim, train  # noqa: F401  (config keys: its training, 300 steps)

model = LazyCall("libai_zoo.models.AutoModelForSeq2SeqLM.from_pretrained")(path="output/t5_pretrained",
                                                                         dtype="float32")

replies = dict(tokenizer_dir="data/tokenizer", source_length=128, target_length=32)
dataloader = dict(
    train=LazyCall(build_seq2seq_dataset)(path="data/chat/python_docs_chat.jsonl", **replies),
    test=LazyCall(build_seq2seq_dataset)(path="data/chat/python_docs_chat_valid.jsonl", **replies),
    num_workers=0,
)

train.output_dir = "output/t5_finetune"

# After training, the model answers a held-out question.
hooks = [LazyCall(GenerateSample)(
    tokenizer=LazyCall(sentinel_tokenizer)(tokenizer_dir="data/tokenizer"),
    prompt="What is the one-line summary of this docstring?\n\nReturn a new set with elements common to the set "
           "and all others. Each argument may be any iterable.",
    max_new_tokens=24)]
