"""libai_zoo.data and the shipped data/: sampler order and resumption, token packing and its cache,
the tokenizer, the word-order classification task and the digits."""

from __future__ import annotations

import gzip
import itertools
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from libai_zoo.data import (
    DigitsDataset,
    MicroBatchSampler,
    PackedTokenDataset,
    build_gpt_dataset,
    build_text_classification_dataset,
    gpt_dataset,
    load_tokenizer,
    read_documents,
)

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = ROOT / "data" / "tokenizer"
CORPUS, CORPUS_VALID = ROOT / "data" / "corpus" / "python_docs.txt", ROOT / "data" / "corpus" / "python_docs_valid.txt"
DIGITS = ROOT / "data" / "digits" / "digits.csv.gz"
SPECIAL = {"<|endoftext|>": 0, "[PAD]": 1, "[CLS]": 2, "[SEP]": 3, "[MASK]": 4, "[UNK]": 5}


def take(sampler: MicroBatchSampler, n: int) -> list[list[int]]:
    return list(itertools.islice(iter(sampler), n))


# ------------------------------------------------------------------------------------------ sampler
def test_sampler_ranks_split_each_global_chunk():
    ranks = [MicroBatchSampler(20, 3, dp_rank=r, dp_size=2, seed=7) for r in range(2)]
    order = ranks[0].epoch_order(0)
    assert len(order) == 18  # 20 // 6 chunks of 6; the last 2 of the permutation are dropped
    for step, (a, b) in enumerate(zip(take(ranks[0], 3), take(ranks[1], 3))):
        assert len(a) == len(b) == 3 and not set(a) & set(b)
        assert a + b == order[step * 6: (step + 1) * 6].tolist()  # rank r holds the r-th slice


def test_sampler_sees_every_index_once_per_epoch_across_two_ranks():
    ranks = [MicroBatchSampler(24, 3, dp_rank=r, dp_size=2, seed=1) for r in range(2)]
    epochs = [take(s, 8) for s in ranks]  # 24 samples / (3 x 2) = 4 steps an epoch: two epochs
    for epoch in range(2):
        seen = [i for rank in epochs for batch in rank[epoch * 4: (epoch + 1) * 4] for i in batch]
        assert sorted(seen) == list(range(24))
    first = [i for rank in epochs for batch in rank[:4] for i in batch]
    second = [i for rank in epochs for batch in rank[4:] for i in batch]
    assert first != second  # reshuffled
    assert ranks[0].consumed_samples == ranks[1].consumed_samples == 8 * 6


def test_sampler_is_deterministic_and_reshuffles_each_epoch():
    assert take(MicroBatchSampler(50, 4, seed=3), 30) == take(MicroBatchSampler(50, 4, seed=3), 30)
    assert take(MicroBatchSampler(50, 4, seed=3), 5) != take(MicroBatchSampler(50, 4, seed=4), 5)
    sampler = MicroBatchSampler(50, 4, seed=3)
    orders = [sampler.epoch_order(e).tolist() for e in range(3)]
    assert all(len(o) == 48 and len(set(o)) == 48 for o in orders)
    assert orders[0] != orders[1] != orders[2]
    assert orders[1] == torch.randperm(50, generator=torch.Generator().manual_seed(4))[:48].tolist()  # seed + epoch


def test_sampler_without_shuffle_is_identity_order():
    sampler = MicroBatchSampler(10, 2, dp_rank=1, dp_size=2, shuffle=False)
    assert take(sampler, 3) == [[2, 3], [6, 7], [2, 3]]  # 8 of 10 per epoch; epoch 1 starts over


def test_sampler_drop_last_false_pads_the_last_chunk_from_the_epoch_start():
    ranks = [MicroBatchSampler(10, 2, dp_rank=r, dp_size=2, shuffle=False, drop_last=False) for r in range(2)]
    batches = [take(s, 4) for s in ranks]
    assert batches[0] == [[0, 1], [4, 5], [8, 9], [0, 1]]
    assert batches[1] == [[2, 3], [6, 7], [0, 1], [2, 3]]
    assert ranks[0].samples_per_epoch == 12


