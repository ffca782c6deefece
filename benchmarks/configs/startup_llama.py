"""bench_startup.py's Llama, its sizes given as overrides (model.config.hidden_size=..., ...), on the
shipped corpus (the trainer checks its data against the model at start-up; the token cache is an
override, filled before the ranks start)."""

from pathlib import Path

from libai_zoo.config import LazyCall, get_config
from libai_zoo.data import build_gpt_dataset
from libai_zoo.models import LlamaConfig, LlamaForCausalLM

_ROOT = Path(__file__).resolve().parents[2]

train = get_config("common/train.py").train
dist = get_config("common/train.py").dist
optim = get_config("common/optim.py").optim
model = LazyCall(LlamaForCausalLM)(config=LazyCall(LlamaConfig)(
    vocab_size="???", hidden_size="???", intermediate_size="???", num_hidden_layers="???",
    num_attention_heads="???", num_key_value_heads="???", max_position_embeddings=2048))
dataloader = dict(train=LazyCall(build_gpt_dataset)(text_file=str(_ROOT / "data/corpus/python_docs.txt"),
                                                    tokenizer_dir=str(_ROOT / "data/tokenizer"), seq_len=2048,
                                                    cache_dir="???"))
