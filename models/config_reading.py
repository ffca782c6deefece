"""What a Hugging Face config says, read as transformers reads it: the helpers every family's
`describe` shares (rotary settings and scalings, quantized checkpoints refused, attention biases,
sliding windows per layer)."""

from __future__ import annotations

import math

from libai_zoo.utils.transformers_versions import rope_parameters, rope_theta


def rope_settings(config, params: dict | None = None) -> tuple[float, dict | None]:
    """(base, scaling) of RoPE, from ``params`` or the config's ``rope_parameters`` (transformers 5)
    or ``rope_theta`` and ``rope_scaling`` (4.x). Scalings: none, "linear", "llama3" (Llama 3.1
    and later), "longrope" (Phi-3, Phi-4: `longrope_scaling`) and "yarn" (Qwen's long contexts,
    DeepSeek-V3)."""
    if params is None:
        params = rope_parameters(config)
    params = dict(params)
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = rope_theta(params, config)
    if rope_type == "default":
        return theta, None
    if rope_type not in ("linear", "llama3", "longrope", "yarn"):
        raise ValueError(f"rope_type {rope_type!r} is not supported by libai_zoo's {config.model_type} "
                         f"(supported: default, linear, llama3, longrope, yarn)")
    if rope_type == "longrope":
        return theta, longrope_scaling(config, params)
    if rope_type == "yarn" and params.get("factor") is None:  # transformers: the context's growth
        params["factor"] = config.max_position_embeddings / params["original_max_position_embeddings"]
    return theta, {**params, "rope_type": rope_type}


def refuse_quantized(config, fix: str) -> None:
    """Refuse a config whose weights are quantized (its ``quantization_config``: the hub's gpt-oss
    MXFP4 and DeepSeek-V3 FP8 files), which libai_zoo does not read, saying how to `fix` it."""
    quantization = getattr(config, "quantization_config", None)
    if quantization:
        method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization
        raise ValueError(f"this {config.model_type} config has quantization_config ({method}): libai_zoo reads "
                         f"unquantized weights; {fix}")


def longrope_scaling(config, params: dict) -> dict:
    """LongRoPE's scaling with its defaults filled in as transformers fills them: the original
    context from the config, and the cos/sin multiplier sqrt(1 + ln(factor) / ln(original context))
    where factor (if not given) is max_position_embeddings / the original context."""
    context = params.get("original_max_position_embeddings") or config.original_max_position_embeddings
    factor = params.get("factor") or config.max_position_embeddings / context
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = math.sqrt(1 + math.log(factor) / math.log(context)) if factor > 1 else 1.0
    return {**params, "rope_type": "longrope", "original_max_position_embeddings": context,
            "attention_factor": attention_factor}


def qkv_bias(config) -> tuple[bool, bool]:
    """(biases on q/k/v, bias on o): Llama's attention_bias sets both, Qwen2 has q/k/v only."""
    if config.model_type == "qwen2":
        return True, False
    return getattr(config, "attention_bias", False), getattr(config, "attention_bias", False)


def sliding_window(config, index: int) -> int | None:
    """The window of layer `index`: the config's sliding_window on the layers `layer_types` calls
    "sliding_attention" (every layer when the config has no layer_types), None elsewhere."""
    window = getattr(config, "sliding_window", None)
    if window is None or getattr(config, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(config, "layer_types", None)
    return window if layer_types is None or layer_types[index] == "sliding_attention" else None
