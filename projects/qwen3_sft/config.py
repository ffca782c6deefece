"""Chat supervised fine-tuning of a Hugging Face Qwen3 directory with LoRA: the data, packing,
schedule and sample of projects/llama_sft, rank-16 adapters on every attention and MLP projection
(the rest frozen), the model read from the directory by `AutoModelForCausalLM`.

    python tools/make_tiny_hf_model.py qwen3 output/tiny_qwen3   # a stand-in: the hub is offline here
    python tools/train.py projects/qwen3_sft/config.py
    python tools/convert zoo-to-hf output/qwen3_sft output/qwen3_sft_adapter --adapter   # peft loads it
    torchrun --nproc_per_node=2 tools/train.py projects/qwen3_sft/config.py dist.tp=2 dist.sequence_parallel=true \
        train.output_dir=output/qwen3_sft_tp2

The tokenizer must be the model's own: data/tokenizer for the stand-in (vocabulary 8192), which has
no chat template (llama_sft's is used). A real Qwen3 tokenizer brings Qwen's ChatML template:
`dataloader.train.chat_template=null dataloader.test.chat_template=null` uses it.
"""

from libai_zoo.config import LazyCall

from ..llama_sft.config import dataloader, dist, hooks, optim, train  # noqa: F401  (config keys)

model = LazyCall("libai_zoo.models.AutoModelForCausalLM.from_pretrained")(path="output/tiny_qwen3", dtype="float32")

optim.lr = 5e-3
train.update(output_dir="output/qwen3_sft", lora=dict(rank=16, alpha=32))
