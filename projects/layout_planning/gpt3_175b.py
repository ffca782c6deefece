"""GPT-3 175B (Brown et al. 2020) as Megatron-LM trains it: 96 layers, hidden 12288, 96 heads,
sequence 2048, global batch 1536 sequences, bf16; the GPT-2 vocabulary padded to 51200 (Megatron
pads it to a multiple of 128 × tp), learned positions. For planning and dry runs at scale (built
on the meta device only).

    python tools/plan.py projects/layout_planning/gpt3_175b.py --world-size 1024 --device a100
"""

from libai_zoo.config import LazyCall, get_config
from libai_zoo.data import build_gpt_dataset
from libai_zoo.models import GPT2Config, GPT2LMHeadModel

train = get_config("common/train.py").train
dist = get_config("common/train.py").dist
optim = get_config("common/optim.py").optim

model = LazyCall(GPT2LMHeadModel)(
    config=LazyCall(GPT2Config)(vocab_size=51200, n_positions=2048, n_embd=12288, n_layer=96, n_head=96,
                                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
)

dataloader = dict(
    train=LazyCall(build_gpt_dataset)(text_file="data/corpus/python_docs.txt", tokenizer_dir="data/tokenizer",
                                      seq_len=2048, cache_dir="output/cache"),
)

train.update(output_dir="output/gpt3_175b", micro_batch_size=1, global_batch_size=1536, amp=dict(enabled=True))
