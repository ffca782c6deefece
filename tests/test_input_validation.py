"""Inputs that would crash late are refused before the first step (libai_zoo.data.check_dataset with
a model's input_limits()): token ids past the vocabulary, samples longer than the position table,
and .bin/.idx pairs that disagree (the damage tests/test_indexed_data.py does not already cover).
Each error names the file, the numbers and the fix."""

from __future__ import annotations

import re
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import ConcatDataset, Subset

from libai_zoo import models
from libai_zoo.data import (
    DigitsDataset,
    IndexedDataset,
    IndexedDatasetWriter,
    PackedTokenDataset,
    build_gpt_dataset,
    build_indexed_gpt_dataset,
    build_indexed_mlm_dataset,
    build_text_classification_dataset,
    check_dataset,
    index_cache,
    indexed_dataset,
)
from libai_zoo.models import TrainableModel

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = ROOT / "data" / "tokenizer"  # 8192 ids; [CLS] 2, [SEP] 3, [PAD] 1, [MASK] 4
CORPUS_VALID = ROOT / "data" / "corpus" / "python_docs_valid.txt"
HEADER = 34  # bytes before the sequence lengths in .idx
RETOKENIZE = "re-tokenize the data with the model's tokenizer, or set model.config.vocab_size >= "
REWRITE = "preprocess the data again (tools/preprocess_data.py"


def write(prefix: Path, documents, dtype=np.uint16) -> str:
    with IndexedDatasetWriter(prefix, dtype) as writer:
        for document in documents:
            writer.add_document(document)
    return str(prefix)


def corpus(tmp_path: Path, name: str = "corpus", high: int = 99, dtype=np.uint16) -> str:
    """A Megatron corpus of 3 documents whose largest token id is `high`."""
    return write(tmp_path / name, [np.arange(10, 40), np.arange(5, 25), np.array([7, high, 8, 9])], dtype)


def gpt2(vocab_size: int = 100, n_positions: int = 64) -> models.GPT2LMHeadModel:
    config = models.GPT2Config(vocab_size=vocab_size, n_positions=n_positions, n_embd=16, n_layer=1, n_head=2)
    with torch.device("meta"):
        return models.GPT2LMHeadModel(config)


def refusal(dataset, **limits) -> str:
    with pytest.raises(ValueError) as error:
        check_dataset(dataset, **limits)
    return str(error.value)


# ------------------------------------------------------------------------------------- the model side
def test_input_limits_of_the_zoo_models():
    small = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
    with torch.device("meta"):
        bert = models.BertForMaskedLM(models.BertConfig(vocab_size=300, max_position_embeddings=40, **small))
        bert_cls = models.BertForSequenceClassification(models.BertConfig(vocab_size=300, max_position_embeddings=40,
                                                                          num_labels=2, **small))
        llama = models.LlamaForCausalLM(models.LlamaConfig(vocab_size=500, max_position_embeddings=16,
                                                           num_key_value_heads=2, **small))
        vit = models.ViTForImageClassification(models.ViTConfig(image_size=8, patch_size=4, num_labels=3, **small))
        roberta = models.RobertaForMaskedLM(models.RobertaConfig(vocab_size=300, max_position_embeddings=42, **small))
    assert gpt2(100, 64).input_limits() == {"vocab_size": 100, "max_positions": 64}  # GPT-2's n_positions
    assert bert.input_limits() == bert_cls.input_limits() == {"vocab_size": 300, "max_positions": 40}
    assert llama.input_limits() == {"vocab_size": 500, "max_positions": None}  # rotary: no position table
    assert vit.input_limits() == {"vocab_size": None, "max_positions": None}  # images: no token ids
    assert roberta.input_limits() == {"vocab_size": 300, "max_positions": 40}  # positions from padding_idx + 1 = 2

    class Own(nn.Module, TrainableModel):  # a model of one's own without a config: no known limit
        layer_stack, first_stage_modules, last_stage_modules, loss_unit = "layers", (), (), "token"
        embed = layer_inputs = final_norm = head = loss = None

    assert Own().input_limits() == {"vocab_size": None, "max_positions": None}


