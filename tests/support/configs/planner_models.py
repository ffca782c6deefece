"""test_planner_memory_distributed.py's models on recorded random tokens: ``gpt2`` (head tied to
its embedding) and ``llama`` (untied, grouped-query attention); the test picks one as the model.
The vocabulary, 1030 (515 rows per tp rank), makes FSDP2 pad the rows at dp 2 and 4, and 18
positions pad at dp 4."""

from libai_zoo.config import LazyCall, get_config
from libai_zoo.models import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
from recorded_data import RecordedTokens

_VOCAB = 1030

train = get_config("common/train.py").train
dist = get_config("common/train.py").dist
optim = get_config("common/optim.py").optim
models = dict(
    gpt2=LazyCall(GPT2LMHeadModel)(config=LazyCall(GPT2Config)(
        vocab_size=_VOCAB, n_positions=18, n_embd=36, n_layer=4, n_head=4, bos_token_id=0, eos_token_id=0,
        embd_pdrop=0.0, attn_pdrop=0.0, resid_pdrop=0.0)),
    llama=LazyCall(LlamaForCausalLM)(config=LazyCall(LlamaConfig)(
        vocab_size=_VOCAB, hidden_size=40, intermediate_size=72, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, bos_token_id=0, eos_token_id=0)),
)
model = models["gpt2"]
dataloader = dict(train=LazyCall(RecordedTokens)(num_samples=64, seq_len=16, vocab_size=_VOCAB,
                                                 record_dir="${train.output_dir}/samples"))
