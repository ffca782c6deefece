"""Megatron-format indexed data: tools/preprocess_data.py, the MMIDIDX reader/writer checked against the
format itself, GPT windows (coverage, blending, cached indices, resumption), masked-LM samples, the
errors for damaged files, and the background Prefetcher."""

from __future__ import annotations

import importlib.util
import itertools
import struct
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from datasets import Dataset as HFDataset
from torch.utils.data import DataLoader, Dataset

from libai_zoo.data import (
    BlendedDataset,
    IndexedDataset,
    IndexedDatasetWriter,
    MicroBatchSampler,
    Prefetcher,
    blending,
    build_indexed_gpt_dataset,
    build_indexed_mlm_dataset,
    gpt_indexed_dataset,
    load_tokenizer,
    read_documents,
)

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = ROOT / "data" / "tokenizer"
EOD, PAD, CLS, SEP, MASK = 0, 1, 2, 3, 4
DOCUMENTS = ["Return the sum of a and b.", "Open the file\nand read it.", "Close it. Naïve café — 42€.",
             "A list is a mutable sequence.", "x", "Dictionaries map keys to values; keys are hashable."]


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("preprocess_data", ROOT / "tools" / "preprocess_data.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["preprocess_data"] = module  # worker processes find encode() by this name
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("preprocess_data", None)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(TOKENIZER)


def expected_tokens(tokenizer, documents):
    return [ids + [EOD] for ids in tokenizer(documents, add_special_tokens=False)["input_ids"]]


def write(prefix, documents, dtype=np.uint16):
    with IndexedDatasetWriter(prefix, dtype) as writer:
        for document in documents:
            writer.add_document(document)
    return str(prefix)


def position_stream(tmp_path, lengths, name="positions", base=0):
    """An indexed dataset whose token values are their stream positions (+ base), one document each length."""
    starts = np.concatenate([[0], np.cumsum(lengths)])
    return write(tmp_path / name, [np.arange(starts[i], starts[i + 1]) + base for i in range(len(lengths))])


# ---------------------------------------------------------------------------------- preprocess tool
def test_preprocess_text_round_trips_and_is_independent_of_workers(tmp_path, tool, tokenizer):
    text = tmp_path / "docs.txt"
    text.write_text("\n\n".join(DOCUMENTS[:3]) + "\n \n\n" + "\n\n\n".join(DOCUMENTS[3:]) + "\n")
    assert read_documents(text) == DOCUMENTS
    results = [tool.main(["--input", str(text), "--tokenizer", str(TOKENIZER), "--output-prefix",
                          str(tmp_path / f"w{workers}"), "--workers", str(workers), "--chunk-size", "2", "--quiet"])
               for workers in (1, 2)]
    assert [r["prefix"] for r in results] == [str(tmp_path / "w1_text_document"), str(tmp_path / "w2_text_document")]
    for suffix in (".bin", ".idx"):
        assert Path(results[0]["prefix"] + suffix).read_bytes() == Path(results[1]["prefix"] + suffix).read_bytes()

    data = IndexedDataset(results[0]["prefix"])
    expected = expected_tokens(tokenizer, DOCUMENTS)
    assert data.dtype == np.uint16 and len(data) == data.num_documents == len(DOCUMENTS)
    assert [data[i].tolist() for i in range(len(data))] == expected
    assert data.document_indices.tolist() == list(range(len(DOCUMENTS) + 1))
    assert results[0]["tokens"] == sum(map(len, expected)) == data.num_tokens
    assert data.get(1, 2, 3).tolist() == expected[1][2:5] and data[-1].tolist() == expected[-1]

    lines = tool.main(["--input", str(text), "--split-lines", "--no-append-eod", "--tokenizer", str(TOKENIZER),
                       "--output-prefix", str(tmp_path / "lines"), "--quiet"])
    by_line = [line.strip() for line in text.read_text().splitlines() if line.strip()]
    assert lines["documents"] == len(by_line) == len(DOCUMENTS) + 1  # "Open the file" / "and read it."
    assert [IndexedDataset(lines["prefix"])[i].tolist() for i in range(len(by_line))] == \
        tokenizer(by_line, add_special_tokens=False)["input_ids"]


def test_preprocess_json_lines_and_parquet(tmp_path, tool, tokenizer):
    rows = HFDataset.from_dict({"content": DOCUMENTS + [""], "id": list(range(len(DOCUMENTS) + 1))})
    rows.to_json(tmp_path / "docs.jsonl")
    rows.to_parquet(tmp_path / "docs.parquet")
    expected = expected_tokens(tokenizer, DOCUMENTS)
    for name in ("docs.jsonl", "docs.parquet"):
        result = tool.main(["--input", str(tmp_path / name), "--json-key", "content", "--tokenizer", str(TOKENIZER),
                            "--output-prefix", str(tmp_path / name.replace(".", "_")), "--workers", "2", "--quiet"])
        assert result["prefix"].endswith("_content_document") and result["skipped"] == 1  # the empty text
        data = IndexedDataset(result["prefix"])
        assert [data[i].tolist() for i in range(len(data))] == expected
    with pytest.raises(SystemExit, match="has no field 'text'.*--json-key"):
        tool.main(["--input", str(tmp_path / "docs.jsonl"), "--tokenizer", str(TOKENIZER),
                   "--output-prefix", str(tmp_path / "bad"), "--quiet"])
    assert not list(tmp_path.glob("bad*"))  # nothing half-written is left
    with pytest.raises(SystemExit, match="cannot tell the format"):
        tool.main(["--input", str(tmp_path / "docs.csv"), "--tokenizer", str(TOKENIZER), "--output-prefix", "x"])


def test_preprocess_help_explains_every_flag(tool, capsys):
    with pytest.raises(SystemExit):
        tool.parse_args(["--help"])
    out = capsys.readouterr().out
    for flag in ("--input ", "--input-format", "--split-lines", "--json-key", "--tokenizer", "--output-prefix",
                 "--workers", "--chunk-size", "--append-eod", "--no-append-eod", "--dtype", "--quiet"):
        assert flag in out


# ------------------------------------------------------------------------ the MMIDIDX format itself
def test_index_bytes_follow_the_megatron_layout(tmp_path):
    documents = [[5, 6, 7], [8], [9, 10, 11, 12, 65535]]
    prefix = tmp_path / "fmt"
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        writer.add_document(documents[0])
        writer.add_document(documents[1])
        writer.add_document(documents[2], sequence_lengths=[2, 3])  # two "sentences"
    raw = (tmp_path / "fmt.idx").read_bytes()
    # Parsed from the specification, not with the reader.
    assert raw[:9] == b"MMIDIDX\x00\x00"
    version, code, sequences, documents_plus_one = struct.unpack_from("<QBQQ", raw, 9)
    assert (version, code, sequences, documents_plus_one) == (1, 8, 4, 4)  # 8 = uint16
    offset = 9 + 8 + 1 + 8 + 8
    lengths = struct.unpack_from("<4i", raw, offset)
    pointers = struct.unpack_from("<4q", raw, offset + 16)
    doc_idx = struct.unpack_from("<4q", raw, offset + 16 + 32)
    assert len(raw) == offset + 16 + 32 + 32
    assert lengths == (3, 1, 2, 3) and pointers == (0, 6, 8, 12) and doc_idx == (0, 1, 2, 4)
    assert (tmp_path / "fmt.bin").read_bytes() == np.array(sum(documents, []), dtype="<u2").tobytes()

    int32 = write(tmp_path / "wide", [[70000, 1]], np.int32)
    assert struct.unpack_from("<B", Path(int32 + ".idx").read_bytes(), 17) == (4,)
    with pytest.raises(ValueError, match="do not fit uint16.*int32"):
        write(tmp_path / "narrow", [[70000]])


def test_reader_reads_an_index_built_by_hand(tmp_path):
    """An int32 file with two documents (the second of two sequences) and a gap in .bin the pointers skip."""
    tokens = [np.array([100, 101, 102], "<i4"), np.array([7], "<i4"), np.array([-5, 2**31 - 1], "<i4")]
    gap = b"\xff" * 8
    (tmp_path / "hand.bin").write_bytes(tokens[0].tobytes() + gap + tokens[1].tobytes() + tokens[2].tobytes())
    header = b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", 4) + struct.pack("<Q", 3) + \
        struct.pack("<Q", 3)
    index = header + np.array([3, 1, 2], "<i4").tobytes() + np.array([0, 20, 24], "<i8").tobytes() + \
        np.array([0, 1, 3], "<i8").tobytes()
    (tmp_path / "hand.idx").write_bytes(index)

    data = IndexedDataset(tmp_path / "hand")
    assert data.dtype == np.int32 and len(data) == 3 and data.num_documents == 2
    assert [data[i].tolist() for i in range(3)] == [t.tolist() for t in tokens]
    assert data.sequence_lengths.tolist() == [3, 1, 2] and data.document_indices.tolist() == [0, 1, 3]
    assert data.get(0, 1).tolist() == [101, 102] and data.gather([2, 0], [1, 2]).tolist() == [2**31 - 1, 102]
    # The GPT windows follow the pointers across the gap: the stream is 100 101 102 7 -5 2147483647.
    windows = build_indexed_gpt_dataset(str(tmp_path / "hand"), seq_len=2, shuffle=False)
    assert [windows.window(i).tolist() for i in range(len(windows))] == [[100, 101, 102], [102, 7, -5]]
    with pytest.raises(IndexError, match="outside sequence 1"):
        data.get(1, 0, 2)


def test_damaged_or_missing_files_are_named(tmp_path):
    prefix = write(tmp_path / "ok", [[1, 2, 3], [4, 5]])
    idx, bin_ = Path(prefix + ".idx"), Path(prefix + ".bin")
    good_idx, good_bin = idx.read_bytes(), bin_.read_bytes()

    bin_.write_bytes(good_bin[:-2])
    with pytest.raises(ValueError, match=rf"{bin_}.* is truncated: its size is 8 bytes, smaller .* \(10 bytes"):
        IndexedDataset(prefix)
    bin_.write_bytes(good_bin)
    idx.write_bytes(b"TNTIDX\x00\x00" + good_idx[8:])
    with pytest.raises(ValueError, match=rf"{idx} is not a Megatron MMIDIDX index \(magic"):
        IndexedDataset(prefix)
    idx.write_bytes(good_idx[:9] + struct.pack("<Q", 2) + good_idx[17:])
    with pytest.raises(ValueError, match=rf"{idx} has MMIDIDX version 2"):
        IndexedDataset(prefix)
    idx.write_bytes(good_idx[:17] + b"\x09" + good_idx[18:])
    with pytest.raises(ValueError, match=rf"{idx} has token dtype code 9"):
        IndexedDataset(prefix)
    idx.write_bytes(good_idx[:-4])
    with pytest.raises(ValueError, match=rf"{idx} is truncated"):
        IndexedDataset(prefix)
    idx.write_bytes(good_idx)
    assert IndexedDataset(prefix)[1].tolist() == [4, 5]
    bin_.unlink()
    with pytest.raises(FileNotFoundError, match=rf"no token data file {bin_}"):
        build_indexed_gpt_dataset([prefix], seq_len=2)
    with pytest.raises(FileNotFoundError, match=rf"no index file {tmp_path / 'missing.idx'}.*prefix"):
        IndexedDataset(tmp_path / "missing")


# -------------------------------------------------------------------------------------- GPT samples
@pytest.mark.parametrize("shuffle", [False, True])
def test_gpt_windows_cover_every_token_once_per_epoch(tmp_path, shuffle):
    lengths = [7, 1, 13, 0, 20, 3, 9]  # 53 tokens across document boundaries, one empty document
    dataset = build_indexed_gpt_dataset([position_stream(tmp_path, lengths)], seq_len=5, seed=3, shuffle=shuffle,
                                        num_samples=25)
    per_epoch = (53 - 1) // 5
    assert dataset.samples_per_epoch == per_epoch == 10 and len(dataset) == 25
    for epoch in range(2):
        targets, starts = [], []
        for i in range(epoch * per_epoch, (epoch + 1) * per_epoch):
            item = dataset[i]
            assert item["input_ids"].dtype == item["shift_labels"].dtype == torch.long
            window = torch.cat([item["input_ids"], item["shift_labels"][-1:]])
            assert torch.equal(item["shift_labels"], window[1:]) and len(window) == 6
            assert window.tolist() == list(range(int(window[0]), int(window[0]) + 6))  # consecutive stream tokens
            targets += item["shift_labels"].tolist()
            starts.append(int(window[0]))
        assert sorted(targets) == list(range(1, per_epoch * 5 + 1))  # each once; the 2-token tail is left out
        assert (starts == sorted(starts)) != shuffle
    orders = [[int(dataset[i]["input_ids"][0]) for i in range(e * 10, e * 10 + 10)] for e in range(2)]
    assert (orders[0] != orders[1]) == shuffle  # a new permutation each epoch
    longer = build_indexed_gpt_dataset([position_stream(tmp_path, lengths)], seq_len=5, seed=3, shuffle=shuffle,
                                       num_samples=40)
    assert all(torch.equal(longer[i]["input_ids"], dataset[i]["input_ids"]) for i in range(25))
    with pytest.raises(ValueError, match="fewer than one sample"):
        build_indexed_gpt_dataset([position_stream(tmp_path, [4], "short")], seq_len=4)


def test_blended_gpt_dataset_follows_the_weights(tmp_path):
    prefixes = [position_stream(tmp_path, [300 + 50 * d], f"d{d}", base=1000 * d) for d in range(3)]
    weights = [5, 3, 2]
    dataset = build_indexed_gpt_dataset(prefixes, weights, seq_len=8, seed=1, num_samples=200)
    assert isinstance(dataset, BlendedDataset) and len(dataset) == 200
    which = np.asarray(dataset.dataset_index)
    for n in (1, 7, 50, 123, 200):
        counts = np.bincount(which[:n], minlength=3)
        assert np.all(np.abs(counts - np.array([0.5, 0.3, 0.2]) * n) <= 1), (n, counts)
    for i in range(0, 200, 7):  # each sample comes from the dataset the index names
        assert int(dataset[i]["input_ids"][0]) // 1000 == which[i]
    # Dataset 0 has 299 // 8 = 37 windows per epoch and gives 100 samples: almost three epochs.
    first = [int(dataset.datasets[0][i]["input_ids"][0]) for i in range(37)]
    assert sorted(first) == list(range(0, 37 * 8, 8))
    default = build_indexed_gpt_dataset(prefixes, seq_len=8)
    assert len(default) == 37 + 43 + 49  # one epoch of each


def test_gpt_indices_are_cached_and_reused(tmp_path, monkeypatch):
    prefixes = [position_stream(tmp_path, [40, 60], "a"), position_stream(tmp_path, [90], "b", base=500)]
    cache = tmp_path / "cache"
    first = build_indexed_gpt_dataset(prefixes, [0.4, 0.6], seq_len=4, seed=2, num_samples=30, cache_dir=str(cache))
    files = sorted(p.name for p in cache.glob("*.npy"))
    assert len(files) == 5  # a sample and a shuffle index per dataset, one blending index
    assert any(name.startswith("a-gpt-sample-index-") for name in files) and any("blend" in n for n in files)
    mtimes = {p: p.stat().st_mtime_ns for p in cache.glob("*.npy")}

    def recomputed(*args, **kwargs):
        raise AssertionError("the cached index should have been used")

    for name in ("build_sample_index", "build_shuffle_index"):
        monkeypatch.setattr(gpt_indexed_dataset, name, recomputed)
    monkeypatch.setattr(blending, "build_blending_indices", recomputed)
    again = build_indexed_gpt_dataset(prefixes, [0.4, 0.6], seq_len=4, seed=2, num_samples=30, cache_dir=str(cache))
    assert all(torch.equal(first[i]["input_ids"], again[i]["input_ids"]) for i in range(30))
    assert {p: p.stat().st_mtime_ns for p in cache.glob("*.npy")} == mtimes
    with pytest.raises(AssertionError, match="cached index"):  # another seed is another shuffle
        build_indexed_gpt_dataset(prefixes, [0.4, 0.6], seq_len=4, seed=3, num_samples=30, cache_dir=str(cache))


def test_resumed_loader_continues_at_the_exact_sample(tmp_path):
    dataset = build_indexed_gpt_dataset([position_stream(tmp_path, [50, 80, 31])], seq_len=6, seed=4)

    def batches(consumed, n, rank):
        sampler = MicroBatchSampler(len(dataset), 2, dp_rank=rank, dp_size=2, seed=9, consumed_samples=consumed)
        loader = DataLoader(dataset, batch_sampler=sampler)
        return [b["input_ids"] for b in itertools.islice(loader, n)]

    for rank in range(2):
        uninterrupted = batches(0, 14, rank)  # 26 samples, 6 steps an epoch: into the third epoch
        resumed = batches(5 * 4, 9, rank)
        assert all(torch.equal(a, b) for a, b in zip(uninterrupted[5:], resumed, strict=True))


# ---------------------------------------------------------------------------------------- masked LM
def test_mlm_masking_statistics_specials_and_determinism(tmp_path):
    rng = np.random.default_rng(0)
    documents = []
    for _ in range(120):
        doc = rng.integers(6, 8192, size=int(rng.integers(5, 300)))
        doc[rng.random(len(doc)) < 0.03] = PAD  # special tokens inside a document are never selected
        documents.append(np.append(doc, EOD))
    prefix = write(tmp_path / "mlm", documents)
    dataset = build_indexed_mlm_dataset([prefix], 64, str(TOKENIZER), seed=5)
    windows = sum(-(-(len(d) - 1) // 62) for d in documents)
    assert len(dataset) == windows

    items = [dataset[i] for i in range(len(dataset))]
    batch = {key: torch.stack([item[key] for item in items]) for key in items[0]}
    ids, mask, labels = batch["input_ids"], batch["attention_mask"], batch["labels"]
    assert ids.shape == labels.shape == batch["token_type_ids"].shape == (windows, 64)
    assert (ids[:, 0] == CLS).all() and (batch["token_type_ids"] == 0).all()
    lengths = mask.sum(1)
    assert (ids[torch.arange(windows), lengths - 1] == SEP).all() and (ids[mask == 0] == PAD).all()
    assert (mask[:, :-1] >= mask[:, 1:]).all()  # ones, then zeros

    original = torch.where(labels != -100, labels, ids)
    restored, row = [], 0
    for document in documents:  # the windows give back each document without its eod
        tokens = []
        while len(tokens) < len(document) - 1:
            tokens += original[row, 1: lengths[row] - 1].tolist()
            row += 1
        restored.append(tokens)
    assert restored == [d[:-1].tolist() for d in documents]

    content = torch.zeros_like(mask, dtype=torch.bool)
    content[mask.bool()] = True
    content[:, 0] = False
    content[torch.arange(windows), lengths - 1] = False
    eligible = content & (original >= 6)
    selected = labels != -100
    assert not (selected & ~eligible).any()  # [CLS], [SEP], [PAD] and specials inside are never labelled
    assert (ids[content & ~eligible] == original[content & ~eligible]).all()
    rate = selected.sum().item() / eligible.sum().item()
    assert 0.14 < rate < 0.165, rate
    n = selected.sum().item()
    masked = (ids[selected] == MASK).sum().item() / n
    kept = (ids[selected] == original[selected]).sum().item() / n
    assert abs(masked - 0.8) < 0.03 and abs(kept - 0.1) < 0.025 and abs(1 - masked - kept - 0.1) < 0.025
    assert (ids[selected & (ids != MASK) & (ids != original)] >= 6).all()  # random tokens are never special

    fresh = build_indexed_mlm_dataset([prefix], 64, str(TOKENIZER), seed=5)
    for i in reversed(range(0, windows, 5)):  # the same samples, drawn in another order
        assert all(torch.equal(fresh[i][key], items[i][key]) for key in items[i])
    other = build_indexed_mlm_dataset([prefix], 64, str(TOKENIZER), seed=6)
    assert not torch.equal(other[0]["input_ids"], items[0]["input_ids"]) or \
        not torch.equal(other[1]["input_ids"], items[1]["input_ids"])
    blended = build_indexed_mlm_dataset([prefix, prefix], 64, str(TOKENIZER), seed=5, weights=[1, 1],
                                        num_samples=3 * windows)
    assert torch.equal(blended[0]["labels"], items[0]["labels"])
    assert torch.equal(blended[2 * windows]["attention_mask"], items[0]["attention_mask"])  # the 2nd epoch


# ---------------------------------------------------------------------------------------- prefetch
class Numbers(Dataset):
    def __init__(self, n, fail_at=None):
        self.n, self.fail_at = n, fail_at

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == self.fail_at:
            raise RuntimeError(f"sample {i} is broken")
        return {"x": torch.tensor(i)}


def test_prefetcher_yields_the_loader_batches_in_order_and_stops():
    loader = DataLoader(Numbers(20), batch_size=3)
    expected = [b["x"].tolist() for b in loader]
    prefetcher = Prefetcher(loader, depth=2)
    assert len(prefetcher) == 7
    assert [b["x"].tolist() for b in prefetcher] == expected
    assert [b["x"].tolist() for b in prefetcher] == expected  # iterable again

    def endless():  # the trainer's loaders never end: the sampler yields forever
        return DataLoader(Numbers(30), batch_sampler=MicroBatchSampler(30, 4, seed=0))

    with Prefetcher(endless(), depth=3) as batches:
        got = [b["x"].tolist() for b in itertools.islice(batches, 12)]
        thread = batches._thread
    assert got == [b["x"].tolist() for b in itertools.islice(endless(), 12)]
    assert not thread.is_alive()

    stream = iter(Prefetcher(itertools.count(), depth=1))
    assert next(stream) == 0
    stream.close()  # a dropped iteration stops its thread too
    deadline = time.time() + 5
    while any(t.name == "libai_zoo-prefetch" for t in threading.enumerate()) and time.time() < deadline:
        time.sleep(0.01)
    assert not any(t.name == "libai_zoo-prefetch" for t in threading.enumerate())


def test_prefetcher_raises_the_loader_error_after_the_good_batches():
    loader = DataLoader(Numbers(12, fail_at=7), batch_size=2, num_workers=1)
    got = []
    with pytest.raises(RuntimeError, match="sample 7 is broken"):
        for batch in Prefetcher(loader):
            got.append(batch["x"].tolist())
    assert got == [[0, 1], [2, 3], [4, 5]]