@pytest.mark.parametrize("done", [1, 4, 7, 9])  # 4 steps an epoch: 4 and 7/9 resume into later epochs
def test_sampler_resumes_at_the_exact_next_sample(done):
    for rank in range(2):
        uninterrupted = take(MicroBatchSampler(26, 3, dp_rank=rank, dp_size=2, seed=5), 12)
        resumed = MicroBatchSampler(26, 3, dp_rank=rank, dp_size=2, seed=5, consumed_samples=done * 6)
        assert resumed.epoch == done // 4
        assert take(resumed, 12 - done) == uninterrupted[done:]


def test_sampler_state_dict_round_trip_and_dataloader():
    sampler = MicroBatchSampler(30, 4, dp_rank=1, dp_size=2, seed=11)
    loader = DataLoader(TensorDataset(torch.arange(30) * 10), batch_sampler=sampler)
    stream = iter(loader)
    got = [next(stream)[0].tolist() for _ in range(5)]
    assert all(len(b) == 4 for b in got)
    state = sampler.state_dict()
    assert state["consumed_samples"] == 5 * 8 and state["epoch"] == 1 and state["seed"] == 11
    following = [next(stream)[0].tolist() for _ in range(4)]

    fresh = MicroBatchSampler(30, 4, dp_rank=1, dp_size=2, seed=11)
    fresh.load_state_dict(state)
    assert [[10 * i for i in b] for b in take(fresh, 4)] == following
    with pytest.raises(ValueError, match="seed=11"):
        MicroBatchSampler(30, 4, dp_rank=1, dp_size=2, seed=12).load_state_dict(state)
    with pytest.raises(ValueError, match="multiple of"):
        MicroBatchSampler(30, 4, consumed_samples=6)


def test_sampler_rejects_a_dataset_smaller_than_one_step():
    with pytest.raises(ValueError, match=r"5 samples, fewer than one step needs \(micro_batch_size 3 x dp_size 2"):
        MicroBatchSampler(5, 3, dp_size=2)
    with pytest.raises(ValueError, match="dp_rank 2"):
        MicroBatchSampler(100, 3, dp_rank=2, dp_size=2)


# ------------------------------------------------------------------------------------ GPT datasets
@pytest.mark.parametrize("tokens", [np.arange(11, dtype=np.uint16), torch.arange(11)])
def test_packed_token_dataset(tokens):
    dataset = PackedTokenDataset(tokens, seq_len=4)
    assert len(dataset) == 2  # 11 // 4: the last 3 tokens are left out
    item = dataset[1]
    assert item["input_ids"].dtype == torch.long and item["input_ids"].tolist() == [4, 5, 6, 7]
    assert torch.equal(item["labels"], item["input_ids"])
    assert dataset[-1]["input_ids"].tolist() == [4, 5, 6, 7]
    batch = next(iter(DataLoader(dataset, batch_size=2)))
    assert batch["input_ids"].shape == batch["labels"].shape == (2, 4)
    with pytest.raises(IndexError):
        dataset[2]
    with pytest.raises(ValueError, match="fewer than one sample"):
        PackedTokenDataset(tokens[:3], seq_len=4)


