"""Chat data for supervised fine-tuning: each conversation rendered by a chat template, the loss on
the assistant's tokens only, and several conversations packed into one sample.

    train = build_chat_dataset("data/chat/python_docs_chat.jsonl", "data/tokenizer", max_length=512,
                               chat_template=TEMPLATE)
    train[0]  # pack=True:  {"input_ids", "position_ids", "shift_labels": LongTensor[512]}
              # pack=False: {"input_ids", "attention_mask", "labels": LongTensor[512]}

The source is anything `load_source` reads; each row's ``messages_column`` holds a conversation,
``[{"role": "user", "content": ...}, {"role": "assistant", "content": ...}, ...]``.

Labels: a token is a target where the assistant speaks (its message as the template renders it,
end-of-turn token included), IGNORE_INDEX elsewhere. A template with ``{% generation %}`` markers
around the assistant's text gets them from transformers (``return_assistant_tokens_mask``); any
other template by rendering prefixes: the assistant's i-th message spans the characters between
the conversation before it rendered with the generation prompt and the conversation through it,
and the tokens overlapping that span are its tokens (the rule transformers applies to the markers).
That needs no marker and no assumption on how tokens fall at the boundaries, only that the
template renders a conversation's beginning as the start of the whole (checked; a template that
rewrites earlier turns is refused, naming the fix).

Packing (``pack=True``, the default): whole conversations in order, greedily, as many as fit in
max_length; ``position_ids`` restart at 0 for each, and the samples carry no attention_mask, which
is how transformers (and the zoo's causal LMs) recognise packed sequences and keep attention inside
each conversation. Targets are ``shift_labels``, shifted within each conversation, so its last
token is not scored against the next conversation's first. The tail is padding (pad id, position
ids restarting at 0, IGNORE_INDEX). ``pack=False``: one conversation per sample, right-padded, with
attention_mask and ``labels`` (the model shifts them).

A conversation longer than max_length is cut to it (one warning counts them); one left without
an assistant token is dropped (it would score nothing). Tokenizing runs in `Dataset.map` (batched,
``num_proc`` processes), cached by `datasets` beside the source's own cache files.
"""

from __future__ import annotations

import logging
import re

import datasets
from transformers import PreTrainedTokenizerBase

from .hf_source import load_source, require_columns
from .tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100  # a target the loss skips (transformers' convention; libai_zoo.models.IGNORE_INDEX)
GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")
MAP_BATCH = 1000  # conversations per Dataset.map batch; packing starts a new sample at each (and each shard)


def build_chat_dataset(path: str, tokenizer_dir: str, max_length: int, *, messages_column: str = "messages",
                       pack: bool = True, chat_template: str | None = None, split: str = "train",
                       name: str | None = None, data_files=None, num_proc: int | None = None,
                       **load_kwargs) -> datasets.Dataset:
    """The conversations of `path` (see `load_source`) as a torch-formatted `datasets.Dataset` of
    max_length-token samples: packed (input_ids, position_ids, shift_labels) or, with
    ``pack=False``, one per sample (input_ids, attention_mask, labels); see the module docstring.
    `chat_template` (Jinja) replaces the tokenizer's own."""
    if max_length < 2:
        raise ValueError(f"max_length = {max_length} leaves no token to predict: give at least 2")
    if load_kwargs.get("streaming"):
        raise ValueError("build_chat_dataset packs a map-style dataset (cached by datasets), not a stream: leave "
                         "streaming out")
    tokenizer = load_tokenizer(tokenizer_dir)
    template = chat_template or tokenizer.chat_template
    if not template:
        raise ValueError(f"{tokenizer_dir} has no chat template: pass chat_template=... (a Jinja template, e.g. "
                         f"the one projects/llama_sft/config.py ships)")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad_id is None:
        raise ValueError(f"{tokenizer_dir} names no pad_token or eos_token in tokenizer_config.json: set one")
    source = load_source(path, name=name, split=split, data_files=data_files, **load_kwargs)
    require_columns(source, [messages_column], path, argument="messages_column")
    tokenized = source.map(_tokenize, batched=True, batch_size=MAP_BATCH, num_proc=num_proc,
                           remove_columns=source.column_names, desc="rendering and tokenizing conversations",
                           fn_kwargs=dict(tokenizer=tokenizer, chat_template=template, column=messages_column,
                                          max_length=max_length))
    kept = tokenized.filter(_has_targets, batched=True, batch_size=MAP_BATCH, num_proc=num_proc,
                            input_columns="labels", desc="dropping conversations without assistant tokens")
    _report(tokenized, kept, path, max_length)
    if not len(kept):
        raise ValueError(f"no conversation of {path} has an assistant message within max_length = {max_length} "
                         f"tokens: check the roles in {messages_column!r} or raise max_length")
    if pack:
        # one process: packing is cheap, and shards of num_proc would cut the packing differently
        samples = kept.map(_pack, batched=True, batch_size=MAP_BATCH,
                           remove_columns=kept.column_names, desc="packing conversations",
                           fn_kwargs=dict(max_length=max_length, pad_id=pad_id))
        columns = ["input_ids", "position_ids", "shift_labels"]
    else:
        samples = kept.map(_pad, batched=True, batch_size=MAP_BATCH, num_proc=num_proc,
                           remove_columns=kept.column_names, desc="padding conversations",
                           fn_kwargs=dict(max_length=max_length, pad_id=pad_id))
        columns = ["input_ids", "attention_mask", "labels"]
    samples.info.description = f"{path} (chat, tokenized with {tokenizer_dir})"  # names it in check_dataset
    return samples.with_format("torch", columns=columns)


