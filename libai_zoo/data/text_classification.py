"""A binary sentence-classification task made from a text corpus: is this word order natural?

    train = build_text_classification_dataset("data/corpus/python_docs.txt", "data/tokenizer", max_length=64)
    valid = build_text_classification_dataset("data/corpus/python_docs_valid.txt", "data/tokenizer", max_length=64)
    train[0]  # {"input_ids", "attention_mask", "token_type_ids": LongTensor[64], "labels": LongTensor[]}

Each document is cut into consecutive windows of MIN_WORDS..MAX_WORDS words. Label 1: the window
as written; label 0: the same window with its words shuffled. A window appears once, under one of
the two labels, so a model cannot solve it by recognising the bag of words; the two classes are
the same size (one apart when the count is odd). Texts are encoded as [CLS] text [SEP] through
`load_tokenizer(..., bert=True)`, padded and truncated to max_length.
"""

from __future__ import annotations

import random

from datasets import Dataset, DatasetInfo

from .documents import read_documents
from .tokenizer import load_tokenizer

MIN_WORDS, MAX_WORDS = 8, 30


def word_windows(documents: list[str], rng: random.Random) -> list[list[str]]:
    """Consecutive windows of each document's words, MIN_WORDS..MAX_WORDS long (lengths drawn from
    rng); a document's tail shorter than MIN_WORDS and windows of one repeated word (no shuffle can
    change them) are dropped."""
    windows = []
    for document in documents:
        words = document.split()
        start = 0
        while len(words) - start >= MIN_WORDS:
            size = rng.randint(MIN_WORDS, MAX_WORDS)
            window = words[start: start + size]
            if len(set(window)) > 1:
                windows.append(window)
            start += size
    return windows


def build_text_classification_dataset(text_file: str, tokenizer_dir: str, max_length: int, seed: int = 0,
                                      num_samples: int | None = None) -> Dataset:
    """The word-order task over `text_file`'s documents (blank-line separated), as a torch-formatted
    `datasets.Dataset` with columns input_ids, attention_mask, token_type_ids, labels; the same
    arguments give the same samples in the same order. `num_samples` keeps that many (all windows
    by default)."""
    if max_length < 3:
        raise ValueError(f"max_length {max_length} leaves no room for text between [CLS] and [SEP]")
    tokenizer = load_tokenizer(tokenizer_dir, bert=True)
    rng = random.Random(seed)
    windows = word_windows(read_documents(text_file), rng)
    rng.shuffle(windows)
    if num_samples is not None:
        if not 0 < num_samples <= len(windows):
            raise ValueError(f"num_samples {num_samples} is not in [1, {len(windows)}], the windows {text_file} "
                             f"gives; ask for fewer samples or use a larger text file")
        windows = windows[:num_samples]

    texts, labels = [], []
    for i, words in enumerate(windows):
        label = 1 - i % 2  # alternate: balanced classes whatever the count
        if label == 0:
            shuffled = words[:]
            while shuffled == words:  # the windows hold two different words at least: this ends
                rng.shuffle(shuffled)
            words = shuffled
        texts.append(" ".join(words))
        labels.append(label)

    def encode(batch: dict) -> dict:
        return tokenizer(batch["text"], padding="max_length", truncation=True, max_length=max_length,
                         return_token_type_ids=True, return_attention_mask=True)

    # The description names the data in check_dataset's errors.
    info = DatasetInfo(description=f"{text_file} (tokenized with {tokenizer_dir})")
    dataset = Dataset.from_dict({"text": texts, "labels": labels}, info=info)
    dataset = dataset.map(encode, batched=True, remove_columns=["text"])
    return dataset.with_format("torch", columns=["input_ids", "attention_mask", "token_type_ids", "labels"])