# ---------------------------------------------------------------------------------- data that fits
def test_data_that_fits_passes(tmp_path, monkeypatch):
    prefix = corpus(tmp_path, high=99)
    gpt = build_indexed_gpt_dataset(prefix, seq_len=32, cache_dir=str(tmp_path / "cache"))
    check_dataset(gpt, **gpt2(vocab_size=100, n_positions=32).input_limits())
    blend = build_indexed_gpt_dataset([prefix, corpus(tmp_path, "other", high=50)], seq_len=8)
    check_dataset(ConcatDataset([Subset(blend, [0, 1]), gpt]), vocab_size=100, max_positions=8 * 8)
    mlm = build_indexed_mlm_dataset(prefix, seq_len=16, tokenizer_dir=str(TOKENIZER))
    check_dataset(mlm, vocab_size=8192, max_positions=16)
    check_dataset(PackedTokenDataset(np.arange(100, dtype=np.uint16), seq_len=10), vocab_size=100, max_positions=10)
    check_dataset(DigitsDataset(), vocab_size=10, max_positions=1)  # no token ids: nothing to check
    # Without a vocabulary to check, no token is read.
    monkeypatch.setattr(IndexedDataset, "token_range", lambda self: pytest.fail("the .bin was read"))
    check_dataset(gpt, vocab_size=None, max_positions=32)


# ----------------------------------------------------------------------- token ids past the vocabulary
def test_ids_past_the_vocabulary_of_a_megatron_corpus_name_the_bin(tmp_path):
    prefix = corpus(tmp_path, high=50257)
    dataset = build_indexed_gpt_dataset(prefix, seq_len=8, cache_dir=str(tmp_path / "cache"))
    message = refusal(dataset, **gpt2(vocab_size=32000).input_limits())
    assert message == (f"{prefix}.bin holds token ids up to 50257, but the model's vocabulary has 32000 (ids "
                       f"0..31999), so its embedding would fail at the first step: {RETOKENIZE}50258")


def test_the_scan_of_a_bin_is_cached_and_reads_only_the_sequences(tmp_path, monkeypatch):
    """An int32 file with a gap of -1s between its sequences that the pointers skip, read in chunks
    smaller than a sequence: the range is that of the tokens, and a second check reads no .bin."""
    tokens = [np.array([100, 101, 102], "<i4"), np.array([7], "<i4"), np.array([5, 300], "<i4")]
    gap = np.full(2, -1, "<i4").tobytes()
    (tmp_path / "hand.bin").write_bytes(tokens[0].tobytes() + gap + tokens[1].tobytes() + tokens[2].tobytes())
    header = b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 4, 3, 3)
    (tmp_path / "hand.idx").write_bytes(header + np.array([3, 1, 2], "<i4").tobytes() +
                                        np.array([0, 20, 24], "<i8").tobytes() + np.array([0, 1, 3], "<i8").tobytes())
    monkeypatch.setattr(indexed_dataset, "SCAN_BYTES", 8)
    monkeypatch.setattr(indexed_dataset, "CHECK_ENTRIES", 2)
    data = IndexedDataset(tmp_path / "hand")
    assert list(data._byte_runs()) == [(0, 12), (20, 32)]
    assert data.token_range() == (5, 300)

    dataset = build_indexed_gpt_dataset(str(tmp_path / "hand"), seq_len=2, cache_dir=str(tmp_path / "cache"))
    assert refusal(dataset, vocab_size=300, max_positions=None).startswith(f"{tmp_path / 'hand'}.bin holds token "
                                                                           f"ids up to 300")
    monkeypatch.setattr(IndexedDataset, "token_range", lambda self: pytest.fail("the cached range was not used"))
    assert index_cache.cached_token_range(dataset.data, str(tmp_path / "cache")) == (5, 300)
    check_dataset(dataset, vocab_size=301, max_positions=None)


def test_negative_ids_are_refused(tmp_path):
    prefix = write(tmp_path / "signed", [[3, -2, 4]], np.int16)
    message = refusal(build_indexed_gpt_dataset(prefix, seq_len=2), vocab_size=10, max_positions=None)
    assert message.startswith(f"{prefix}.bin holds the token id -2, and ids are never negative")
    assert message.endswith("tokenize it again (tools/preprocess_data.py for .bin/.idx)")