def test_build_gpt_dataset_puts_eos_after_each_document_and_reuses_its_cache(tmp_path, monkeypatch):
    text = tmp_path / "docs.txt"
    text.write_text("Return the sum of a and b.\n\n  Open the file  \n \n\nClose it. Naïve café.\n")
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    expected = [t for d in ["Return the sum of a and b.", "Open the file", "Close it. Naïve café."]
                for t in tokenizer(d)["input_ids"] + [0]]

    dataset = build_gpt_dataset(str(text), str(TOKENIZER), seq_len=3, cache_dir=str(tmp_path / "cache"))
    assert dataset.tokens.tolist() == expected and dataset.tokens.dtype == np.uint16
    assert len(dataset) == len(expected) // 3 and dataset[1]["input_ids"].tolist() == expected[3:6]
    (cache,) = (tmp_path / "cache").glob("docs-*.npy")
    assert np.load(cache).tolist() == expected

    def no_tokenizing(*args, **kwargs):
        raise AssertionError("the cached stream should have been used")

    monkeypatch.setattr(gpt_dataset, "_tokenize_documents", no_tokenizing)
    again = build_gpt_dataset(str(text), str(TOKENIZER), seq_len=5, cache_dir=str(tmp_path / "cache"))
    assert np.asarray(again.tokens).tolist() == expected and len(again) == len(expected) // 5
    text.write_text("Other text.\n")  # another file content: another cache entry, tokenized again
    with pytest.raises(AssertionError, match="cached stream"):
        build_gpt_dataset(str(text), str(TOKENIZER), seq_len=2, cache_dir=str(tmp_path / "cache"))


def test_build_gpt_dataset_names_what_is_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="no text file"):
        build_gpt_dataset(str(tmp_path / "missing.txt"), str(TOKENIZER), seq_len=8)
    (tmp_path / "t.txt").write_text("Some words here.\n")
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        build_gpt_dataset(str(tmp_path / "t.txt"), str(tmp_path), seq_len=8)


# --------------------------------------------------------------------------------------- tokenizer
def test_shipped_tokenizer_loads_offline_and_round_trips():
    paragraph = ("Return a new list containing all items from the iterable in ascending order.\n\n"
                 "  A custom key function can be supplied;\tthe reverse flag sorts descending. Ünïcödé — 42€ ")
    for cls in (AutoTokenizer, PreTrainedTokenizerFast):
        tokenizer = cls.from_pretrained(TOKENIZER)
        assert len(tokenizer) == 8192
        assert {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL} == SPECIAL
        assert tokenizer.eos_token_id == tokenizer.bos_token_id == 0 and tokenizer.pad_token_id == 1
        assert (tokenizer.cls_token, tokenizer.sep_token, tokenizer.mask_token, tokenizer.unk_token) == \
            ("[CLS]", "[SEP]", "[MASK]", "[UNK]")
        ids = tokenizer(paragraph)["input_ids"]
        assert 2 not in ids and 0 not in ids  # GPT-style: encoding adds no special token
        assert tokenizer.decode(ids) == paragraph
    bert = load_tokenizer(TOKENIZER, bert=True)
    pair = bert("a b", "c")
    assert pair["input_ids"][0] == 2 and pair["input_ids"][-1] == 3 and pair["input_ids"].count(3) == 2
    assert bert("a b", return_token_type_ids=True)["token_type_ids"] == [0, 0, 0, 0]


def test_shipped_corpus_has_documents_and_a_disjoint_held_out_split():
    train, valid = read_documents(CORPUS), read_documents(CORPUS_VALID)
    assert len(train) > 5000 and 100 <= len(valid) <= 120
    assert all("\n" not in d and len(d.split()) >= 5 for d in train[:500])
    assert not set(valid) & set(train)


