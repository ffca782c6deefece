"""Load a tokenizer directory (data/tokenizer by default in the recipes) offline, for GPT or BERT.

The shipped tokenizer adds no token when it encodes, as GPT-2's does; `bert=True` installs a
`[CLS] A [SEP]` / `[CLS] A [SEP] B [SEP]` template on the loaded copy (the files stay as they are),
so one tokenizer directory serves both model families.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import processors
from transformers import PreTrainedTokenizerFast


def load_tokenizer(tokenizer_dir: str | Path, *, bert: bool = False) -> PreTrainedTokenizerFast:
    """The fast tokenizer saved in `tokenizer_dir`; with `bert=True` encoding wraps each text in
    [CLS] ... [SEP] (pairs: [CLS] A [SEP] B [SEP], token type ids 0 then 1) as BertTokenizer does."""
    path = Path(tokenizer_dir)
    if not (path / "tokenizer.json").is_file():
        raise FileNotFoundError(f"no tokenizer.json in {path}: pass the directory that holds it, e.g. data/tokenizer "
                                f"(rebuild it with `python data/tokenizer/train_tokenizer.py`)")
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(path))
    if bert:
        missing = [name for name in ("cls_token", "sep_token") if getattr(tokenizer, name) is None]
        if missing:
            raise ValueError(f"{path} sets no {' or '.join(missing)} in tokenizer_config.json; bert=True needs both")
        cls, sep = tokenizer.cls_token, tokenizer.sep_token
        tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{cls}:0 $A:0 {sep}:0",
            pair=f"{cls}:0 $A:0 {sep}:0 $B:1 {sep}:1",
            special_tokens=[(cls, tokenizer.cls_token_id), (sep, tokenizer.sep_token_id)],
        )
    return tokenizer