def test_ids_past_the_vocabulary_of_a_packed_text_name_the_text_file(tmp_path):
    dataset = build_gpt_dataset(str(CORPUS_VALID), str(TOKENIZER), seq_len=32, cache_dir=str(tmp_path))
    high = int(dataset.tokens[: len(dataset) * 32].max())
    message = refusal(dataset, vocab_size=1000, max_positions=None)
    assert message == (f"{CORPUS_VALID} (tokenized with {TOKENIZER}) holds token ids up to {high}, but the model's "
                       f"vocabulary has 1000 (ids 0..999), so its embedding would fail at the first step: "
                       f"{RETOKENIZE}{high + 1}")
    # Only the tokens of samples count: the tail no sample holds does not.
    tail = PackedTokenDataset(np.array([1, 2, 3, 4, 500]), seq_len=2, source="tail.npy")
    check_dataset(tail, vocab_size=5, max_positions=2)


def test_a_blend_names_the_part_past_the_vocabulary(tmp_path):
    good, bad = corpus(tmp_path, "good", high=99), corpus(tmp_path, "bad", high=1234)
    blend = build_indexed_gpt_dataset([good, bad, bad], [0.5, 0.25, 0.25], seq_len=4,
                                      cache_dir=str(tmp_path / "cache"))
    message = refusal(blend, vocab_size=100, max_positions=64)
    assert message.startswith(f"{bad}.bin holds token ids up to 1234, but the model's vocabulary has 100")
    assert message.endswith(f"{RETOKENIZE}1235") and good not in message  # one problem, said once
    # In a ConcatDataset, under a Subset, too.
    assert refusal(Subset(ConcatDataset([blend]), [0]), vocab_size=100, max_positions=None) == message


def test_masked_lm_names_a_tokenizer_larger_than_the_model(tmp_path):
    """The data fits, but [MASK] and the random replacements come from the tokenizer's 8192 ids."""
    prefix = corpus(tmp_path, high=99)
    dataset = build_indexed_mlm_dataset(prefix, seq_len=16, tokenizer_dir=str(TOKENIZER))
    message = refusal(dataset, vocab_size=100, max_positions=None)
    assert message.startswith(f"the tokenizer that masks {prefix}.bin (its [CLS], [SEP], [PAD], [MASK] and random "
                              f"replacement tokens) holds token ids up to 8191, but the model's vocabulary has 100")
    assert message.endswith(f"{RETOKENIZE}8192")


# ------------------------------------------------------------------------- longer than the positions
def test_samples_longer_than_the_position_table_name_the_seq_len_and_the_limit(tmp_path):
    dataset = build_indexed_gpt_dataset(corpus(tmp_path), seq_len=40)
    message = refusal(dataset, **gpt2(vocab_size=100, n_positions=32).input_limits())
    assert message == (f"{corpus(tmp_path)}.bin makes samples of seq_len = 40 tokens, but the model's learned "
                       f"position embeddings hold 32 positions (GPT-2's n_positions, BERT's "
                       f"max_position_embeddings), so the first step would index past them: set the dataset's "
                       f"seq_len to at most 32 (e.g. dataloader.train.seq_len=32), or use a model with "
                       f"max_position_embeddings >= 40")


def test_a_text_classification_dataset_names_its_text_file_and_max_length():
    dataset = build_text_classification_dataset(str(CORPUS_VALID), str(TOKENIZER), max_length=48, num_samples=20)
    check_dataset(dataset, vocab_size=8192, max_positions=48)
    message = refusal(dataset, vocab_size=8192, max_positions=32)
    assert message.startswith(f"{CORPUS_VALID} (tokenized with {TOKENIZER}) makes samples of max_length = 48 tokens")
    assert "dataloader.train.max_length=32" in message


def test_every_problem_is_named_in_one_error(tmp_path):
    dataset = ConcatDataset([build_indexed_gpt_dataset(corpus(tmp_path, "a", high=700), seq_len=16),
                             PackedTokenDataset(np.arange(64), seq_len=32, source="b.npy")])
    message = refusal(dataset, vocab_size=50, max_positions=8)
    lines = message.splitlines()
    assert lines[0] == "the data does not fit the model (4 problems):"
    assert [re.match(r"- (\S+) (makes|holds)", line).groups() for line in lines[1:]] == [
        (f"{tmp_path / 'a'}.bin", "makes"), (f"{tmp_path / 'a'}.bin", "holds"), ("b.npy", "makes"), ("b.npy", "holds")]


