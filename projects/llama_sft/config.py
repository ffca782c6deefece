"""Supervised chat fine-tuning of a Hugging Face Llama directory on the shipped chat data, with packing.

    python tools/make_tiny_hf_model.py llama output/tiny_llama   # a stand-in: the hub is offline here
    python tools/train.py projects/llama_sft/config.py
    torchrun --nproc_per_node=2 tools/train.py projects/llama_sft/config.py dist.tp=2 dist.sequence_parallel=true \
        train.output_dir=output/llama_sft_tp2

Conversations ({"messages": [{"role", "content"}, ...]}, data/chat) are rendered by the chat
template below, the loss is on the assistant's tokens only, and whole conversations are packed
into 512-token samples (position ids restart per conversation; attention stays inside each).
The tokenizer must be the model's own: data/tokenizer for the stand-in (vocabulary 8192), which
has no chat template of its own.
"""

from libai_zoo.config import LazyCall, get_config
from libai_zoo.data import build_chat_dataset
from libai_zoo.engine import GenerateSample

train = get_config("common/train.py").train
dist = get_config("common/train.py").dist
optim = get_config("common/optim.py").optim

# Role headers in plain text, each turn closed by eos; {% generation %} marks what the assistant
# says (its text and eos), the tokens the loss is computed on.
_CHAT_TEMPLATE = """{%- for message in messages %}
{%- if message['role'] == 'assistant' %}
{{- '### Assistant:\\n' }}{% generation %}{{ message['content'] + eos_token }}{% endgeneration %}
{%- else %}
{{- '### ' + (message['role'] | capitalize) + ':\\n' + message['content'] + eos_token }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '### Assistant:\\n' }}{%- endif %}"""
_DATA = dict(tokenizer_dir="data/tokenizer", max_length=512, chat_template=_CHAT_TEMPLATE, pack=True,
             cache_dir="output/cache")

model = LazyCall("libai_zoo.models.AutoModelForCausalLM.from_pretrained")(path="output/tiny_llama", dtype="float32")

dataloader = dict(
    train=LazyCall(build_chat_dataset)(path="data/chat/python_docs_chat.jsonl", **_DATA),
    test=LazyCall(build_chat_dataset)(path="data/chat/python_docs_chat_valid.jsonl", **_DATA),
    num_workers=0,
)

optim.lr = 2e-3
optim.betas = (0.9, 0.95)

train.update(
    output_dir="output/llama_sft",
    max_iter=300,
    micro_batch_size=8,
    global_batch_size=8,
    log_period=25,
    checkpoint=dict(period=150),
    eval=dict(period=150, max_batches=None),
    scheduler=LazyCall("libai_zoo.optim.WarmupCosineLR")(warmup_iters=30, min_lr_ratio=0.1),
)

# A held-out docstring (data/chat/python_docs_chat_valid.jsonl), as the template renders a question.
hooks = [LazyCall(GenerateSample)(
    tokenizer="data/tokenizer", max_new_tokens=40,
    prompt="### User:\nCompute an Adler-32 checksum of data. value Starting value of the checksum. The returned "
           "checksum is an integer.\n\nWhich sentence of this docstring sums it up?<|endoftext|>### Assistant:\n")]
