"""The zoo class of a Hugging Face directory, picked from config.json's ``model_type`` as
transformers' own Auto classes do.

    model = AutoModelForCausalLM.from_pretrained("qwen2_dir", shard=True)    # LlamaForCausalLM
    config = AutoConfig.from_pretrained("bert_dir")                          # BertConfig
    model = AutoModelForMaskedLM.from_config(config)                         # BertForMaskedLM, random weights
    model = LazyCall(AutoModelForCausalLM.from_pretrained)(path="llama_dir")  # in a LazyConfig

`MODELS` is the one table of which zoo class serves which model type and task: the Auto classes,
`tools/convert` (``hf-to-zoo``'s default class) and the recipes read it. A new family is one row;
classes are named, not imported, so this file imports no model class. A model type without a row is
transformers' own model, made trainable (`transformers_model.py`):

    model = AutoModelForCausalLM.from_pretrained("falcon_dir")   # transformers' FalconForCausalLM, trainable
"""

from __future__ import annotations

import importlib
import logging
from pathlib import Path
from typing import ClassVar

from torch import nn
from transformers import PretrainedConfig

from libai_zoo.hf import read_config

from .pretrained import PreTrainedModel
from .transformers_model import transformers_from_config, transformers_from_pretrained

logger = logging.getLogger("libai_zoo")


def _without(kwargs: dict, key: str) -> dict:
    """`kwargs` less `key` (an option only the zoo's own classes take)."""
    if kwargs.get(key):
        raise ValueError(f"{key}={kwargs[key]!r} is for the zoo's own classes; a transformers model is split by the "
                         f"trainer (parallelize)")
    return {k: v for k, v in kwargs.items() if k != key}

# model_type -> {task -> class name in libai_zoo.models}
MODELS: dict[str, dict[str, str]] = {
    "gpt2": {"base": "GPT2Model", "causal_lm": "GPT2LMHeadModel"},
    "gpt_neox": {"base": "GPTNeoXModel", "causal_lm": "GPTNeoXForCausalLM"},
    "llama": {"base": "LlamaModel", "causal_lm": "LlamaForCausalLM"},
    "qwen2": {"base": "LlamaModel", "causal_lm": "LlamaForCausalLM"},
    "qwen3": {"base": "Qwen3Model", "causal_lm": "Qwen3ForCausalLM"},
    "mistral": {"base": "MistralModel", "causal_lm": "MistralForCausalLM"},
    "mixtral": {"base": "MixtralModel", "causal_lm": "MixtralForCausalLM"},
    "qwen2_moe": {"base": "Qwen2MoeModel", "causal_lm": "Qwen2MoeForCausalLM"},
    "qwen3_moe": {"base": "Qwen3MoeModel", "causal_lm": "Qwen3MoeForCausalLM"},
    "olmoe": {"base": "OlmoeModel", "causal_lm": "OlmoeForCausalLM"},
    "gpt_oss": {"base": "GptOssModel", "causal_lm": "GptOssForCausalLM"},
    "olmo2": {"base": "Olmo2Model", "causal_lm": "Olmo2ForCausalLM"},
    "gemma": {"base": "GemmaModel", "causal_lm": "GemmaForCausalLM"},
    "gemma2": {"base": "Gemma2Model", "causal_lm": "Gemma2ForCausalLM"},
    "gemma3_text": {"base": "Gemma3TextModel", "causal_lm": "Gemma3ForCausalLM"},
    "gemma3": {"base": "Gemma3TextModel", "causal_lm": "Gemma3ForCausalLM"},  # its text model (vision skipped)
    "phi3": {"base": "Phi3Model", "causal_lm": "Phi3ForCausalLM"},
    "granite": {"base": "GraniteModel", "causal_lm": "GraniteForCausalLM"},
    "smollm3": {"base": "SmolLM3Model", "causal_lm": "SmolLM3ForCausalLM"},
    "deepseek_v3": {"base": "DeepseekV3Model", "causal_lm": "DeepseekV3ForCausalLM"},
    "kimi_k2": {"base": "DeepseekV3Model", "causal_lm": "DeepseekV3ForCausalLM"},  # DeepSeek-V3's architecture
    "bert": {"base": "BertModel", "masked_lm": "BertForMaskedLM", "sequence_classification": "BertForSequenceClassification"},
    "roberta": {"base": "RobertaModel", "masked_lm": "RobertaForMaskedLM",
                "sequence_classification": "RobertaForSequenceClassification"},
    "vit": {"base": "ViTModel", "image_classification": "ViTForImageClassification"},
    "swin": {"base": "SwinModel", "image_classification": "SwinForImageClassification"},
    "swinv2": {"base": "Swinv2Model", "image_classification": "Swinv2ForImageClassification"},
    "t5": {"base": "T5Model", "seq2seq_lm": "T5ForConditionalGeneration", "text_encoding": "T5EncoderModel"},
    "mt5": {"base": "MT5Model", "seq2seq_lm": "MT5ForConditionalGeneration", "text_encoding": "MT5EncoderModel"},
}

# how transformers' architecture names (config.json's ``architectures``) end -> the tasks they may
# name, the first the model type has (ForConditionalGeneration: an encoder-decoder's LM, or Gemma 3's
# multimodal checkpoints, whose text model the zoo loads)
ARCHITECTURE_SUFFIXES = {"ForCausalLM": ("causal_lm",), "LMHeadModel": ("causal_lm",), "ForMaskedLM": ("masked_lm",),
                         "ForPreTraining": ("masked_lm",), "ForConditionalGeneration": ("seq2seq_lm", "causal_lm"),
                         "ForSequenceClassification": ("sequence_classification",),
                         "ForImageClassification": ("image_classification",), "EncoderModel": ("text_encoding",),
                         "Model": ("base",)}


