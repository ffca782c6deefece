"""Train the zoo's byte-level BPE tokenizer on data/corpus/python_docs.txt.

    /work/venv/bin/python data/tokenizer/train_tokenizer.py      # writes tokenizer.json, tokenizer_config.json here

One tokenizer serves the GPT and the BERT recipes: GPT-2's byte-level BPE (no unknown tokens,
decode(encode(text)) == text) with BERT's special tokens added. Ids 0-5 are the special tokens,
in SPECIAL_TOKENS order, so `<|endoftext|>` (GPT's bos/eos) is id 0 and `[PAD]` id 1. Encoding
adds no token by itself, as GPT-2's tokenizer; `libai_zoo.data.load_tokenizer(dir, bert=True)`
puts [CLS] ... [SEP] around a text for BERT. Training is single-pass and deterministic: the
same corpus gives byte-identical files.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

HERE = Path(__file__).resolve().parent
CORPUS = HERE.parent / "corpus" / "python_docs.txt"
VOCAB_SIZE = 8192
SPECIAL_TOKENS = ["<|endoftext|>", "[PAD]", "[CLS]", "[SEP]", "[MASK]", "[UNK]"]
SAMPLE = ("Return a new list containing all items from the iterable in ascending order.\n\n"
          "  A custom key function can be supplied to customize the sort order, and the\n"
          "reverse flag can be set to request the result in descending order. Ünïcödé: naïve café — 42€ \t\n")


def train(corpus: Path) -> Tokenizer:
    documents = [d for d in re.split(r"\n\s*\n", corpus.read_text(encoding="utf-8")) if d.strip()]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, min_frequency=2, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(documents, trainer=trainer, length=len(documents))
    return tokenizer


def tokenizer_config() -> dict:
    """What transformers reads besides tokenizer.json: the class and the role of each special token."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|endoftext|>",
        "eos_token": "<|endoftext|>",
        "pad_token": "[PAD]",
        "cls_token": "[CLS]",
        "sep_token": "[SEP]",
        "mask_token": "[MASK]",
        "unk_token": "[UNK]",
        "clean_up_tokenization_spaces": False,  # keep decode(encode(text)) == text
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", type=Path, default=CORPUS)
    parser.add_argument("--out-dir", type=Path, default=HERE)
    args = parser.parse_args()
    tokenizer = train(args.corpus)
    assert [tokenizer.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(args.out_dir / "tokenizer.json"))
    (args.out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n")

    from transformers import AutoTokenizer  # check what the recipes will load

    loaded = AutoTokenizer.from_pretrained(args.out_dir)
    ids = loaded(SAMPLE)["input_ids"]
    assert loaded.decode(ids) == SAMPLE, "byte-level BPE must round-trip"
    assert loaded.eos_token_id == loaded.bos_token_id == 0 and loaded.pad_token_id == 1
    print(f"{args.out_dir}: vocab {loaded.vocab_size}, {len(ids)} tokens for a {len(SAMPLE)}-character sample")


if __name__ == "__main__":
    main()