def assistant_labels(tokenizer: PreTrainedTokenizerBase, conversations: list[list[dict]],
                     chat_template: str) -> tuple[list[list[int]], list[list[int]]]:
    """(input_ids, labels) of each conversation rendered whole: labels hold the token id where the
    assistant speaks and IGNORE_INDEX elsewhere (unshifted). By the template's ``{% generation %}``
    markers when it has them, else by rendering prefixes (module docstring)."""
    if GENERATION_MARKER.search(chat_template):
        encoded = tokenizer.apply_chat_template(conversations, chat_template=chat_template, return_dict=True,
                                                return_assistant_tokens_mask=True)
        masks = encoded["assistant_masks"]
    else:
        texts, spans = zip(*(_assistant_spans(tokenizer, messages, chat_template) for messages in conversations))
        encoded = tokenizer(list(texts), add_special_tokens=False, return_offsets_mapping=True)
        masks = [[any(start < end_char and end > start_char for start_char, end_char in conversation)
                  for start, end in offsets] for offsets, conversation in zip(encoded["offset_mapping"], spans)]
    ids = encoded["input_ids"]
    return ids, [[token if assistant else IGNORE_INDEX for token, assistant in zip(row, mask)]
                 for row, mask in zip(ids, masks)]


def _assistant_spans(tokenizer: PreTrainedTokenizerBase, messages: list[dict],
                     chat_template: str) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character span of each assistant message in it, found by
    rendering the conversation up to that message."""
    def render(part: list[dict], prompt: bool = False) -> str:
        return tokenizer.apply_chat_template(part, chat_template=chat_template, tokenize=False,
                                             add_generation_prompt=prompt)

    text, spans = render(messages), []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        if i == 0:
            raise ValueError("a conversation starts with the assistant, whose turn header cannot be rendered "
                             "alone: mark the assistant's text in the chat template with {% generation %}...{% "
                             "endgeneration %}, or start the conversation with a system or user message")
        before, through = render(messages[:i], prompt=True), render(messages[:i + 1])
        if not (text.startswith(before) and text.startswith(through)):
            raise ValueError(f"the chat template renders the first {i + 1} messages of a conversation differently "
                             f"from the start of the whole conversation, so the assistant's tokens cannot be found "
                             f"by rendering prefixes: mark the assistant's text in the template with "
                             f"{{% generation %}}...{{% endgeneration %}}")
        spans.append((len(before), len(through)))
    return text, spans


def _tokenize(batch: dict, *, tokenizer: PreTrainedTokenizerBase, chat_template: str, column: str,
              max_length: int) -> dict:
    """Dataset.map: conversations -> input_ids, labels (unshifted) cut to max_length, truncated."""
    ids, labels = assistant_labels(tokenizer, batch[column], chat_template)
    return {"input_ids": [row[:max_length] for row in ids], "labels": [row[:max_length] for row in labels],
            "truncated": [len(row) > max_length for row in ids]}


def _has_targets(labels: list[list[int]]) -> list[bool]:
    """Dataset.filter: whether a conversation scores a token (position 0 is never predicted)."""
    return [any(label != IGNORE_INDEX for label in row[1:]) for row in labels]


def _report(tokenized: datasets.Dataset, kept: datasets.Dataset, path: str, max_length: int) -> None:
    """One warning counting the conversations cut to max_length and those dropped for want of targets."""
    truncated = sum(tokenized["truncated"])
    dropped = len(tokenized) - len(kept)
    if truncated or dropped:
        logger.warning("%s: %d of %d conversations are longer than max_length = %d tokens and were truncated; "
                       "%d were dropped for holding no assistant token (within max_length): raise max_length to "
                       "keep them whole", path, truncated, len(tokenized), max_length, dropped)


def pack_greedily(lengths: list[int], max_length: int) -> list[list[int]]:
    """Indices of the conversations in each packed sample: in order, a new sample whenever the next
    conversation does not fit in what is left (every length is at most max_length)."""
    groups, used = [], max_length
    for index, length in enumerate(lengths):
        if used + length > max_length:
            groups.append([])
            used = 0
        groups[-1].append(index)
        used += length
    return groups


def _pack(batch: dict, *, max_length: int, pad_id: int) -> dict:
    """Dataset.map: conversations -> packed samples (position ids restart, targets shifted within each)."""
    samples = {"input_ids": [], "position_ids": [], "shift_labels": []}
    for group in pack_greedily([len(row) for row in batch["input_ids"]], max_length):
        ids = [token for i in group for token in batch["input_ids"][i]]
        positions = [position for i in group for position in range(len(batch["input_ids"][i]))]
        targets = [label for i in group for label in batch["labels"][i][1:] + [IGNORE_INDEX]]
        tail = max_length - len(ids)
        samples["input_ids"].append(ids + [pad_id] * tail)
        samples["position_ids"].append(positions + list(range(tail)))
        samples["shift_labels"].append(targets + [IGNORE_INDEX] * tail)
    return samples


def _pad(batch: dict, *, max_length: int, pad_id: int) -> dict:
    """Dataset.map: one conversation per sample, right-padded, with attention_mask and labels."""
    tails = [max_length - len(row) for row in batch["input_ids"]]
    return {"input_ids": [row + [pad_id] * tail for row, tail in zip(batch["input_ids"], tails)],
            "attention_mask": [[1] * (max_length - tail) + [0] * tail for tail in tails],
            "labels": [row + [IGNORE_INDEX] * tail for row, tail in zip(batch["labels"], tails)]}
