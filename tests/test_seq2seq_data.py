"""Encoder-decoder data: T5's span corruption (lengths, sentinels, the window recovered from input
and target, a sample fixed by its index) and reply pairs from conversations; ids past a model's
vocabulary, in inputs or targets, are refused before training."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from libai_zoo.data import build_seq2seq_dataset, build_span_corruption_dataset, check_dataset, sentinel_tokenizer
from libai_zoo.data.span_corruption import corrupted_lengths, noise_mask, raw_length_for

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = str(ROOT / "data" / "tokenizer")
CORPUS = str(ROOT / "data" / "corpus" / "python_docs_valid.txt")
CHAT = str(ROOT / "data" / "chat" / "python_docs_chat_valid.jsonl")


@pytest.fixture(scope="module")
def corrupted(tmp_path_factory):
    return build_span_corruption_dataset(CORPUS, TOKENIZER, 64, cache_dir=str(tmp_path_factory.mktemp("cache")))


def test_lengths_follow_t5s_rule():
    # 141 tokens -> 21 hidden in 7 spans: 120 kept + 7 sentinels + eos = 128 inputs, 21 + 7 + 1 = 29 targets
    assert raw_length_for(128, 0.15, 3.0) == 141
    assert corrupted_lengths(141, 0.15, 3.0) == (21, 7, 128)
    mask = noise_mask(141, 21, 7, np.random.default_rng(0))
    starts = mask & ~np.concatenate(([False], mask[:-1]))
    assert mask.sum() == 21 and starts.sum() == 7 and not mask[0]


def test_a_window_is_its_input_with_each_sentinel_replaced_by_the_targets_span(corrupted):
    tokenizer = sentinel_tokenizer(TOKENIZER)
    sentinels = tokenizer.convert_tokens_to_ids([f"<extra_id_{k}>" for k in range(100)])
    assert sentinels == list(range(len(tokenizer) - 1, len(tokenizer) - 101, -1))  # <extra_id_0> the largest
    for index in (0, 7, len(corrupted) - 1):
        sample = corrupted[index]
        inputs, targets = sample["input_ids"].tolist(), sample["labels"].tolist()
        assert len(inputs) == 64 and len(targets) == corrupted.target_length, index
        assert inputs[-1] == targets[-1] == tokenizer.eos_token_id
        spans, current = {}, None
        for token in targets[:-1]:
            if token in sentinels:
                current = spans.setdefault(token, [])
            else:
                current.append(token)
        assert list(spans) == sentinels[:corrupted.spans]  # numbered in order
        rebuilt = [t for token in inputs[:-1] for t in (spans[token] if token in spans else [token])]
        assert rebuilt == corrupted.windows[index]["input_ids"].tolist(), index
        assert torch.equal(corrupted[index]["input_ids"], sample["input_ids"])  # fixed by (seed, index)
    assert not torch.equal(corrupted[0]["labels"], corrupted[1]["labels"])


def test_reply_pairs_end_in_eos_and_pad_the_labels_with_ignore_index():
    pairs = build_seq2seq_dataset(CHAT, TOKENIZER, source_length=48, target_length=16)
    tokenizer = sentinel_tokenizer(TOKENIZER)
    sample = pairs[0]
    mask, labels = sample["attention_mask"].bool(), sample["labels"]
    assert sample["input_ids"].shape == (48,) and labels.shape == (16,)
    assert sample["input_ids"][mask][-1] == tokenizer.eos_token_id
    assert (sample["input_ids"][~mask] == tokenizer.pad_token_id).all()
    kept = labels[labels != -100]
    assert kept[-1] == tokenizer.eos_token_id and (labels[len(kept):] == -100).all()
    # the third conversation: a docstring and a question on it; its target quotes the summary line
    third = pairs[2]
    source = tokenizer.decode(third["input_ids"][third["attention_mask"].bool()], skip_special_tokens=True)
    target = tokenizer.decode(third["labels"][third["labels"] >= 0], skip_special_tokens=True)
    assert source.startswith("Compute an Adler-32 checksum of data.") and source.endswith("sums it up?")
    assert source.startswith(target), (source, target)


def test_ids_past_the_vocabulary_are_refused_in_inputs_and_targets(corrupted):
    with pytest.raises(ValueError, match="sentinels"):
        check_dataset(corrupted, vocab_size=8192, max_positions=None)  # no room for <extra_id_N>
    check_dataset(corrupted, vocab_size=8292, max_positions=None)
    pairs = build_seq2seq_dataset(CHAT, TOKENIZER, source_length=48, target_length=16)
    small_inputs = pairs.map(lambda row: {"input_ids": [min(t, 5) for t in row["input_ids"]]})
    with pytest.raises(ValueError, match="the labels of"):
        check_dataset(small_inputs, vocab_size=6, max_positions=None)
