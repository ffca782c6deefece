"""test_sample_memory.py's models, each with an 8192-token table 4-10 times a layer: ``gpt2``
(tied head, learned positions), ``gpt2_128`` (wider, for bf16) and ``llama`` (untied head,
rotary); the test picks one as the model. The data: recorded random tokens."""

from libai_zoo.config import LazyCall, get_config
from libai_zoo.models import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
from recorded_data import RecordedTokens

train = get_config("common/train.py").train
dist = get_config("common/train.py").dist
optim = get_config("common/optim.py").optim
gpt2 = LazyCall(GPT2LMHeadModel)(config=LazyCall(GPT2Config)(
    vocab_size=8192, n_positions=64, n_embd=64, n_layer=4, n_head=4, bos_token_id=0, eos_token_id=0))
gpt2_128 = LazyCall(GPT2LMHeadModel)(config=LazyCall(GPT2Config)(
    vocab_size=8192, n_positions=64, n_embd=128, n_layer=4, n_head=4, bos_token_id=0, eos_token_id=0))
llama = LazyCall(LlamaForCausalLM)(config=LazyCall(LlamaConfig)(
    vocab_size=8192, hidden_size=128, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
    num_key_value_heads=4, max_position_embeddings=64, bos_token_id=0, eos_token_id=0))
model = gpt2
dataloader = dict(train=LazyCall(RecordedTokens)(num_samples=16, seq_len=16, vocab_size=8192,
                                                 record_dir="${train.output_dir}/samples"))