# ----------------------------------------------------------------------------- text classification
def test_text_classification_dataset_is_balanced_deterministic_and_bert_encoded():
    dataset = build_text_classification_dataset(str(CORPUS_VALID), str(TOKENIZER), max_length=64, seed=3)
    assert set(dataset.column_names) == {"input_ids", "attention_mask", "token_type_ids", "labels"}
    n = len(dataset)
    assert n > 300
    rows = dataset[:]
    assert rows["input_ids"].shape == rows["attention_mask"].shape == rows["token_type_ids"].shape == (n, 64)
    assert rows["labels"].shape == (n,) and rows["labels"].dtype == torch.long
    assert abs(int(rows["labels"].sum()) * 2 - n) <= 1
    assert (rows["input_ids"][:, 0] == SPECIAL["[CLS]"]).all() and (rows["token_type_ids"] == 0).all()
    lengths = rows["attention_mask"].sum(1)
    assert (rows["input_ids"][torch.arange(n), lengths - 1] == SPECIAL["[SEP]"]).all()
    assert (rows["input_ids"][rows["attention_mask"] == 0] == SPECIAL["[PAD]"]).all()

    again = build_text_classification_dataset(str(CORPUS_VALID), str(TOKENIZER), max_length=64, seed=3)[:]
    assert torch.equal(again["input_ids"], rows["input_ids"]) and torch.equal(again["labels"], rows["labels"])
    other = build_text_classification_dataset(str(CORPUS_VALID), str(TOKENIZER), max_length=64, seed=4)[:]
    assert not torch.equal(other["input_ids"], rows["input_ids"])

    # Label 1 is text as written (found in a document), label 0 its words reordered (not found).
    tokenizer = load_tokenizer(TOKENIZER)
    corpus = " ".join(" ".join(d.split()) for d in read_documents(CORPUS_VALID))
    whole = (lengths < 64).nonzero().flatten()[:60]  # untruncated rows
    found: dict[int, list[bool]] = {0: [], 1: []}
    for i in whole:
        text = tokenizer.decode(rows["input_ids"][i], skip_special_tokens=True)
        found[int(rows["labels"][i])].append(text in corpus)
    assert len(found[0]) > 20 and len(found[1]) > 20
    assert all(found[1]) and not any(found[0])

    small = build_text_classification_dataset(str(CORPUS_VALID), str(TOKENIZER), max_length=16, num_samples=10)
    assert len(small) == 10 and small[:]["labels"].sum() == 5 and small[0]["input_ids"].shape == (16,)


# ------------------------------------------------------------------------------------------ digits
def test_digits_splits_shapes_and_normalisation():
    train, valid = DigitsDataset(str(DIGITS), "train"), DigitsDataset(str(DIGITS), "valid")
    assert (len(train), len(valid)) == (1438, 359)
    assert sorted(train.indices.tolist() + valid.indices.tolist()) == list(range(1797))
    item = train[0]
    assert item["pixel_values"].shape == (1, 8, 8) and item["pixel_values"].dtype == torch.float32
    assert item["labels"].shape == () and item["labels"].dtype == torch.long
    assert set(train.labels.tolist()) == set(valid.labels.tolist()) == set(range(10))
    assert abs(train.pixel_values.mean().item()) < 1e-5 and abs(train.pixel_values.std().item() - 1) < 1e-5
    assert (valid.mean, valid.std) == (train.mean, train.std)  # valid uses the train statistics

    with gzip.open(DIGITS, "rt") as f:
        raw = np.loadtxt(f, delimiter=",")
    row = raw[int(valid.indices[3])]
    expected = (torch.tensor(row[:64], dtype=torch.float32).reshape(1, 8, 8) / 16 - train.mean) / train.std
    assert torch.allclose(valid[3]["pixel_values"], expected, atol=1e-6) and valid[3]["labels"] == int(row[64])

    again = DigitsDataset(split="valid")  # the default path resolves inside the checkout
    assert torch.equal(again.indices, valid.indices) and torch.equal(again.pixel_values, valid.pixel_values)
    assert not torch.equal(DigitsDataset(str(DIGITS), "valid", seed=1).indices, valid.indices)

    big = DigitsDataset(str(DIGITS), "train", image_size=16)
    batch = next(iter(DataLoader(big, batch_size=4)))
    assert batch["pixel_values"].shape == (4, 1, 16, 16) and batch["labels"].shape == (4,)
    assert abs(big.pixel_values.mean().item()) < 1e-5 and abs(big.pixel_values.std().item() - 1) < 1e-5
    with pytest.raises(ValueError, match="split must be one of"):
        DigitsDataset(str(DIGITS), "test")
