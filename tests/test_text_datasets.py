"""build_text_dataset: pre-training windows from any `datasets` source, map-style (cached, packed
exactly as tokenizing by hand) and streaming (endless, resumable at the exact next window); the
trainer reads both, and a resumed run logs the losses of an uninterrupted one."""

from __future__ import annotations

import io
import itertools
import json
from pathlib import Path

import datasets
import numpy as np
import pandas as pd
import pytest
import torch
from omegaconf import OmegaConf
from torch.utils.data import DataLoader

from libai_zoo.config import LazyConfig
from libai_zoo.data import (
    MicroBatchSampler,
    PackedTextStream,
    build_text_dataset,
    check_dataset,
    load_tokenizer,
    read_documents,
    stream_micro_batches,
    text_dataset,
)
from libai_zoo.engine import default_trainer
from support.recipes import saved_recipe
from trainer_runs import losses, run_trainer

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = str(ROOT / "data" / "tokenizer")
SEQ_LEN = 16


def by_hand(texts: list[str | None], seq_len: int) -> np.ndarray:
    """Every non-empty text's token ids and eos, concatenated, cut into whole windows."""
    tokenizer = load_tokenizer(TOKENIZER)
    stream = [i for text in texts if text for i in tokenizer(text, add_special_tokens=False)["input_ids"] + [0]]
    return np.asarray(stream[: len(stream) // seq_len * seq_len]).reshape(-1, seq_len)


def windows(dataset) -> np.ndarray:
    return np.stack([sample["input_ids"].numpy() for sample in dataset])


@pytest.fixture(scope="module")
def texts() -> list[str | None]:
    documents = read_documents(str(ROOT / "data" / "corpus" / "python_docs.txt"))[:40]
    return documents[:5] + [None] + documents[5:]  # an empty row is skipped


@pytest.fixture(scope="module")
def sources(texts, tmp_path_factory) -> dict[str, Path]:
    """The same documents as jsonl, parquet, csv and a save_to_disk directory."""
    root = tmp_path_factory.mktemp("sources")
    rows = [{"text": text, "id": i} for i, text in enumerate(texts)]
    with open(root / "corpus.jsonl", "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    pd.DataFrame(rows).to_parquet(root / "corpus.parquet")
    pd.DataFrame(rows).to_csv(root / "corpus.csv", index=False)
    datasets.Dataset.from_list(rows).save_to_disk(str(root / "saved"))
    return {"jsonl": root / "corpus.jsonl", "parquet": root / "corpus.parquet", "csv": root / "corpus.csv",
            "saved": root / "saved"}


# --------------------------------------------------------------------------------------- map-style
@pytest.mark.parametrize("kind", ["jsonl", "parquet", "csv", "saved"])
def test_every_source_gives_the_windows_of_the_text_tokenized_by_hand(kind, sources, texts, tmp_path):
    dataset = build_text_dataset(str(sources[kind]), TOKENIZER, SEQ_LEN, cache_dir=str(tmp_path))
    expected = by_hand(texts, SEQ_LEN)
    assert len(dataset) == len(expected) > 100
    np.testing.assert_array_equal(windows(dataset), expected)
    batch = dataset[[3, 4]]
    assert batch["input_ids"].dtype == torch.long and torch.equal(batch["labels"], batch["input_ids"])
    assert all(Path(f["filename"]).parent == tmp_path for f in dataset.cache_files)


def test_num_proc_2_gives_the_same_windows(sources, texts, tmp_path, monkeypatch):
    monkeypatch.setattr(text_dataset, "TOKENIZE_BATCH", 7)  # windows that span map batches and the two shards
    dataset = build_text_dataset(str(sources["jsonl"]), TOKENIZER, SEQ_LEN, num_proc=2, cache_dir=str(tmp_path))
    assert len(dataset.cache_files) == 2  # one file per process
    np.testing.assert_array_equal(windows(dataset), by_hand(texts, SEQ_LEN))


def test_a_second_call_reads_the_cache_instead_of_tokenizing(sources, texts, tmp_path, monkeypatch):
    calls = []

    def counted(batch, **kwargs):
        calls.append(len(batch["text"]))
        return tokenize(batch, **kwargs)

    tokenize = text_dataset._tokenize
    monkeypatch.setattr(text_dataset, "_tokenize", counted)
    path = str(sources["jsonl"])
    first = build_text_dataset(path, TOKENIZER, SEQ_LEN, cache_dir=str(tmp_path))
    assert sum(calls) == len(texts)
    calls.clear()
    again = build_text_dataset(path, TOKENIZER, SEQ_LEN, cache_dir=str(tmp_path))
    assert calls == [] and again.cache_files == first.cache_files
    longer = build_text_dataset(path, TOKENIZER, 2 * SEQ_LEN, cache_dir=str(tmp_path))  # re-packs, no tokenizing
    assert calls == [] and longer.cache_files != first.cache_files
    np.testing.assert_array_equal(windows(longer), by_hand(texts, 2 * SEQ_LEN))


def test_the_sampler_resumes_the_dataset_at_the_exact_next_samples(sources, tmp_path):
    dataset = build_text_dataset(str(sources["parquet"]), TOKENIZER, SEQ_LEN, cache_dir=str(tmp_path))

    def batches(rank: int, consumed: int, n: int) -> list[torch.Tensor]:
        sampler = MicroBatchSampler(len(dataset), 3, dp_rank=rank, dp_size=2, seed=5, consumed_samples=consumed)
        return [b["input_ids"] for b in itertools.islice(DataLoader(dataset, batch_sampler=sampler), n)]

    for rank in range(2):
        uninterrupted = batches(rank, 0, 50)  # 50 chunks of 6: the second epoch starts at chunk 42
        for done in (17, 40, 45):
            resumed = batches(rank, done * 6, 50 - done)
            assert all(torch.equal(a, b) for a, b in zip(uninterrupted[done:], resumed, strict=True))


# --------------------------------------------------------------------------------------- streaming
@pytest.mark.parametrize("kind", ["jsonl", "parquet", "csv", "saved"])
def test_a_stream_packs_alike_and_goes_on_across_epochs(kind, sources, texts):
    stream = build_text_dataset(str(sources[kind]), TOKENIZER, SEQ_LEN, streaming=True)
    assert isinstance(stream, PackedTextStream)
    two_epochs = by_hand(texts + texts, SEQ_LEN)  # leftover tokens of epoch 0 open epoch 1's first window
    np.testing.assert_array_equal(windows(itertools.islice(stream, len(two_epochs))), two_epochs)
    assert stream.state_dict()["epoch"] == 1


def test_the_stream_resumes_at_the_exact_next_window(sources, texts):
    path = str(sources["jsonl"])
    per_epoch = len(by_hand(texts, SEQ_LEN))
    reference = windows(itertools.islice(build_text_dataset(path, TOKENIZER, SEQ_LEN, streaming=True),
                                         2 * per_epoch + 5))
    for done in (0, 1, 37, per_epoch - 1, per_epoch, per_epoch + 1, 2 * per_epoch - 1):
        stream = build_text_dataset(path, TOKENIZER, SEQ_LEN, streaming=True)
        samples = iter(stream)
        for _ in range(done):
            next(samples)
        state = torch.load(_saved(stream.state_dict()), weights_only=True)  # as the checkpoint keeps it
        resumed = build_text_dataset(path, TOKENIZER, SEQ_LEN, streaming=True)
        resumed.load_state_dict(state)
        np.testing.assert_array_equal(windows(itertools.islice(resumed, 5)), reference[done: done + 5])
        np.testing.assert_array_equal(windows(itertools.islice(stream, 3)), reference[done: done + 3])  # goes on


def _saved(state: dict) -> io.BytesIO:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return buffer


def test_stream_micro_batches_split_each_chunk_over_the_ranks_like_the_sampler(sources):
    path = str(sources["csv"])
    reference = windows(itertools.islice(build_text_dataset(path, TOKENIZER, SEQ_LEN, streaming=True), 40))
    ranks = [list(itertools.islice(stream_micro_batches(build_text_dataset(path, TOKENIZER, SEQ_LEN, streaming=True),
                                                        3, dp_rank=r, dp_size=2, skip=4), 6)) for r in range(2)]
    for k, ((mine, state), (theirs, other)) in enumerate(zip(*ranks)):
        assert state == other  # the same on every rank
        np.testing.assert_array_equal(torch.cat([mine["input_ids"], theirs["input_ids"]]).numpy(),
                                      reference[4 + 6 * k: 10 + 6 * k])
    resumed = build_text_dataset(path, TOKENIZER, SEQ_LEN, streaming=True)
    resumed.load_state_dict(ranks[0][2][1])  # after the third chunk
    np.testing.assert_array_equal(windows(itertools.islice(resumed, 6)), reference[22:28])


# ------------------------------------------------------------------------------------------ errors
def test_a_missing_column_names_the_columns_there_are(sources, tmp_path):
    for streaming in (False, True):
        with pytest.raises(ValueError, match=r"corpus.jsonl has no column 'body'; its columns are \['text', 'id'\]"):
            build_text_dataset(str(sources["jsonl"]), TOKENIZER, SEQ_LEN, text_column="body", streaming=streaming,
                               cache_dir=str(tmp_path))


def test_empty_data_is_refused(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "header.csv").write_text("text\n")
    (tmp_path / "blank.jsonl").write_text(json.dumps({"text": ""}) + "\n")
    (tmp_path / "short.jsonl").write_text(json.dumps({"text": "def f(): pass"}) + "\n")
    for streaming in (False, True):
        with pytest.raises(ValueError, match="the data file .*empty.jsonl is empty: there is nothing to train on"):
            build_text_dataset(str(tmp_path / "empty.jsonl"), TOKENIZER, SEQ_LEN, streaming=streaming)
        with pytest.raises(ValueError, match="the 'train' split of .*header.csv is empty: there is nothing to train"):
            build_text_dataset(str(tmp_path / "header.csv"), TOKENIZER, SEQ_LEN, streaming=streaming,
                               cache_dir=str(tmp_path / "cache"))
    for name, tokens in (("blank", 0), ("short", 5)):
        with pytest.raises(ValueError, match=rf"{name}.jsonl \(tokenized with .*\) gives {tokens} tokens, fewer than "
                                             rf"one sample of seq_len 16; use more text or a shorter seq_len"):
            build_text_dataset(str(tmp_path / f"{name}.jsonl"), TOKENIZER, SEQ_LEN, cache_dir=str(tmp_path / "cache"))
    blank = build_text_dataset(str(tmp_path / "blank.jsonl"), TOKENIZER, SEQ_LEN, streaming=True)
    with pytest.raises(ValueError, match=r"blank.jsonl .* has no text in its column 'text': nothing to train on"):
        next(iter(blank))


def test_a_tokenizer_larger_than_the_model_names_both_sizes_and_the_fix(sources, tmp_path):
    mapped = build_text_dataset(str(sources["jsonl"]), TOKENIZER, SEQ_LEN, cache_dir=str(tmp_path))
    stream = build_text_dataset(str(sources["jsonl"]), TOKENIZER, SEQ_LEN, streaming=True)
    for dataset in (mapped, stream):
        check_dataset(dataset, vocab_size=8192, max_positions=SEQ_LEN)
        with pytest.raises(ValueError, match=r"corpus.jsonl \(tokenized with .*tokenizer\): the tokenizer .* has a "
                                             r"vocabulary of 8192 tokens, but the model's has 8000, .* use the "
                                             r"model's own tokenizer, or resize the model's embedding"):
            check_dataset(dataset, vocab_size=8000, max_positions=None)
        with pytest.raises(ValueError, match=r"corpus.jsonl .* makes samples of seq_len = 16 tokens, .* set the "
                                             r"dataset's seq_len to at most 8"):
            check_dataset(dataset, vocab_size=None, max_positions=8)


# ------------------------------------------------------------------------------------- the trainer
@pytest.fixture(scope="module")
def config_file(texts, sources, tmp_path_factory) -> Path:
    """A corpus of 22 windows: the stream starts its second epoch in step 6 (the sampler, which
    keeps whole global batches, in step 6 too, at the first window)."""
    root = tmp_path_factory.mktemp("trainer")
    with open(root / "corpus.jsonl", "w") as f:
        f.writelines(json.dumps({"text": text}) + "\n" for text in texts[:8])
    assert len(by_hand(texts[:8], SEQ_LEN)) == 22
    return saved_recipe(root / "config.yaml", "text_gpt2.py", f"dataloader.train.path={root / 'corpus.jsonl'}",
                        f"dataloader.train.cache_dir={root / 'cache'}")


def load(config_file: Path, output_dir: Path, *overrides: str):
    return LazyConfig.apply_overrides(LazyConfig.load(str(config_file)),
                                      [f"train.output_dir={output_dir}", *overrides])


def straight_and_resumed(config_file: Path, root: Path, *overrides: str) -> tuple[dict, dict]:
    """The losses of 6 steps uninterrupted and of 3 steps, then 3 more resumed from the checkpoint."""
    run_trainer(load(config_file, root / "straight", *overrides))
    with pytest.raises(KeyboardInterrupt):
        run_trainer(load(config_file, root / "resumed", *overrides), interrupt_after=3)
    run_trainer(load(config_file, root / "resumed", *overrides), resume=True)
    return losses(root / "straight"), losses(root / "resumed")


@pytest.mark.parametrize("streaming", [False, True])
def test_a_resumed_run_logs_the_losses_of_an_uninterrupted_one(config_file, tmp_path, streaming, monkeypatch):
    """The stream crosses into its second epoch after the resume; its checkpoint holds its state
    after step 3's last micro-batch (not the prefetch thread's), and the resumed run starts there
    without re-reading what came before."""
    skips = []

    def recorded(*args, skip: int, **kwargs):
        skips.append(skip)
        return stream_micro_batches(*args, skip=skip, **kwargs)

    monkeypatch.setattr(default_trainer, "stream_micro_batches", recorded)
    straight, resumed = straight_and_resumed(config_file, tmp_path, f"dataloader.train.streaming={streaming}")
    assert sorted(straight) == sorted(resumed) == list(range(1, 7))
    assert max(abs(straight[i] - resumed[i]) for i in straight) <= 1e-6
    if streaming:
        saved = torch.load(tmp_path / "resumed" / "model_0000003" / "trainer_state_rank0.pt", weights_only=True)
        stream = build_text_dataset(LazyConfig.load(str(config_file)).dataloader.train.path, TOKENIZER, SEQ_LEN,
                                    streaming=True)
        assert len(list(itertools.islice(stream, 12))) == 12
        assert saved["data"]["stream"] == stream.state_dict() and saved["data"]["stream_samples"] == 12
        assert skips == [0, 0, 0]  # the straight run, the first 3 steps, the resumed 3


def test_map_style_and_stream_read_the_same_samples_in_the_first_epoch(config_file, tmp_path):
    """With shuffle off the sampler's order is the stream's: steps 1-5 (20 of 22 windows) match."""
    run_trainer(load(config_file, tmp_path / "map", "train.max_iter=5", "train.checkpoint.period=0"))
    run_trainer(load(config_file, tmp_path / "stream", "train.max_iter=5", "train.checkpoint.period=0",
                     "dataloader.train.streaming=true"))
    mapped, streamed = losses(tmp_path / "map"), losses(tmp_path / "stream")
    assert sorted(mapped) == sorted(streamed) == list(range(1, 6))
    assert max(abs(mapped[i] - streamed[i]) for i in mapped) <= 1e-6


def test_a_stream_rollback_skips_the_batches_read_since_the_checkpoint(config_file, sources, tmp_path, monkeypatch):
    """Divergence in steps 4-5 rolls back to step 3's checkpoint; the stream then skips the two
    batches read since it, as the sampler does for map-style data: both runs log the same losses
    (on a corpus whose first epoch holds all 7 batches read)."""
    monkeypatch.setenv("LIBAI_ZOO_FAULT", "nan:rank=0:step=4:count=2")
    runs = {}
    for streaming in (False, True):
        out = tmp_path / f"streaming_{streaming}"
        trainer = run_trainer(load(config_file, out, "train.max_bad_steps=2", "train.on_divergence=rollback",
                                   "train.max_iter=5", f"dataloader.train.streaming={streaming}",
                                   f"dataloader.train.path={sources['jsonl']}"))
        assert trainer.data.position.skipped_batches == 2
        runs[streaming] = losses(out)
    assert sorted(runs[True]) == list(range(1, 6))
    assert all(abs(runs[True][i] - runs[False][i]) <= 1e-6 for i in (1, 2, 3, 4, 5))


def test_a_stream_read_by_worker_processes_is_refused(config_file, tmp_path):
    with pytest.raises(ValueError, match="a stream is read in the training process .* set dataloader.num_workers=0"):
        run_trainer(load(config_file, tmp_path, "dataloader.train.streaming=true", "dataloader.num_workers=2"))


def test_a_stream_as_the_test_set_is_refused(config_file, tmp_path):
    cfg = load(config_file, tmp_path)
    cfg.dataloader.test = OmegaConf.merge(cfg.dataloader.train, {"streaming": True})
    with pytest.raises(ValueError, match="dataloader.test is a stream: an evaluation needs the same samples"):
        run_trainer(cfg)


def _dp2_runs(config_file: str, root: str) -> dict:
    root = Path(root)
    straight, resumed = straight_and_resumed(Path(config_file), root, "dataloader.train.streaming=true", "dist.dp=2")
    return {"straight": straight, "resumed": resumed} if torch.distributed.get_rank() == 0 else {}


@pytest.mark.slow
def test_a_stream_at_dp2_logs_the_one_process_losses_and_resumes_exactly(config_file, tmp_path):
    from support.forked import run_forked

    run_trainer(load(config_file, tmp_path / "one", "dataloader.train.streaming=true"))
    dp2 = run_forked(_dp2_runs, 2, str(config_file), str(tmp_path / "dp2"))[0]
    one = losses(tmp_path / "one")
    assert sorted(dp2["straight"]) == sorted(dp2["resumed"]) == list(range(1, 7))
    assert max(abs(dp2["straight"][i] - one[i]) for i in one) <= 1e-5
    assert max(abs(dp2["resumed"][i] - dp2["straight"][i]) for i in one) <= 1e-6
