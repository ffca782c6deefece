"""libai_zoo.convert: checkpoints between formats (the work behind `tools/convert`).

    hf_to_zoo("hf_dir", "out", tp=2)          # Hugging Face -> a layout-free libai_zoo checkpoint
    zoo_to_hf("output/run", "hf_out")         # any training checkpoint -> Hugging Face
    megatron_to_hf("megatron_ckpt", "hf_out") # Megatron-LM (Megatron-Core GPT/Llama, or legacy GPT) -> Hugging Face
    megatron_to_zoo("megatron_ckpt", "out")   # Megatron-Core -> a libai_zoo checkpoint
    hf_to_megatron("hf_dir", "megatron_out")  # -> Megatron-Core torch_dist (also zoo_to_megatron)
    print(describe("any_checkpoint"))         # tensors, shapes, dtypes and layout

Conversion sits above the models (it builds them) and the checkpoints (it writes them).
"""

from .describe import describe
from .hf_zoo import export_adapter, export_to_hf, hf_to_zoo, load_checkpoint_model, resolve_checkpoint, zoo_to_hf
from .megatron_core import hf_to_megatron, megatron_to_hf, megatron_to_zoo, zoo_to_megatron

__all__ = ["hf_to_zoo", "zoo_to_hf", "export_to_hf", "export_adapter", "load_checkpoint_model", "resolve_checkpoint",
           "megatron_to_hf", "megatron_to_zoo", "hf_to_megatron", "zoo_to_megatron", "describe"]
