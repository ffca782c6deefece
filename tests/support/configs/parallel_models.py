"""test_parallel_training.py's models, each trained at many layouts (the test picks one as the model):
a tiny GPT-2 without dropout, a Llama and each other family read from Hugging Face directories (as
the recipes start), a Llama with a single KV head, a Mixtral with an uneven router; on a text file.
The directories, the text and its cache are overrides: hf_dir=... (the directories
hf_dir/llama, hf_dir/<family>), dataloader.train.text_file=... dataloader.train.cache_dir=..."""

from pathlib import Path

from layouts import FAMILY_LAYOUTS as _FAMILY_LAYOUTS
from libai_zoo.config import LazyCall, get_config
from libai_zoo.data import DigitsDataset, build_gpt_dataset
from libai_zoo.models import (
    AutoModelForCausalLM,
    AutoModelForImageClassification,
    AutoModelForSeq2SeqLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
)
from model_cases import uneven_router

_ROOT = Path(__file__).resolve().parents[3]
_AUTO_CLASS = dict(t5=AutoModelForSeq2SeqLM, swin=AutoModelForImageClassification)  # else AutoModelForCausalLM

hf_dir = "???"
train = get_config("common/train.py").train
dist = get_config("common/train.py").dist
optim = get_config("common/optim.py").optim
models = dict(
    gpt2=LazyCall(GPT2LMHeadModel)(config=LazyCall(GPT2Config)(
        vocab_size=8192, n_positions=32, n_embd=32, n_layer=4, n_head=4, bos_token_id=0, eos_token_id=0,
        embd_pdrop=0.0, attn_pdrop=0.0, resid_pdrop=0.0)),
    llama=LazyCall(AutoModelForCausalLM.from_pretrained)(path="${hf_dir}/llama"),
    mqa=LazyCall(LlamaForCausalLM)(config=LazyCall(LlamaConfig)(
        vocab_size=8192, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=1, max_position_embeddings=32, bos_token_id=0, eos_token_id=0)),
    **{family: LazyCall(_AUTO_CLASS.get(family, AutoModelForCausalLM).from_pretrained)(path="${hf_dir}/" + family)
       for family in _FAMILY_LAYOUTS},
    moe=LazyCall(uneven_router)(name="mixtral", vocab_size=8192, num_hidden_layers=4, num_local_experts=8),
)
models.update(fp8=models["gpt2"], fp8_rowwise=models["gpt2"])  # trained with train.fp8 (FAMILY_OPTIONS)
model = models["gpt2"]
dataloader = dict(train=LazyCall(build_gpt_dataset)(text_file="???", tokenizer_dir=str(_ROOT / "data/tokenizer"),
                                                    seq_len=16, cache_dir="???"),
                  test=LazyCall(build_gpt_dataset)(text_file="${dataloader.train.text_file}",
                                                   tokenizer_dir="${dataloader.train.tokenizer_dir}", seq_len=16,
                                                   cache_dir="${dataloader.train.cache_dir}"))
#: the data of a model that reads no text
_DIGITS = str(_ROOT / "data/digits/digits.csv.gz")
dataloaders = dict(swin=dict(train=LazyCall(DigitsDataset)(path=_DIGITS, split="train"),
                             test=LazyCall(DigitsDataset)(path=_DIGITS, split="valid")))
