"""test_chat_sft.py's packed supervised fine-tuning: a small ``llama`` and a ``gpt2`` without dropout
(the test picks one as the model) on chats formatted with projects/llama_sft's template (its
assistant turns marked); the chats and their cache are overrides: dataloader.train.path=...
dataloader.train.cache_dir=..."""

from pathlib import Path

from libai_zoo.config import LazyCall, LazyConfig, get_config
from libai_zoo.data import build_chat_dataset
from libai_zoo.models import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

_ROOT = Path(__file__).resolve().parents[3]
_TEMPLATE = LazyConfig.load(_ROOT / "projects/llama_sft/config.py").dataloader.train.chat_template

train = get_config("common/train.py").train
dist = get_config("common/train.py").dist
optim = get_config("common/optim.py").optim
models = dict(
    llama=LazyCall(LlamaForCausalLM)(config=LazyCall(LlamaConfig)(
        vocab_size=8192, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, bos_token_id=0, eos_token_id=0)),
    gpt2=LazyCall(GPT2LMHeadModel)(config=LazyCall(GPT2Config)(
        vocab_size=8192, n_positions=256, n_embd=32, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0,
        embd_pdrop=0.0, attn_pdrop=0.0, resid_pdrop=0.0)),
)
model = models["llama"]
dataloader = dict(train=LazyCall(build_chat_dataset)(path="???", tokenizer_dir=str(_ROOT / "data/tokenizer"),
                                                     max_length=256, chat_template=_TEMPLATE, cache_dir="???"))
