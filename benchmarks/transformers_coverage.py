"""Coverage sweep of the zoo's open door for transformers models (`libai_zoo.models.trainable`).

For every class of transformers' causal-LM auto mapping (and, with ``--tasks``, of the
sequence- and image-classification mappings) it builds a tiny random config from the config
class's defaults (`tiny_config`: every size shrunk, every feature kept, dropouts 0), trains 3 steps
(fp32, AdamW lr 1e-3, global batch 4 of 16 random tokens, the same data everywhere) in one process
and then at each layout that applies:

    dp2_zero3   dp2, ZeRO-3 and full activation checkpointing     every class
    tp2         tensor parallelism from the model's tp plan         where ``tp_split`` is not empty
    pp2         pipeline 1F1B, 2 micro-batches, from its pp plan    where ``has_pp_plan``

and classifies each (class, layout): ``exact`` (the losses of the 3 steps within 1e-5 relative of one
process: the worst difference is reported), ``refused`` (a ConfigError, or `distributed.shard`'s
list of tp problems, before step 1: its reason) or ``failing`` (any other error, or a larger
difference). The results go to a markdown table (``--output``).

Two gloo workers are forked once and run every case: first the one-process references (split
between them), then the distributed cases, each in a process group of its own (so a case that
fails on one rank only cannot disturb the next; its collectives time out after ``--timeout``). A
worker that dies takes its case with it: the case is recorded as failing and new workers carry on.

    python benchmarks/transformers_coverage.py                       # every causal LM (CPU, 2 cores)
    python benchmarks/transformers_coverage.py --only llama,gpt2 --output /tmp/coverage.md
    python benchmarks/transformers_coverage.py --tasks causal_lm,sequence_classification
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import math
import os
import platform
import re
import shlex
import signal
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import transformers
from torch.multiprocessing.spawn import ProcessException
from transformers.models.auto import modeling_auto

from libai_zoo import distributed
from libai_zoo.config import FULL, ConfigError, PipelineSettings
from libai_zoo.engine import TrainStep
from libai_zoo.models import trainable
from libai_zoo.models.auto import MODELS
from libai_zoo.optim.param_groups import unique_parameters
from libai_zoo.parallel import DataParallel, materialize, parallelize

#: task -> (transformers' auto mapping of model_type to class name, its Auto class)
TASKS = {"causal_lm": ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "AutoModelForCausalLM"),
         "sequence_classification": ("MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
                                     "AutoModelForSequenceClassification"),
         "image_classification": ("MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES", "AutoModelForImageClassification")}
#: layout -> (dp, tp, pp)
LAYOUTS = {"dp2_zero3": (2, 1, 1), "tp2": (1, 2, 1), "pp2": (1, 1, 2)}
WORLD = 2
STEPS, BATCH, SEQ, LR, TOLERANCE = 3, 4, 16, 1e-3, 1e-5

# ---------------------------------------------------------------------------- the tiny configs
HIDDEN, MIN_HIDDEN, LAYERS, HEADS, HEAD_DIM, KV_HEADS, VOCAB = 64, 32, 4, 4, 16, 2, 128
EXPERTS, TOP_K, POSITIONS, WINDOW = 4, 2, 64, 8
#: Token ids a config names that lie past VOCAB go to the last SPECIALS ids, which the data never draws.
SPECIALS = 8
IMAGE_SIZE, PATCH = 32, 8
HIDDEN_KEYS = ("hidden_size", "n_embd", "d_model", "n_embed", "emb_dim", "embedding_dim", "dim")
HEAD_KEYS = ("num_attention_heads", "n_head", "n_heads", "num_heads", "attention_heads", "decoder_attention_heads")
HEAD_DIM_KEYS = ("head_dim", "attention_head_dim", "d_head", "dim_head", "kv_channels", "attention_head_size")
LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers", "num_decoder_layers",
              "num_blocks", "encoder_layers", "num_encoder_layers")


class Scale:
    """How one (sub-)config shrinks: head counts by ``heads``, per-head sizes by ``dims``, widths
    (hidden, intermediate: a count times a size) by ``heads × dims``, so the products a config
    relates (hidden = heads × head_dim, an SSM's heads × head size = expand × hidden) still hold;
    per-layer settings from ``layers`` layers to the LAYERS ones of ``sources`` (`_sources`)."""

    def __init__(self, config: dict, parent: Scale | None):
        if parent is not None:  # one scale for the whole config: sub-configs that meet keep their sizes alike
            self.heads, self.dims = parent.heads, parent.dims
        else:
            # the widest of the config and its sub-configs sets the scale (its sizes divide exactly)
            subs = [sub for sub in (config, *config.values()) if isinstance(sub, dict) and _first(sub, HIDDEN_KEYS)]
            main = max(subs, key=lambda sub: (_first(sub, HEAD_KEYS) is not None, _first(sub, HIDDEN_KEYS)),
                       default=config)
            hidden, heads = _first(main, HIDDEN_KEYS), _first(main, HEAD_KEYS)
            self.heads = max(heads / HEADS, 1.0) if heads else 1.0
            head_dim = _first(main, HEAD_DIM_KEYS) or (hidden / heads if hidden and heads else None)
            self.dims = max(head_dim / HEAD_DIM, 1.0) if head_dim else 1.0
            if hidden and (not heads or hidden / self.width < MIN_HIDDEN):  # no attention (an SSM), or heads ×
                self.dims = max(hidden / HIDDEN / self.heads, 1.0)          # head size far above hidden (MLA)
        self.layers = _first(config, LAYER_KEYS) or (parent.layers if parent is not None else None)
        self.attention_heads = _first(config, HEAD_KEYS)
        self.sources: list[int] | None = None

    @property
    def width(self) -> float:
        return self.heads * self.dims


def _first(config: dict, keys: tuple[str, ...]) -> int | None:
    return next((config[k] for k in keys if isinstance(config.get(k), int) and not isinstance(config[k], bool)), None)


def _size(value: int, factor: float, floor: int = 1, multiple: int = 2) -> int:
    """`value` / `factor`, at least `floor` (or `value`, if smaller); a multiple of `multiple` (else
    of 2) when `value` is and the result is that much (rotary halves, tp halves; fp32 grouped GEMMs
    want widths of 16-byte strides)."""
    tiny = max(min(value, floor), round(value / factor))
    for step in (multiple, 2):
        if value % step == 0 and tiny >= step:
            return step * round(tiny / step)
    return tiny


def _hashable(value: Any) -> Any:
    return json.dumps(value, sort_keys=True) if isinstance(value, (list, dict)) else value


def _scalar(key: str, value: int | float, scale: Scale, tokens: dict) -> int | float:
    """The tiny value of one numeric attribute, by its name: dropouts and jitter 0, token ids inside
    the vocabulary, layer counts LAYERS (periods 2, layer indexes the same share of the stack),
    head counts by `Scale` (the main config's heads become HEADS), fewer kv heads KV_HEADS, experts EXPERTS of top-k
    TOP_K, vocabularies VOCAB, positions POSITIONS, windows and chunks WINDOW, per-head sizes and
    widths by `Scale`; anything else as it is."""
    if isinstance(value, float):
        return 0.0 if re.search(r"drop|jitter", key) else value
    if re.search(r"token_(id|index|ids)$", key):
        return value if value < VOCAB else tokens.setdefault(value, VOCAB - 1 - len(tokens) % SPECIALS)
    if key in LAYER_KEYS:
        return min(value, LAYERS)
    if re.search(r"period|freq|interval|group_size|sparse_step", key):
        return min(value, 2)
    if re.search(r"offset", key) and "vocab" not in key:
        return min(value, 1)
    if re.search(r"key_value_heads|kv_heads|query_groups|query_group_num", key):
        if scale.attention_heads is None or value >= scale.attention_heads:  # as many as the heads
            return max(1, round(value / scale.heads))
        return KV_HEADS
    if re.search(r"heads|^n_head|n_groups", key):
        return max(1, round(value / scale.heads))
    if re.search(r"index_topk$", key):
        return min(value, WINDOW)
    if re.search(r"experts_per_tok|moe_k$|topk|top_k|num_expert_group|n_group$", key):
        return min(value, TOP_K)
    if re.search(r"topk_group", key):
        return min(value, 1)
    if re.search(r"(num|n|moe_num|num_local|n_routed|zero)_experts?(_num)?$", key):
        return min(value, EXPERTS)
    if re.search(r"vocab", key) and "divisible" not in key:
        return min(value, VOCAB)
    if re.search(r"max_position|positions$|^n_ctx$|max_seq_len|context_length|model_max_length", key):
        return min(value, POSITIONS)
    if re.search(r"sliding_window(_size)?$|window_size|window_len|local_attention$|attention_chunk_size|"
                 r"chunk_?size|chunk_length|block_size", key):
        return min(value, WINDOW)
    if re.search(r"head_dim|headdim|head_size|d_head|dim_head|kv_channels|d_kv$|d_rel|rotary_dim|state_size|"
                 r"d_state|dt_rank", key):
        return _size(value, scale.dims)
    if re.search(r"rank$", key):
        return _size(value, scale.width, floor=8, multiple=8)
    if re.search(r"hidden|n_embd|d_model|n_embed|emb_dim|embedding_dim|embedding_size|intermediate|ffn|d_ff|dff|"
                 r"dim_ff|d_inner|_width|d_ssm|feed_forward_size|input_size|^dim$|_dim$", key):
        return _size(value, scale.width, floor=8, multiple=8)
    if re.search(r"layer|dense_replace", key):  # a layer index or count: the same share of the stack
        if scale.layers is None or value <= 0:
            return value
        tiny = max(1, round(value * LAYERS / scale.layers))
        return tiny if value >= scale.layers else min(tiny, LAYERS - 1)
    if key in ("image_size",):
        return min(value, IMAGE_SIZE)
    if key in ("patch_size",):
        return min(value, PATCH)
    return value


def _shrink_value(key: str, value: Any, scale: Scale, tokens: dict) -> Any:
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, (int, float)):
        return _scalar(key, value, scale, tokens)
    kind = _per_layer(key, value, scale.layers)
    if kind == "list":
        return [_shrink_value(key, value[i], scale, tokens) for i in scale.sources]
    if kind == "indexes":
        return [new for new, i in enumerate(scale.sources) if i in value]
    if kind == "pattern":
        return "".join(value[i] for i in scale.sources)
    if kind == "overrides":
        width = max(len(k) for k in value)
        return {str(new).zfill(width): _shrink(value[str(i).zfill(width)], scale, tokens)
                for new, i in enumerate(scale.sources) if str(i).zfill(width) in value}
    if isinstance(value, dict):
        if "model_type" in value:
            return _shrink(value, scale, tokens)
        if re.search(r"rope", key):
            return _shrink_rope(value, scale)
        return {k: _shrink_value(k, v, scale, tokens) for k, v in value.items()}
    if isinstance(value, list):
        return [_shrink_value(key, v, scale, tokens) if isinstance(v, (int, float, dict)) else v for v in value]
    return value


def _per_layer(key: str, value: Any, layers: int | None) -> str | None:
    """How `value` describes the layers one by one: "list" (a value per layer), "indexes" (of the
    layers that have some property), "pattern" (a character per layer), "overrides" (layer index ->
    config overrides); None: it does not."""
    if not layers or layers <= LAYERS:
        return None
    if isinstance(value, list) and len(value) == layers:
        return "list"
    if (isinstance(value, list) and value and re.search(r"layer|idx|ids", key) and
            all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < layers for v in value)):
        return "indexes"
    if isinstance(value, str) and len(value) == layers and "pattern" in key:
        return "pattern"
    if key == "per_layer_config" and isinstance(value, dict):
        return "overrides"
    return None


def _sources(config: dict, layers: int) -> list[int]:
    """Which of the config's `layers` layers the LAYERS tiny ones copy: one of each kind (the
    combination of every per-layer setting: its layer type, MLP kind, RoPE or not, overrides...),
    in order of first appearance, repeated, so every kind is kept and each pipeline stage (and the
    layers sharing another's KV cache) meets them all; the first LAYERS layers when nothing varies."""
    columns = []
    for key, value in config.items():
        kind = _per_layer(key, value, layers)
        if kind in ("list", "pattern"):
            columns.append([_hashable(v) for v in value])
        elif kind == "indexes":
            columns.append([i in value for i in range(layers)])
        elif kind == "overrides":
            width = max(map(len, value))
            columns.append([_hashable(value.get(str(i).zfill(width))) for i in range(layers)])
    first: dict[tuple, int] = {}
    for index, signature in enumerate(zip(*columns)):
        first.setdefault(signature, index)
    kinds = list(first.values()) if columns else list(range(LAYERS))
    return [kinds[i % len(kinds)] for i in range(LAYERS)]


def _shrink_rope(rope: dict, scale: Scale) -> dict:
    """RoPE parameters: per-frequency factor lists (longrope) cut to the tiny rotary half; nested
    per-layer-type parameters alike."""
    out = {}
    for key, value in rope.items():
        if isinstance(value, dict):
            out[key] = _shrink_rope(value, scale)
        elif isinstance(value, list) and key.endswith("_factor"):
            out[key] = value[:max(1, round(len(value) / scale.dims))]
        else:
            out[key] = value
    return out


def _shrink(config: dict, parent: Scale | None, tokens: dict) -> dict:
    scale = Scale(config, parent)
    scale.sources = _sources(config, scale.layers) if scale.layers and scale.layers > LAYERS else None
    return {key: _shrink_value(key, _filled(key, value, config), scale, tokens) for key, value in config.items()}


def _filled(key: str, value: Any, config: dict) -> Any:
    """A setting a default leaves None that the model reads as a value: the head size from hidden /
    heads, the kv heads as many as the heads, the experts and their top-k as in the tiny configs, the
    language of a per-language model."""
    if value is not None:
        return value
    hidden, heads = _first(config, HIDDEN_KEYS), _first(config, HEAD_KEYS)
    if key in HEAD_DIM_KEYS and hidden and heads:
        return hidden // heads
    if re.search(r"key_value_heads|kv_heads", key) and heads:
        return heads
    if re.search(r"(num|n_routed|num_local)_experts$", key):
        return EXPERTS
    if re.search(r"experts_per_tok", key):
        return TOP_K
    if re.search(r"shared_experts$", key):
        return 1
    if key == "default_language" and config.get("languages"):  # a per-language adapter model
        return config["languages"][0]
    return value


def tiny_config(task: str, model_type: str) -> transformers.PretrainedConfig:
    """The config class's defaults with every size shrunk and every option kept (`_scalar`)."""
    config_class = transformers.CONFIG_MAPPING[model_type]
    tiny = _shrink(config_class().to_dict(), None, {})
    if task == "causal_lm" and "is_decoder" in tiny:  # an encoder's class as a causal LM: its decoder mode
        tiny["is_decoder"] = True
    if task == "sequence_classification":
        tiny["num_labels"] = 2
        if tiny.get("pad_token_id") is None:
            tiny["pad_token_id"] = VOCAB - 1
    return config_class.from_dict(tiny)


def build(task: str, model_type: str, declared: dict) -> torch.nn.Module:
    """transformers' own task model of the tiny config, made trainable (under the caller's device);
    `declared` gets what it declares: "tp" (a tp plan, then tp_split not empty), "pp" (a pp plan)."""
    auto = getattr(transformers, TASKS[task][1])
    model = auto.from_config(tiny_config(task, model_type))
    declared.update(tp=bool(getattr(model, "_tp_plan", None)), pp=bool(getattr(model.base_model, "_pp_plan", None)))
    model = trainable(model)
    declared.update(tp=bool(model.tp_split), pp=model.has_pp_plan)
    return model


def global_batches(task: str, config: transformers.PretrainedConfig) -> list[dict[str, torch.Tensor]]:
    """STEPS fixed random global batches, the same at every layout."""
    batches = []
    for step in range(STEPS):
        generator = torch.Generator().manual_seed(step)
        if task == "image_classification":
            size = getattr(config, "image_size", IMAGE_SIZE)
            size = size[0] if isinstance(size, (list, tuple)) else size
            pixels = torch.randn(BATCH, getattr(config, "num_channels", 3), size, size, generator=generator)
            batches.append({"pixel_values": pixels, "labels": torch.randint(0, 2, (BATCH,), generator=generator)})
            continue
        ids = torch.randint(0, VOCAB - SPECIALS, (BATCH, SEQ), generator=generator)
        labels = ids if task == "causal_lm" else torch.randint(0, 2, (BATCH,), generator=generator)
        batches.append({"input_ids": ids, "labels": labels})
    return batches


def micro_batches(batch: dict[str, torch.Tensor], layout: str, rank: int) -> list[dict[str, torch.Tensor]]:
    """This rank's micro-batches of a global batch at `layout` ("one": one process)."""
    if layout == "dp2_zero3":
        share = BATCH // WORLD
        return [{k: v[rank * share:(rank + 1) * share] for k, v in batch.items()}]
    if layout == "pp2":
        half = BATCH // 2
        return [{k: v[:half] for k, v in batch.items()}, {k: v[half:] for k, v in batch.items()}]
    return [batch]


# ---------------------------------------------------------------------------- one case
class Refused(Exception):
    """A refusal before step 1, with its reason."""


def _first_line(error: BaseException) -> str:
    line = next((text for text in str(error).splitlines() if text.strip()), "")
    return f"{type(error).__name__}: {line.strip()[:200]}"


def _is_refusal(error: BaseException) -> bool:
    """A ConfigError, or `distributed.shard`'s ValueError listing what does not split."""
    if isinstance(error, ConfigError):
        return True
    frames = traceback.extract_tb(error.__traceback__)
    return isinstance(error, ValueError) and any(f.filename.endswith(os.path.join("distributed", "shard.py"))
                                                 for f in frames)


def _reason(error: BaseException) -> str:
    lines = [text.strip() for text in str(error).splitlines() if text.strip()]
    return " ".join(lines)[:300]


def _train(task: str, model_type: str, layout: str, rank: int, declared: dict) -> list[float]:
    """The losses of STEPS steps at `layout` ("one": this process alone); `declared` gets the
    model's plans (`build`). Raises Refused for a refusal before step 1, the error itself otherwise."""
    torch.manual_seed(0)
    started = False
    try:
        with torch.device("meta"):
            model = build(task, model_type, declared)
        if layout == "one":
            parts, pipeline, data_parallel, device = [model], None, None, torch.device("cpu")
            materialize(model, device, seed=0)
        else:
            pp = LAYOUTS[layout][2]
            ctx = distributed.get_context()
            data_parallel = DataParallel(ctx, 3 if layout == "dp2_zero3" else 0)
            built = parallelize(model, ctx, data_parallel, num_micro_batches=2 if pp > 1 else 1,
                                pipeline=PipelineSettings("1f1b", 1) if pp > 1 else None,
                                activation_checkpoint=FULL if layout == "dp2_zero3" else None)
            parts, pipeline, device = built.parts, built.pipeline, ctx.device
            aliases = pipeline.tied.aliases() if pipeline is not None else None
            for part in parts:
                materialize(part, device, seed=0, model=built.model, aliases=aliases)
        parts = [part.train() for part in parts]
        optimizer = torch.optim.AdamW(unique_parameters(parts), lr=LR)
        step = TrainStep(parts, optimizer, ctx=ctx, data_parallel=data_parallel, pipeline=pipeline,
                         clip_grad_norm=1.0)
        losses = []
        for batch in global_batches(task, model.config):
            started = True
            losses.append(float(step(micro_batches(batch, layout, rank)).loss))
        return losses
    except Exception as error:
        if not started and _is_refusal(error):
            raise Refused(_reason(error)) from error
        raise


def _outcome(run: Callable[[dict], list[float]]) -> dict:
    """{"status": "ok" | "refused" | "error", "detail" | "losses", "tp", "pp"} of one run
    (`run(declared)`: the losses)."""
    declared = {}
    try:
        losses = run(declared)
    except Refused as refused:
        return {"status": "refused", "detail": str(refused), **declared}
    except Exception as error:  # one failure never stops the sweep
        return {"status": "error", "detail": _first_line(error), **declared}
    if not all(math.isfinite(loss) for loss in losses):
        return {"status": "error", "detail": f"loss not finite: {losses}", **declared}
    return {"status": "ok", "losses": losses, **declared}


class _Alarm(Exception):
    """A case past its time limit (SIGALRM)."""


def _alarm(signum, frame):
    raise _Alarm("no result within the case's time limit")


# ---------------------------------------------------------------------------- the workers
def _append(path: Path, record: dict) -> None:
    with path.open("a") as file:
        file.write(json.dumps(record) + "\n")


def read_records(work: Path) -> dict:
    """Every finished case's record (key -> record), from every rank's record file."""
    return {tuple(record["key"]): record for record in _records(*sorted(work.glob("records.rank*.jsonl")))
            if "key" in record}


def _records(*paths: Path) -> list[dict]:
    return [json.loads(line) for path in paths if path.exists() for line in path.read_text().splitlines()]


def _wait_for(path: Path, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


#: What a rank reports when another rank failed first (its collectives broke or timed out).
SECONDARY = re.compile(r"gloo|timed out|timeout|connection closed|no result within", re.IGNORECASE)


def _merge(outcomes: list[dict]) -> dict:
    """One record of a distributed case from its ranks' outcomes: the error that caused the others
    (not a broken or timed-out collective) first, then any error, then a refusal."""
    errors = sorted((o for o in outcomes if o["status"] == "error"), key=lambda o: bool(SECONDARY.search(o["detail"])))
    if errors:
        return errors[0]
    refused = [o for o in outcomes if o["status"] == "refused"]
    return refused[0] if refused else outcomes[0]


def _worker(rank: int, cases: list[tuple], work: str, run: str, timeout: float) -> None:
    """Run the references of this rank's share of the classes, then every distributed case (`run`:
    this start's folder of markers, outcomes and rendezvous files)."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD))
    torch.set_num_threads(1)
    _quiet()
    signal.signal(signal.SIGALRM, _alarm)
    work, run = Path(work), Path(run)
    records = work / f"records.rank{rank}.jsonl"
    done = read_records(work)
    references = [case for case in cases if case[2] == "one"]
    for index, key in enumerate(references):
        if index % WORLD != rank or key in done:
            continue
        _append(records, {"started": key})
        signal.alarm(int(timeout * 2))
        outcome = _outcome(lambda declared: _train(key[0], key[1], "one", rank, declared))
        signal.alarm(0)
        _append(records, {"key": key, **outcome})
    (run / f"references.rank{rank}").touch()
    for other in range(WORLD):
        _wait_for(run / f"references.rank{other}", timeout=math.inf)
    done = read_records(work)
    for index, key in enumerate(cases):
        reference = done.get((key[0], key[1], "one"), {})
        if key[2] == "one" or key in done or reference.get("status") != "ok" or \
                key[2] == "tp2" and not reference["tp"] or key[2] == "pp2" and not reference["pp"]:
            continue
        _append(records, {"started": key})
        record = _distributed_case(key, index, rank, run, timeout)
        if rank == 0:
            _append(records, record)


def _distributed_case(key: tuple, index: int, rank: int, run: Path, timeout: float) -> dict:
    """One (class, layout) on both ranks, in a process group of its own: rank 0 returns the record
    (the others their outcome)."""
    task, model_type, layout = key
    dist.init_process_group("gloo", init_method=f"file://{run}/group{index}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=timeout))
    dp, tp, pp = LAYOUTS[layout]

    def train(declared: dict) -> list[float]:
        distributed.init(dp=dp, tp=tp, pp=pp, timeout=timeout)
        try:
            return _train(task, model_type, layout, rank, declared)
        finally:
            distributed.destroy()

    signal.alarm(int(timeout * 2))
    outcome = _outcome(train)
    signal.alarm(0)
    written = run / f"outcome{index}.rank{rank}.json"
    written.with_suffix(".tmp").write_text(json.dumps(outcome))
    written.with_suffix(".tmp").rename(written)  # whole when rank 0 sees it
    dist.destroy_process_group()
    if rank != 0:
        return outcome
    outcomes = [outcome]
    for other in range(1, WORLD):
        path = run / f"outcome{index}.rank{other}.json"
        outcomes.append(json.loads(path.read_text()) if _wait_for(path, timeout * 3)
                        else {"status": "error", "detail": f"rank {other} gave no result"})
    return {"key": key, **_merge(outcomes)}


def _quiet() -> None:
    transformers.logging.set_verbosity_error()
    logging.getLogger("libai_zoo").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")


# ---------------------------------------------------------------------------- the sweep
def classes(tasks: list[str], only: set[str] | None) -> list[tuple[str, str, str]]:
    """(task, model_type, class name) of every class of the tasks' auto mappings."""
    rows = []
    for task in tasks:
        mapping = getattr(modeling_auto, TASKS[task][0])
        rows += [(task, model_type, name) for model_type, name in mapping.items()
                 if only is None or model_type in only]
    return rows


def sweep(rows: list[tuple[str, str, str]], layouts: list[str], work: Path, timeout: float) -> dict:
    """Every case's record (key (task, model_type, layout) -> record), forking 2 gloo workers once
    (again only if a worker dies: the case it was running is recorded as failing)."""
    cases = [(task, model_type, layout) for task, model_type, _ in rows for layout in ("one", *layouts)]
    for attempt in range(len(cases) + 1):
        run = work / f"run{attempt}"
        run.mkdir()
        try:
            mp.start_processes(_worker, args=(cases, str(work), str(run), timeout), nprocs=WORLD,
                               start_method="fork")
            return read_records(work)
        except ProcessException as died:
            done = read_records(work)
            started = [tuple(json.loads(line)["started"]) for line in
                       (work / f"records.rank{died.error_index}.jsonl").read_text().splitlines()
                       if "started" in line] if (work / f"records.rank{died.error_index}.jsonl").exists() else []
            lost = [key for key in dict.fromkeys(started) if key not in done]
            if not lost:
                raise
            _append(work / "records.rank0.jsonl", {"key": lost[-1], "status": "error",
                                                   "detail": f"worker died: {str(died).splitlines()[0]}"})
    raise RuntimeError("the workers kept dying")


def classify(record: dict | None, reference: dict) -> tuple[str, str]:
    """(exact | refused | failing | n/a, detail) of one (class, layout) against its reference."""
    if reference["status"] == "refused":
        return "refused", reference["detail"]
    if reference["status"] != "ok":
        return "failing", f"one process: {reference['detail']}"
    if record is None:
        return "n/a", ""
    if record["status"] == "refused":
        return "refused", record["detail"]
    if record["status"] != "ok":
        return "failing", record["detail"]
    worst = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(record["losses"], reference["losses"]))
    return ("exact", f"{worst:.0e}") if worst <= TOLERANCE else ("failing", f"loss differs by {worst:.1e}")


def _cell(outcome: tuple[str, str]) -> str:
    status, detail = outcome
    text = {"exact": f"exact {detail}", "n/a": "n/a"}.get(status, f"{status}: {detail}")
    return text.replace("|", "\\|").replace("\n", " ")


def report(rows: list[tuple[str, str, str]], layouts: list[str], records: dict, command: str,
           seconds: float) -> str:
    """The markdown results: header, counts per layout, one row per class."""
    lines = ["# transformers coverage: libai_zoo.models.trainable on every class of transformers' auto mappings",
             "",
             f"- date: {datetime.date.today().isoformat()}",
             f"- torch {torch.__version__}, transformers {transformers.__version__}, "
             f"Python {platform.python_version()}",
             f"- machine: CPU ({platform.processor() or platform.machine()}), {os.cpu_count()} cores, "
             f"2 gloo workers; fp32",
             f"- command: `{command}` ({seconds / 60:.1f} min)",
             f"- each case: {STEPS} steps, AdamW lr {LR}, global batch {BATCH} × {SEQ} tokens, the same data at "
             f"every layout; exact = every step's loss within {TOLERANCE:.0e} relative of one process",
             "- dp2_zero3: dp2 with ZeRO-3 and full activation checkpointing (every class); tp2: tensor "
             "parallelism from the tp plan (classes whose made-trainable model has tp_split); pp2: 1F1B with "
             "2 micro-batches (classes with a pp plan)",
             ""]
    outcomes = {}
    for task, model_type, _ in rows:
        reference = records.get((task, model_type, "one"), {"status": "error", "detail": "no result"})
        for layout in layouts:
            applies = layout == "dp2_zero3" or reference.get({"tp2": "tp", "pp2": "pp"}[layout], False)
            outcome = classify(records.get((task, model_type, layout)), reference)
            outcomes[task, model_type, layout] = outcome if applies or outcome[0] != "n/a" else ("n/a", "")
    for task in dict.fromkeys(task for task, _, _ in rows):
        task_rows = [row for row in rows if row[0] == task]
        lines += [f"## {task}: {len(task_rows)} classes", "",
                  "| layout | applies to | exact | refused | failing | exact % |", "|---|---|---|---|---|---|"]
        for layout in layouts:
            statuses = [outcomes[task, model_type, layout][0] for _, model_type, _ in task_rows]
            if layout == "dp2_zero3":
                base = len(task_rows)
            else:
                key = {"tp2": "tp", "pp2": "pp"}[layout]
                base = sum(bool(records.get((task, mt, "one"), {}).get(key)) for _, mt, _ in task_rows)
            counts = [statuses.count(s) for s in ("exact", "refused", "failing")]
            share = f"{100 * counts[0] / base:.0f}%" if base else "-"
            lines.append(f"| {layout} | {base} | {counts[0]} | {counts[1]} | {counts[2]} | {share} |")
        lines += ["", "| model_type | class | native | tp plan | pp plan | " + " | ".join(layouts) + " |",
                  "|---" * (5 + len(layouts)) + "|"]
        for _, model_type, name in task_rows:
            reference = records.get((task, model_type, "one"), {})
            plans = ["yes" if reference.get(key) else ("no" if key in reference else "?") for key in ("tp", "pp")]
            native = "yes" if task in MODELS.get(model_type, {}) else "no"
            cells = [_cell(outcomes[task, model_type, layout]) for layout in layouts]
            lines.append(f"| {model_type} | {name} | {native} | {plans[0]} | {plans[1]} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", default="causal_lm",
                        help=f"comma-separated tasks, of {', '.join(TASKS)} (default: causal_lm)")
    parser.add_argument("--only", default=None, help="comma-separated model_types to run (default: all)")
    parser.add_argument("--layouts", default=",".join(LAYOUTS),
                        help=f"comma-separated layouts, of {', '.join(LAYOUTS)} (default: all; empty: the "
                             f"one-process references only)")
    parser.add_argument("--timeout", type=float, default=20.0,
                        help="seconds a collective waits before the case fails (default: 20)")
    parser.add_argument("--output", default=str(Path(__file__).parent / "results" / "transformers_coverage.md"),
                        help="the markdown file to write")
    args = parser.parse_args(argv)
    tasks = [task for task in args.tasks.split(",") if task]
    layouts = [layout for layout in args.layouts.split(",") if layout]
    unknown = [t for t in tasks if t not in TASKS] + [layout for layout in layouts if layout not in LAYOUTS]
    if unknown:
        parser.error(f"unknown task or layout: {', '.join(unknown)}")
    only = set(args.only.split(",")) if args.only else None
    rows = classes(tasks, only)
    _quiet()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as work:
        records = sweep(rows, layouts, Path(work), args.timeout)
    seconds = time.perf_counter() - start
    command = "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0]), *sys.argv[1:]])
    text = report(rows, layouts, records, command, seconds)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(text)
    print(text.split("\n| model_type")[0])
    print(f"written to {args.output} in {seconds / 60:.1f} min")


if __name__ == "__main__":
    main()