def tasks_of(model_type: str | None, *, source: str = "config.json") -> dict[str, str]:
    """task -> class name of a `model_type`; a ValueError names the supported model types."""
    if model_type not in MODELS:
        raise ValueError(f"{source}: model_type {model_type!r} has no libai_zoo model; supported: "
                         f"{', '.join(sorted(MODELS))}")
    return MODELS[model_type]


def model_class(model_type: str | None, task: str, *, source: str = "config.json") -> type[PreTrainedModel]:
    """The zoo class for `task` of a `model_type` model; a ValueError names what is supported."""
    tasks = tasks_of(model_type, source=source)
    if task not in tasks:
        serving = sorted(t for t, row in MODELS.items() if task in row)
        raise ValueError(f"{source}: libai_zoo has no {task} model for model_type {model_type!r} (it has "
                         f"{', '.join(tasks)}); the {task} model types are {', '.join(serving) or 'none'}")
    return getattr(importlib.import_module(__package__), tasks[task])


def class_for(config: dict, *, source: str = "config.json") -> type[PreTrainedModel]:
    """The zoo class of the task config.json's ``architectures`` names; without one, the causal or
    sequence-to-sequence LM where the model type has one, else the bare body (they load any
    checkpoint of their type)."""
    tasks, names = tasks_of(config.get("model_type"), source=source), config.get("architectures") or []
    for name in names:
        named = next((t for suffix, t in ARCHITECTURE_SUFFIXES.items() if name.endswith(suffix)), ())
        task = next((t for t in named if t in tasks), None)
        if task is not None:
            return model_class(config["model_type"], task, source=source)
    if names:
        raise ValueError(f"{source}: architectures {names} have no libai_zoo model for model_type "
                         f"{config['model_type']!r}; name one of {', '.join(sorted(set(tasks.values())))}")
    task = next((t for t in ("causal_lm", "seq2seq_lm") if t in tasks), "base")
    return model_class(config["model_type"], task, source=source)


class AutoConfig:
    """The zoo config class of a directory's model_type, read from its config.json."""

    def __init__(self):
        raise TypeError("AutoConfig is not instantiated: use AutoConfig.from_pretrained(path)")

    @staticmethod
    def from_pretrained(path: str | Path) -> PretrainedConfig:
        config = read_config(path)
        return model_class(config.get("model_type"), "base", source=f"{path}/config.json").load_config(path)


class AutoModel:
    """The bare body of a directory's model_type (``task`` names the head the subclasses add)."""

    task: ClassVar[str] = "base"
    #: whether a model type the zoo has no class for is transformers' own model, made trainable (the
    #: tasks the trainer has a loss for; not the encoder-decoders' yet)
    opens_door: ClassVar[bool] = True

    def __init__(self):
        raise TypeError(f"{type(self).__name__} is not instantiated: use {type(self).__name__}.from_pretrained(path) "
                        f"or .from_config(config)")

    @classmethod
    def model_class(cls, model_type: str | None, *, source: str = "config.json") -> type[PreTrainedModel]:
        """The zoo class this Auto class builds for `model_type`."""
        return model_class(model_type, cls.task, source=source)

    @classmethod
    def from_pretrained(cls, path: str | Path, *, trust_remote_code: bool = False, **kwargs) -> nn.Module:
        """`PreTrainedModel.from_pretrained` of the zoo class for the directory's model_type (the
        same keyword arguments: shard, dtype, strict, config overrides; under ``torch.device("meta")``
        it reads only config.json, as the trainer wants); a model type the zoo has no class for is
        transformers' own model, made trainable (`transformers_from_pretrained`; code outside
        transformers runs only with ``trust_remote_code=True``)."""
        model_type = read_config(path).get("model_type")
        if model_type not in MODELS and cls.opens_door:
            logger.info("%s: model_type %r has no libai_zoo class: transformers' own model, made trainable",
                        path, model_type)
            return transformers_from_pretrained(cls.task, path, trust_remote_code=trust_remote_code,
                                                **_without(kwargs, "shard"))
        return cls.model_class(model_type, source=f"{path}/config.json").from_pretrained(path, **kwargs)

    @classmethod
    def from_config(cls, config: PretrainedConfig, *, trust_remote_code: bool = False) -> nn.Module:
        """A randomly initialised model of the config's model_type: the zoo's class, else
        transformers' own model made trainable."""
        if config.model_type not in MODELS and cls.opens_door:
            return transformers_from_config(cls.task, config, trust_remote_code=trust_remote_code)
        return cls.model_class(config.model_type, source=type(config).__name__)(config)


class AutoModelForCausalLM(AutoModel):
    task = "causal_lm"


class AutoModelForMaskedLM(AutoModel):
    task = "masked_lm"


class AutoModelForSequenceClassification(AutoModel):
    task = "sequence_classification"


class AutoModelForImageClassification(AutoModel):
    task = "image_classification"


class AutoModelForSeq2SeqLM(AutoModel):
    task = "seq2seq_lm"
    opens_door = False


class AutoModelForTextEncoding(AutoModel):
    """An encoder-decoder's encoder alone (T5EncoderModel), as transformers' class of that name."""

    task = "text_encoding"
    opens_door = False
