"""libai_zoo.models: Hugging Face-compatible models built from `libai_zoo.layers`.

Each model reads its Hugging Face config.json unchanged, loads and saves Hugging Face weights
(`from_pretrained` / `save_pretrained`, with tensor-parallel sharding while loading) and has
the forward signature and outputs of its `transformers` twin. Every model with a loss implements
`TrainableModel`, the contract through which the engine trains it at any layout (contract.py).
"""

if __name__ != "libai_zoo.models":  # `import models` from the repository root would load a second copy of every class
    raise ImportError(f"`models/` is installed as `libai_zoo.models`: write `from libai_zoo import models` or "
                      f"`import libai_zoo.models`, not `import models` (imported here as `{__name__}`)")

from .auto import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForImageClassification,
    AutoModelForMaskedLM,
    AutoModelForSeq2SeqLM,
    AutoModelForSequenceClassification,
    AutoModelForTextEncoding,
)
from .bert import BertConfig, BertForMaskedLM, BertForSequenceClassification, BertModel
from .causal_lm import CausalLM
from .contract import Stack, TrainableModel, all_layers, check_trainable, get_layer_stack
from .deepseek_v3 import DeepseekV3Config, DeepseekV3ForCausalLM, DeepseekV3Model
from .gemma import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma2Model,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    Gemma3TextModel,
    GemmaConfig,
    GemmaForCausalLM,
    GemmaModel,
)
from .gpt2 import GPT2Config, GPT2LMHeadModel, GPT2Model
from .gpt_neox import GPTNeoXConfig, GPTNeoXForCausalLM, GPTNeoXModel
from .gpt_oss import GptOssConfig, GptOssForCausalLM, GptOssModel
from .granite import GraniteConfig, GraniteForCausalLM, GraniteModel
from .llama import LlamaConfig, LlamaForCausalLM, LlamaModel
from .mistral import MistralConfig, MistralForCausalLM, MistralModel
from .mixtral import MixtralConfig, MixtralForCausalLM, MixtralModel
from .mt5 import MT5Config, MT5EncoderModel, MT5ForConditionalGeneration, MT5Model
from .olmo2 import Olmo2Config, Olmo2ForCausalLM, Olmo2Model
from .olmoe import OlmoeConfig, OlmoeForCausalLM, OlmoeModel
from .phi3 import Phi3Config, Phi3ForCausalLM, Phi3Model
from .pretrained import PreTrainedModel
from .qwen2_moe import Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen2MoeModel
from .qwen3 import Qwen3Config, Qwen3ForCausalLM, Qwen3Model
from .qwen3_moe import Qwen3MoeConfig, Qwen3MoeForCausalLM, Qwen3MoeModel
from .roberta import RobertaConfig, RobertaForMaskedLM, RobertaForSequenceClassification, RobertaModel
from .smollm3 import SmolLM3Config, SmolLM3ForCausalLM, SmolLM3Model
from .swin import (
    SwinConfig,
    SwinForImageClassification,
    SwinModel,
    Swinv2Config,
    Swinv2ForImageClassification,
    Swinv2Model,
)
from .t5 import T5Config, T5EncoderModel, T5ForConditionalGeneration, T5Model
from .transformers_model import TransformersModel, instantiate_model, is_transformers_model, trainable
from .vit import ViTConfig, ViTForImageClassification, ViTModel

__all__ = ["PreTrainedModel", "TrainableModel", "TransformersModel", "trainable", "instantiate_model",
           "is_transformers_model", "CausalLM", "check_trainable", "get_layer_stack", "all_layers", "Stack",
           "GPT2Config", "GPT2Model", "GPT2LMHeadModel", "BertConfig", "BertModel", "BertForMaskedLM",
           "BertForSequenceClassification",
           "ViTConfig", "ViTModel", "ViTForImageClassification", "LlamaConfig", "LlamaModel", "LlamaForCausalLM",
           "GPTNeoXConfig", "GPTNeoXModel", "GPTNeoXForCausalLM", "Qwen3Config", "Qwen3Model", "Qwen3ForCausalLM",
           "MistralConfig", "MistralModel", "MistralForCausalLM", "Olmo2Config", "Olmo2Model", "Olmo2ForCausalLM",
           "GemmaConfig", "GemmaModel", "GemmaForCausalLM", "Gemma2Config", "Gemma2Model", "Gemma2ForCausalLM",
           "Gemma3TextConfig", "Gemma3TextModel", "Gemma3ForCausalLM",
           "RobertaConfig", "RobertaModel", "RobertaForMaskedLM", "RobertaForSequenceClassification", "AutoConfig",
           "AutoModel", "AutoModelForCausalLM", "AutoModelForMaskedLM", "AutoModelForSequenceClassification",
           "AutoModelForImageClassification", "Phi3Config", "Phi3Model", "Phi3ForCausalLM", "GraniteConfig",
           "GraniteModel", "GraniteForCausalLM", "SmolLM3Config", "SmolLM3Model", "SmolLM3ForCausalLM",
           "MixtralConfig", "MixtralModel", "MixtralForCausalLM", "Qwen2MoeConfig", "Qwen2MoeModel",
           "Qwen2MoeForCausalLM", "Qwen3MoeConfig", "Qwen3MoeModel", "Qwen3MoeForCausalLM", "OlmoeConfig",
           "OlmoeModel", "OlmoeForCausalLM",
           "DeepseekV3Config", "DeepseekV3Model", "DeepseekV3ForCausalLM",
           "GptOssConfig", "GptOssModel", "GptOssForCausalLM",
           "SwinConfig", "SwinModel", "SwinForImageClassification", "Swinv2Config", "Swinv2Model",
           "Swinv2ForImageClassification",
           "T5Config", "T5Model", "T5EncoderModel", "T5ForConditionalGeneration", "MT5Config", "MT5Model",
           "MT5EncoderModel", "MT5ForConditionalGeneration", "AutoModelForSeq2SeqLM", "AutoModelForTextEncoding"]
