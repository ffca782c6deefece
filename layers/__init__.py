"""libai_zoo.layers: drop-in parallel layers.

Each layer behaves like its `torch.nn` twin until `libai_zoo.distributed.shard` splits it over tensor
parallelism; model files are built from these and never mention process groups.
"""

if __name__ != "libai_zoo.layers":  # `import layers` from the repository root would load a second copy of every class
    raise ImportError(f"`layers/` is installed as `libai_zoo.layers`: write `from libai_zoo import layers` or "
                      f"`import libai_zoo.layers`, not `import layers` (imported here as `{__name__}`)")

from .attention import Attention
from .attention_masks import layer_attention_mask, packed_causal_mask
from .context_attention import ContextMask
from .cross_entropy import ParallelCrossEntropy
from .drop_path import DropPath
from .embedding import Embedding, VocabEmbedding
from .kv_cache import EncoderDecoderCache, KVCache
from .latent_attention import LatentAttention
from .linear import Linear
from .lm_head import LMHead
from .lora import LoRA, apply_lora, is_adapter_parameter, lora_adapters, merge_lora
from .mlp import MLP
from .moe import Experts, MoE, Router, Routing, load_balancing_loss, router_z_loss, uncounted
from .norm import NORMS, LayerNorm, RMSNorm
from .parallel_layer import ParallelLayer
from .qkv_layout import fuse_kv, fuse_qkv, split_kv, split_qkv
from .relative_position_bias import RelativePositionBias, relative_position_bucket
from .rotary import RotaryEmbedding, apply_rotary, yarn_mscale
from .sequence_parallel import SequenceGather, SequenceScatter
from .spec import AttentionSpec, LatentAttentionSpec, LayerSpec, MLPSpec, MoESpec
from .transformer_layer import TransformerLayer
from .window_attention import WindowAttention, WindowPositionBias

__all__ = ["Attention", "LatentAttention", "Linear", "VocabEmbedding", "Embedding", "LMHead", "KVCache", "MLP", "LayerNorm", "RMSNorm",
           "TransformerLayer", "LayerSpec", "AttentionSpec", "LatentAttentionSpec", "MLPSpec", "MoESpec",
           "ParallelCrossEntropy", "SequenceScatter", "SequenceGather", "RotaryEmbedding",
           "ParallelLayer", "apply_rotary", "LoRA", "apply_lora", "merge_lora", "lora_adapters",
           "is_adapter_parameter", "fuse_qkv", "split_qkv", "fuse_kv", "split_kv",
           "packed_causal_mask", "layer_attention_mask", "ContextMask", "NORMS", "MoE", "Router", "Routing",
           "Experts", "load_balancing_loss", "router_z_loss", "uncounted", "yarn_mscale", "DropPath",
           "WindowAttention", "WindowPositionBias",
           "EncoderDecoderCache", "RelativePositionBias", "relative_position_bucket"]
