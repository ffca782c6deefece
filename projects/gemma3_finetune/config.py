"""Fine-tune a Hugging Face Gemma 3 directory (a text model, or the text model of a 4B-27B
`Gemma3ForConditionalGeneration` directory) as a causal language model on the shipped corpus: the
training of projects/llama_finetune, the model read from the directory by `AutoModelForCausalLM`.

    python tools/make_tiny_hf_model.py gemma3 output/tiny_gemma3 --layers 6   # a stand-in: the hub is offline here
    python tools/train.py projects/gemma3_finetune/config.py
    torchrun --nproc_per_node=2 tools/train.py projects/gemma3_finetune/config.py dist.tp=2 dist.sequence_parallel=true \
        train.output_dir=output/gemma3_finetune_tp2

The tokenizer must be the model's own: data/tokenizer for the stand-in (vocabulary 8192).
"""

from libai_zoo.config import LazyCall

from ..llama_finetune.config import dataloader, dist, hooks, optim, train  # noqa: F401  (config keys)

model = LazyCall("libai_zoo.models.AutoModelForCausalLM.from_pretrained")(path="output/tiny_gemma3", dtype="float32")

train.output_dir = "output/gemma3_finetune"
