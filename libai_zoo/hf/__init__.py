"""libai_zoo.hf: Hugging Face model directories in and out.

    config = read_config("hf_dir")                          # config.json, with errors that say what is wrong
    with HFWeightReader("hf_dir") as reader: ...            # tensors whole or by slice (safetensors, .bin)
    load_pretrained(LlamaForCausalLM, "hf_dir", shard=True)  # what PreTrainedModel.from_pretrained runs
    save_pretrained(model, "out_dir")                       # gathered over tp; rank 0 writes
    save_peft_adapter(model, "adapter_dir")                 # LoRA adapters as PEFT loads them

This package moves tensors; what each model calls its tensors is its `WeightMap` of `rules`
(per model in models/hf_maps/). Slices are read as each parameter's sharding says: it sits above
`libai_zoo.distributed` and `libai_zoo.layers` and below the models, which call it.
"""

from .loading import check_hf_weights, load_hf_parts, load_hf_weights, load_pretrained
from .peft import apply_lora_config, load_peft_adapter, read_peft_adapter, save_peft_adapter
from .reader import Container, HFWeightReader, read_config
from .rules import WeightMap
from .saving import save_pretrained

__all__ = ["read_config", "Container", "HFWeightReader", "load_pretrained", "load_hf_weights", "load_hf_parts",
           "check_hf_weights", "save_pretrained", "WeightMap", "save_peft_adapter", "read_peft_adapter", "load_peft_adapter",
           "apply_lora_config"]
