"""Chat supervised fine-tuning of a Hugging Face Mixture-of-Experts directory (Qwen3-MoE; Mixtral,
Qwen2-MoE or OLMoE load the same way) with LoRA: the data, packing, schedule and sample of
projects/llama_sft, rank-16 adapters on the attention projections (q, k, v fused as `qkv`, and
`out`) and on the routed experts (`experts`: each projection of each expert its own rank-16
adapter); the routers, the norms and the embeddings frozen.

    python tools/make_tiny_hf_model.py qwen3_moe output/tiny_qwen3_moe   # a stand-in: the hub is offline here
    python tools/train.py projects/moe_lora_finetune/config.py
    python tools/convert zoo-to-hf output/moe_lora_finetune output/moe_lora_adapter --adapter   # peft loads it

The tokenizer must be the model's own: data/tokenizer for the stand-in (vocabulary 8192).
"""

from libai_zoo.config import LazyCall

from ..llama_sft.config import dataloader, dist, hooks, optim, train  # noqa: F401  (config keys)

model = LazyCall("libai_zoo.models.AutoModelForCausalLM.from_pretrained")(path="output/tiny_qwen3_moe",
                                                                           dtype="float32")

optim.lr = 5e-3
train.update(output_dir="output/moe_lora_finetune", lora=dict(rank=16, alpha=32, target_modules=["qkv", "out", "experts"]))
