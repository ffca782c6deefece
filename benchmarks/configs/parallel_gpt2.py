"""The parallel benchmarks' tiny GPT-2 (fp32, no dropout, vocabulary 8192 from data/tokenizer) trained
on a text corpus: bench_layout_state_collectives.py, bench_pipeline_bubble.py and
bench_gradient_overlap.py give its sizes and corpus as overrides (`bench_common.write_gpt2_configs`)."""

from pathlib import Path

from libai_zoo.config import LazyCall, get_config
from libai_zoo.data import build_gpt_dataset
from libai_zoo.models import GPT2Config, GPT2LMHeadModel

_TOKENIZER = str(Path(__file__).resolve().parents[2] / "data/tokenizer")

train = get_config("common/train.py").train
dist = get_config("common/train.py").dist
optim = get_config("common/optim.py").optim
model = LazyCall(GPT2LMHeadModel)(config=LazyCall(GPT2Config)(
    vocab_size=8192, n_positions="???", n_embd="???", n_layer="???", n_head="???", bos_token_id=0,
    eos_token_id=0, embd_pdrop=0.0, attn_pdrop=0.0, resid_pdrop=0.0))
dataloader = dict(train=LazyCall(build_gpt_dataset)(text_file="???", tokenizer_dir=_TOKENIZER,
                                                    seq_len="${model.config.n_positions}", cache_dir="???"))
