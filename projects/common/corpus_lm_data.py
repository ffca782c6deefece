"""Language-model data shared by the GPT-2 and Llama recipes: the shipped corpus as packed
128-token sequences, the held-out file for evaluation. Recipes import it relatively:

    from ..common.corpus_lm_data import dataloader
"""

from libai_zoo.config import LazyCall
from libai_zoo.data import build_gpt_dataset

dataloader = dict(
    train=LazyCall(build_gpt_dataset)(text_file="data/corpus/python_docs.txt", tokenizer_dir="data/tokenizer",
                                      seq_len=128, cache_dir="output/cache"),
    test=LazyCall(build_gpt_dataset)(text_file="data/corpus/python_docs_valid.txt", tokenizer_dir="data/tokenizer",
                                     seq_len=128, cache_dir="output/cache"),
    num_workers=0,
)
