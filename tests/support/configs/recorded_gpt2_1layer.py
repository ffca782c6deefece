"""A one-layer GPT-2 on recorded random tokens, evaluated every 4 steps (test_plot.py's real run);
the run's directory is the override train.output_dir=... (the tokens are recorded under it)."""

from libai_zoo.config import LazyCall, get_config
from libai_zoo.models import GPT2Config, GPT2LMHeadModel
from recorded_data import RecordedTokens

train = get_config("common/train.py").train
dist = get_config("common/train.py").dist
optim = get_config("common/optim.py").optim
model = LazyCall(GPT2LMHeadModel)(config=LazyCall(GPT2Config)(
    vocab_size=128, n_positions=16, n_embd=32, n_layer=1, n_head=2, bos_token_id=0, eos_token_id=0))
dataloader = dict(train=LazyCall(RecordedTokens)(num_samples=64, seq_len=16, vocab_size=128,
                                                 record_dir="${train.output_dir}/samples"),
                  test=LazyCall(RecordedTokens)(num_samples=4, seq_len=16, vocab_size=128,
                                                record_dir="${train.output_dir}/samples"))
train.update(max_iter=6, micro_batch_size=2, global_batch_size=2, log_period=2, eval=dict(period=4),
             checkpoint=dict(period=100))