# --------------------------------------------------------------- .bin/.idx that disagree with each other
def damaged(tmp_path: Path, edit) -> str:
    """The message of opening a good 3-sequence uint16 pair after edit(idx bytes) -> idx bytes."""
    prefix = write(tmp_path / "pair", [[1, 2, 3], [4, 5], [6]])
    idx = Path(prefix + ".idx")
    idx.write_bytes(edit(bytearray(idx.read_bytes())))
    with pytest.raises(ValueError) as error:
        IndexedDataset(prefix)
    return str(error.value)


def put(raw: bytearray, offset: int, fmt: str, value) -> bytearray:
    struct.pack_into(fmt, raw, offset, value)
    return raw


LENGTHS, POINTERS, DOCUMENTS = HEADER, HEADER + 3 * 4, HEADER + 3 * 12  # offsets of the arrays of the pair


@pytest.mark.parametrize("edit, expected", [
    (lambda raw: put(raw, 17, "<B", 7),  # float32: a known code, but not one of tokens
     r"{idx} has dtype code 7 \(float32\), but token files hold integer ids \(codes \[1, 2, 3, 4, 5, 8\]\)"),
    (lambda raw: put(raw, 17, "<B", 1),  # uint8 over a uint16 .bin: the last 1-byte token at byte 10
     r"{bin} has 12 bytes, but {idx} accounts for 11 \(where its 3 sequences of 1-byte uint8 tokens end\): the two "
     r"files do not belong together"),
    (lambda raw: put(raw, LENGTHS + 4, "<i", -2), r"{idx} gives sequence 1 the length -2; lengths are never negative"),
    (lambda raw: put(raw, POINTERS, "<q", -4), r"{idx} points sequence 0 to byte -4 of {bin}; pointers are never"),
    (lambda raw: put(raw, POINTERS + 8, "<q", 2),
     r"{idx} points sequence 1 to byte 2 of {bin}, before sequence 0 ends \(byte 6\): each sequence must start "
     r"where the previous one ends \(or later\), its pointer \+ length x 2-byte uint16"),
    (lambda raw: put(put(raw, LENGTHS + 8, "<i", 0), POINTERS + 16, "<q", 10),  # a last empty sequence at 10
     r"{bin} has 12 bytes, but {idx} accounts for 10"),
    (lambda raw: put(raw, DOCUMENTS + 16, "<q", 5),
     r"{idx} has document index 2 = 5, outside its 3 sequences \(0..3\)"),
    (lambda raw: put(raw, DOCUMENTS + 8, "<q", 3),
     r"{idx} has document indices that decrease \(3 at entry 1, then 2\)"),
])
def test_an_index_that_disagrees_with_its_bin_is_refused(tmp_path, edit, expected):
    message = damaged(tmp_path, edit)
    pattern = expected.format(idx=re.escape(str(tmp_path / "pair.idx")), bin=re.escape(str(tmp_path / "pair.bin")))
    assert re.match(pattern, message), message
    assert REWRITE in message


def test_disagreements_past_the_first_chunk_of_the_index_are_found(tmp_path, monkeypatch):
    """The checks read the index CHECK_ENTRIES at a time; an overlap across two chunks is found."""
    monkeypatch.setattr(indexed_dataset, "CHECK_ENTRIES", 2)
    message = damaged(tmp_path, lambda raw: put(raw, POINTERS + 16, "<q", 8))  # sequence 2 starts inside 1
    assert message.startswith(f"{tmp_path / 'pair.idx'} points sequence 2 to byte 8 of {tmp_path / 'pair.bin'}, "
                              f"before sequence 1 ends (byte 10)")


def test_a_token_file_is_never_written_in_floats(tmp_path):
    with pytest.raises(ValueError, match=r"dtype float32 is not an MMIDIDX token dtype; use one of \['uint8', "):
        IndexedDatasetWriter(tmp_path / "floats", np.float32)
