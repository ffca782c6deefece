"""test_startup_memory.py's Llama, eight layers that dominate its size, on recorded random tokens;
``pretrained`` is the same model from a Hugging Face directory: pretrained.path=... (the test
swaps it in as the model)."""

from libai_zoo.config import LazyCall, get_config
from libai_zoo.models import LlamaConfig, LlamaForCausalLM
from recorded_data import RecordedTokens

train = get_config("common/train.py").train
dist = get_config("common/train.py").dist
optim = get_config("common/optim.py").optim
model = LazyCall(LlamaForCausalLM)(config=LazyCall(LlamaConfig)(
    vocab_size=512, hidden_size=128, intermediate_size=512, num_hidden_layers=8, num_attention_heads=8,
    num_key_value_heads=4, max_position_embeddings=32, bos_token_id=0, eos_token_id=0))
pretrained = LazyCall("libai_zoo.models.LlamaForCausalLM.from_pretrained")(path="???", dtype="float32")
dataloader = dict(train=LazyCall(RecordedTokens)(num_samples=64, seq_len=16, vocab_size=512,
                                                 record_dir="${train.output_dir}/samples"))
