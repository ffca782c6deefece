"""A two-layer GPT-2 without dropout on recorded random tokens (test_resilience.py): every sample a
rank trains on is recorded under train.output_dir, so a recovered run can be checked to train each
sample once, in order."""

from libai_zoo.config import LazyCall, get_config
from libai_zoo.models import GPT2Config, GPT2LMHeadModel
from recorded_data import RecordedTokens

train = get_config("common/train.py").train
dist = get_config("common/train.py").dist
optim = get_config("common/optim.py").optim
model = LazyCall(GPT2LMHeadModel)(config=LazyCall(GPT2Config)(
    vocab_size=128, n_positions=16, n_embd=32, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0,
    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
dataloader = dict(train=LazyCall(RecordedTokens)(num_samples=256, seq_len=16, vocab_size=128,
                                                 record_dir="${train.output_dir}/samples"),
                  prefetch=0)
train.update(max_iter=8, micro_batch_size=2, global_batch_size=4, log_period=1, checkpoint=dict(period=2),
             clip_grad_norm=1.0)
optim.lr = 1e-3
