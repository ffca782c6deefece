"""T5's span corruption (Raffel et al., 2020, §3.1.4): a window of text loses about 15 % of its tokens
in spans of mean length 3; the input keeps the rest with one sentinel in place of each span, the
target lists each sentinel followed by the tokens it hides.

    tokens   Thank you for inviting me to your party last week .
    input    Thank you <extra_id_0> me to your party <extra_id_1> week . </s>
    target   <extra_id_0> for inviting <extra_id_1> last </s>

    tokenizer = sentinel_tokenizer("data/tokenizer")          # the shipped one, with <extra_id_0..99>
    dataset = build_span_corruption_dataset("data/corpus/python_docs.txt", "data/tokenizer", input_length=128)
    dataset[0]  # {"input_ids": LongTensor[128], "labels": LongTensor[target_length]}

Every sample has the same lengths: the raw window is the longest whose corrupted input fits
`input_length` (T5's `compute_input_and_target_lengths`), and the number of spans depends on the
window's length only. Which tokens are hidden is drawn from (seed, sample index), so a sample is
the same whatever the order it is read in, on every rank and after a resume. Sentinels follow T5's
numbering: `<extra_id_0>` is the largest id, the next ones count down.
"""

from __future__ import annotations

import datasets
import numpy as np
import pyarrow.compute as pc
import torch
from torch.utils.data import Dataset
from transformers import PreTrainedTokenizerBase

from .text_dataset import build_text_dataset
from .tokenizer import load_tokenizer
from .validation import TokenIdRange

SENTINELS = 100  # T5's extra_ids


def sentinel_tokenizer(tokenizer_dir: str, extra_ids: int = SENTINELS) -> PreTrainedTokenizerBase:
    """The tokenizer of `tokenizer_dir` with T5's sentinels `<extra_id_0>` ... appended as special
    tokens, `<extra_id_0>` last (the largest id), as T5's vocabularies number them."""
    tokenizer = load_tokenizer(tokenizer_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": [f"<extra_id_{k}>" for k in reversed(range(extra_ids))]})
    return tokenizer


def corrupted_lengths(raw_length: int, noise_density: float, mean_span: float) -> tuple[int, int, int]:
    """(noise tokens, spans, input length) of a `raw_length`-token window; the target holds the
    noise tokens, a sentinel per span and eos, the input the rest, a sentinel per span and eos."""
    noise = min(max(round(raw_length * noise_density), 1), raw_length - 1)
    spans = max(round(min(noise, raw_length - noise) / mean_span), 1)
    return noise, spans, raw_length - noise + spans + 1


def raw_length_for(input_length: int, noise_density: float, mean_span: float) -> int:
    """The longest window whose corrupted input is at most `input_length` tokens."""
    raw = 2
    while corrupted_lengths(raw + 1, noise_density, mean_span)[2] <= input_length:
        raw += 1
    if corrupted_lengths(raw, noise_density, mean_span)[2] > input_length:
        raise ValueError(f"input_length = {input_length} is too short for span corruption: use at least 4")
    return raw


def noise_mask(length: int, noise: int, spans: int, rng: np.random.Generator) -> np.ndarray:
    """A boolean mask of `noise` hidden tokens in `spans` runs: the noise and the kept tokens are each
    cut into `spans` non-empty runs at random, and the runs alternate, kept first."""
    def run_lengths(items: int) -> np.ndarray:
        cuts = np.sort(rng.choice(np.arange(1, items), spans - 1, replace=False))
        return np.diff(np.concatenate(([0], cuts, [items])))

    runs = np.stack([run_lengths(length - noise), run_lengths(noise)], axis=1).reshape(-1)
    return np.repeat(np.tile([False, True], spans), runs)


class SpanCorruptionDataset(Dataset):
    """Windows of `raw_length` tokens (a `build_text_dataset`) turned into T5 samples; see the module
    docstring. `sentinels[k]` is `<extra_id_k>`'s id."""

    def __init__(self, windows: datasets.Dataset, sentinels: list[int], eos_token_id: int, *, input_length: int,
                 noise_density: float, mean_span: float, seed: int):
        self.windows, self.sentinels, self.eos = windows, sentinels, eos_token_id
        self.noise_density, self.mean_span, self.seed = noise_density, mean_span, seed
        self.raw_length = windows.seq_len
        self.noise, self.spans, self.seq_len = corrupted_lengths(self.raw_length, noise_density, mean_span)
        if self.spans > len(sentinels):
            raise ValueError(f"{self.spans} spans per sample need as many sentinels; the tokenizer has "
                             f"{len(sentinels)}: use a shorter input_length or a larger mean span")
        self.target_length = self.noise + self.spans + 1
        self.source = windows.info.description

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        tokens = self.windows[index]["input_ids"].numpy()
        hidden = noise_mask(self.raw_length, self.noise, self.spans, np.random.default_rng([self.seed, index]))
        starts = hidden & ~np.concatenate(([False], hidden[:-1]))  # the first token of each span
        sentinel = np.asarray(self.sentinels[:self.spans])[np.cumsum(starts) - 1]
        inputs = np.where(starts, sentinel, tokens)[~hidden | starts]
        targets = np.insert(tokens[hidden], np.flatnonzero(starts[hidden]), sentinel[starts])
        return {"input_ids": torch.from_numpy(np.append(inputs, self.eos)).long(),
                "labels": torch.from_numpy(np.append(targets, self.eos)).long()}

    def token_id_ranges(self) -> list[TokenIdRange]:
        """The text's ids (read once from the windows' column) and the sentinels'."""
        text = pc.min_max(pc.list_flatten(self.windows.data.column("input_ids")))
        return [TokenIdRange(self.source, text["min"].as_py(), text["max"].as_py()),
                TokenIdRange("the sentinels <extra_id_N>", min(self.sentinels), max(self.sentinels))]


def build_span_corruption_dataset(path: str, tokenizer_dir: str, input_length: int = 128, *,
                                  noise_density: float = 0.15, mean_noise_span_length: float = 3.0, seed: int = 0,
                                  cache_dir: str | None = None, **source_kwargs) -> SpanCorruptionDataset:
    """T5 pre-training samples of the documents of `path` (anything `build_text_dataset` reads),
    tokenized with `tokenizer_dir`'s tokenizer; the model's vocabulary must hold its sentinels
    (`sentinel_tokenizer(tokenizer_dir)`: len(tokenizer) ids)."""
    if not 0 < noise_density < 1 or mean_noise_span_length < 1:
        raise ValueError(f"noise_density = {noise_density} must be in (0, 1) and mean_noise_span_length = "
                         f"{mean_noise_span_length} at least 1 (T5's: 0.15 and 3)")
    if source_kwargs.get("streaming"):
        raise ValueError("span corruption draws each sample from its index in a map-style dataset: leave streaming out")
    raw = raw_length_for(input_length, noise_density, mean_noise_span_length)
    windows = build_text_dataset(path, tokenizer_dir, raw, cache_dir=cache_dir, **source_kwargs)
    tokenizer = sentinel_tokenizer(tokenizer_dir)
    sentinels = tokenizer.convert_tokens_to_ids([f"<extra_id_{k}>" for k in range(SENTINELS)])
    return SpanCorruptionDataset(windows, sentinels, tokenizer.eos_token_id, input_length=input_length,
                                 noise_density=noise_density, mean_span=mean_noise_span_length, seed=seed)
