"""Sequence-to-sequence fine-tuning data from conversations: each assistant reply is a target, the
conversation before it the source (an encoder-decoder's input), as LiBai's Couplets pairs lines.

    train = build_seq2seq_dataset("data/chat/python_docs_chat.jsonl", "data/tokenizer", source_length=128,
                                  target_length=32)
    train[0]  # {"input_ids", "attention_mask": LongTensor[128], "labels": LongTensor[32]}

The source is the earlier turns' texts (system prompts left out), one per line, cut to
source_length − 1 tokens and ended by eos; the target is the reply cut to target_length − 1 tokens
and ended by eos. Both are right-padded: the source with the pad token (attention_mask 0), the
labels with IGNORE_INDEX, so the model's right shift of the labels gives the decoder's inputs.
Tokenizing runs in `Dataset.map`, cached by `datasets` beside the source's own cache files.
"""

from __future__ import annotations

import datasets

from .chat_dataset import IGNORE_INDEX, MAP_BATCH
from .hf_source import load_source, require_columns
from .tokenizer import load_tokenizer


def build_seq2seq_dataset(path: str, tokenizer_dir: str, source_length: int, target_length: int, *,
                          messages_column: str = "messages", split: str = "train", num_proc: int | None = None,
                          **load_kwargs) -> datasets.Dataset:
    """The (conversation so far, assistant reply) pairs of `path` (see `load_source`) as a
    torch-formatted `datasets.Dataset`; see the module docstring."""
    if source_length < 2 or target_length < 2:
        raise ValueError(f"source_length = {source_length} and target_length = {target_length} must leave a token "
                         f"besides eos: give at least 2 each")
    tokenizer = load_tokenizer(tokenizer_dir)
    if tokenizer.eos_token_id is None or tokenizer.pad_token_id is None:
        raise ValueError(f"{tokenizer_dir} needs an eos_token and a pad_token in tokenizer_config.json")
    source = load_source(path, split=split, **load_kwargs)
    require_columns(source, [messages_column], path, argument="messages_column")
    pairs = source.map(_pairs, batched=True, batch_size=MAP_BATCH, num_proc=num_proc,
                       remove_columns=source.column_names, desc="tokenizing replies and their sources",
                       fn_kwargs=dict(tokenizer=tokenizer, column=messages_column, source_length=source_length,
                                      target_length=target_length))
    if not len(pairs):
        raise ValueError(f"no conversation of {path} has an assistant reply after another turn: check the roles "
                         f"in {messages_column!r}")
    pairs.info.description = f"{path} (replies, tokenized with {tokenizer_dir})"  # names it in check_dataset
    pairs.seq_len = source_length
    return pairs.with_format("torch", columns=["input_ids", "attention_mask", "labels"])


def _pairs(batch: dict, *, tokenizer, column: str, source_length: int, target_length: int) -> dict:
    """Dataset.map: conversations -> one padded (source, target) pair per assistant reply."""
    sources, targets = [], []
    for messages in batch[column]:
        turns = [m for m in messages if m["role"] != "system"]
        for i, message in enumerate(turns):
            if message["role"] == "assistant" and i:
                sources.append("\n".join(m["content"] for m in turns[:i]))
                targets.append(message["content"])
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    encode = dict(add_special_tokens=False)
    source_ids = [ids[:source_length - 1] + [eos] for ids in tokenizer(sources, **encode)["input_ids"]] if sources else []
    target_ids = [ids[:target_length - 1] + [eos] for ids in tokenizer(targets, **encode)["input_ids"]] if targets else []
    return {"input_ids": [ids + [pad] * (source_length - len(ids)) for ids in source_ids],
            "attention_mask": [[1] * len(ids) + [0] * (source_length - len(ids)) for ids in source_ids],
            "labels": [ids + [IGNORE_INDEX] * (target_length - len(ids)) for ids in target_ids]}
