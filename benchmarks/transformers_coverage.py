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
LAYERS, HEADS, HEAD_DIM, KV_HEADS, VOCAB, EXPERTS, TOP_K, POSITIONS, WINDOW = 4, 4, 16, 2, 128, 4, 2, 64, 8
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
    per-layer lists from ``layers`` entries to LAYERS."""

    def __init__(self, config: dict, parent: Scale | None):
        hidden = _first(config, HIDDEN_KEYS)
        heads = _first(config, HEAD_KEYS)
        if parent is not None and (hidden is None or heads is None):
            self.heads, self.dims, self.layers = parent.heads, parent.dims, parent.layers
        else:
            self.heads = max(heads / HEADS, 1.0) if heads else 1.0
            head_dim = _first(config, HEAD_DIM_KEYS) or (hidden / heads if hidden and heads else None)
            self.dims = max(head_dim / HEAD_DIM, 1.0) if head_dim else 1.0
            if not heads and hidden:  # no attention (an SSM, an RNN): widths shrink to 64
                self.dims = max(hidden / 64, 1.0)
            self.layers = None
        layers = _first(config, LAYER_KEYS)
        if layers is not None:
            self.layers = layers
        self.attention_heads = heads

    @property
    def width(self) -> float:
        return self.heads * self.dims


def _first(config: dict, keys: tuple[str, ...]) -> int | None:
    return next((config[k] for k in keys if isinstance(config.get(k), int) and not isinstance(config[k], bool)), None)


def _even(value: float, floor: int = 2) -> int:
    return max(floor, 2 * round(value / 2))


def _resample(values: list, n: int) -> list:
    """A per-layer list cut to `n` layers that keeps each distinct value (the later layers take the
    values the first `n` lack: Gemma 3's 5 sliding layers and 1 global become 3 and 1)."""
    out = list(values[:n])
    missing = [v for v in dict.fromkeys(map(_hashable, values)) if v not in map(_hashable, out)]
    for index, value in zip(range(n - 1, 0, -1), missing):
        out[index] = next(v for v in values if _hashable(v) == value)
    return out


def _hashable(value: Any) -> Any:
    return json.dumps(value, sort_keys=True) if isinstance(value, (list, dict)) else value


def _scalar(key: str, value: int | float, scale: Scale, tokens: dict) -> int | float:
    """The tiny value of one numeric attribute, by its name (see the table in `Scale`)."""
    if isinstance(value, float):
        return 0.0 if re.search(r"drop|jitter", key) else value
    if re.search(r"token_(id|index|ids)$", key):
        return value if value < VOCAB else tokens.setdefault(value, VOCAB - 1 - len(tokens) % SPECIALS)
    if key in LAYER_KEYS:
        return LAYERS
    if re.search(r"period|freq|interval|group_size|sparse_step", key):
        return min(value, 2)
    if re.search(r"offset", key) and "vocab" not in key:
        return min(value, 1)
    if re.search(r"layer|dense_replace", key):  # a layer index or count: the same share of the stack
        if scale.layers is None or value <= 0:
            return value
        tiny = max(1, round(value * LAYERS / scale.layers))
        return tiny if value >= scale.layers else min(tiny, LAYERS - 1)
    if re.search(r"key_value_heads|kv_heads|query_groups|query_group_num", key):
        return HEADS if scale.attention_heads is None or value >= scale.attention_heads else min(value, KV_HEADS)
    if re.search(r"heads|^n_head|n_groups", key):
        return HEADS if key in HEAD_KEYS else max(1, round(value / scale.heads))
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
        return _even(value / scale.dims, floor=min(value, 4))
    if re.search(r"rank$", key):
        return _even(value / scale.width, floor=min(value, 8))
    if re.search(r"hidden|n_embd|d_model|n_embed|emb_dim|embedding_dim|embedding_size|intermediate|ffn|d_ff|dff|"
                 r"dim_ff|d_inner|_width|d_ssm|proj_dim|embed_dim|feed_forward_size|^dim$", key):
        return _even(value / scale.width, floor=min(value, 8))
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
    if isinstance(value, dict):
        if "model_type" in value:
            return _shrink(value, scale, tokens)
        if key == "per_layer_config":  # layer index -> overrides
            return {k: _shrink(v, scale, tokens) for k, v in value.items() if not k.isdigit() or int(k) < LAYERS}
        if re.search(r"rope", key):
            return _shrink_rope(value, scale)
        return {k: _shrink_value(k, v, scale, tokens) for k, v in value.items()}
    if isinstance(value, list):
        value = [_shrink_value(key, v, scale, tokens) if isinstance(v, (int, float, dict)) else v for v in value]
        if scale.layers and len(value) == scale.layers and scale.layers > LAYERS:
            return _resample(value, LAYERS)
        if (scale.layers and value and re.search(r"layer|idx|ids", key) and len(value) < scale.layers
                and all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < scale.layers for v in value)):
            chosen = _resample([i in value for i in range(scale.layers)], LAYERS)
            return [i for i, on in enumerate(chosen) if on]
        return value
    if isinstance(value, str) and scale.layers and len(value) == scale.layers > LAYERS and "pattern" in key:
        return "".join(_resample(list(value), LAYERS))
    return value


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
    return {key: _shrink_value(key, value, scale, tokens) for key, value in config.items()}


def tiny_config(task: str, model_type: str) -> transformers.PretrainedConfig:
    """The config class's defaults with every size shrunk and every option kept (`_scalar`)."""
    config_class = transformers.CONFIG_MAPPING[model_type]
    tiny = _shrink(config_class().to_dict(), None, {})
    if task == "sequence_classification":
        tiny["num_labels"] = 2
        if tiny.get("pad_token_id") is None:
            tiny["pad_token_id"] = VOCAB - 1
    return config_class.from_dict(tiny)


def build(task: str, model_type: str) -> torch.nn.Module:
    """transformers' own task model of the tiny config, made trainable (under the caller's device)."""
    auto = getattr(transformers, TASKS[task][1])
    return trainable(auto.from_config(tiny_config(task, model_type)))


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


def _train(task: str, model_type: str, layout: str, rank: int) -> tuple[list[float], dict]:
    """The losses of STEPS steps at `layout` ("one": this process alone) and what the model
    declares ({"tp": tp_split not empty, "pp": has_pp_plan}). Raises Refused for a refusal before
    step 1, the error itself otherwise."""
    torch.manual_seed(0)
    started = False
    try:
        with torch.device("meta"):
            model = build(task, model_type)
        declared = {"tp": bool(getattr(model, "tp_split", None)), "pp": bool(getattr(model, "has_pp_plan", False))}
        if layout == "one":
            parts, pipeline, data_parallel, device = [model], None, None, torch.device("cpu")
            materialize(model, device, seed=0)
        else:
            dp, tp, pp = LAYOUTS[layout]
            ctx = distributed.get_context()
            data_parallel = DataParallel(ctx, 3 if layout == "dp2_zero3" else 0)
            built = parallelize(model, ctx, data_parallel, num_micro_batches=2 if pp > 1 else 1,
                                pipeline=PipelineSettings("1f1b", 1) if pp > 1 else None,
                                activation_checkpoint=FULL if layout == "dp2_zero3" else None)
            parts, pipeline, device = built.parts, built.pipeline, ctx.device
            aliases = pipeline.tied_aliases() if pipeline is not None else None
            for part in parts:
                materialize(part, device, seed=0, model=built.model, aliases=aliases)
        parts = [part.train() for part in parts]
        optimizer = torch.optim.AdamW(unique_parameters(parts), lr=LR)
        step = TrainStep(parts, optimizer, device=device, data_parallel=data_parallel, pipeline=pipeline,
                         clip_grad_norm=1.0)
        losses = []
        for batch in global_batches(task, model.config):
            started = True
            losses.append(float(step(micro_batches(batch, layout, rank)).loss))
        return losses, declared
    except Exception as error:
        if not started and _is_refusal(error):
            raise Refused(_reason(error)) from error
        raise


def _outcome(run: Callable[[], tuple[list[float], dict]]) -> dict:
    """{"status": "ok" | "refused" | "error", "detail", "losses", declarations} of one run."""
    try:
        losses, declared = run()
    except Refused as refused:
        return {"status": "refused", "detail": str(refused)}
    except Exception as error:  # one failure never stops the sweep
        return {"status": "error", "detail": _first_line(error)}
    if not all(math.isfinite(loss) for loss in losses):
        return {"status": "error", "detail": f"loss not finite: {losses}", **declared}
    return {"status": "ok", "losses": losses, **declared}


class _Alarm(Exception):
    pass


def _alarm(signum, frame):
    raise _Alarm("no result within the case's time limit")


# ---------------------------------------------------------------------------- the workers
def _append(path: Path, record: dict) -> None:
    with path.open("a") as file:
        file.write(json.dumps(record) + "\n")


def read_records(work: Path) -> tuple[dict, list]:
    """(key -> the finished record, the keys started) from every rank's record file."""
    done, started = {}, []
    for path in sorted(work.glob("records.rank*.jsonl")):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if "started" in record:
                started.append(tuple(record["started"]))
            else:
                done[tuple(record["key"])] = record
    return done, started


def _wait_for(path: Path, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _merge(outcomes: list[dict]) -> dict:
    """One record of a distributed case from its ranks' outcomes: an error that is not a timeout
    (the cause) before one that is (a rank waiting for the failed one), then a refusal."""
    errors = [o for o in outcomes if o["status"] == "error"]
    if errors:
        return min(errors, key=lambda o: "timed out" in o["detail"].lower() or "Timeout" in o["detail"])
    refused = [o for o in outcomes if o["status"] == "refused"]
    return refused[0] if refused else outcomes[0]


def _worker(rank: int, cases: list[tuple], work: str, timeout: float) -> None:
    """Run the references of this rank's share of the classes, then every distributed case."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD))
    torch.set_num_threads(1)
    _quiet()
    signal.signal(signal.SIGALRM, _alarm)
    work = Path(work)
    records = work / f"records.rank{rank}.jsonl"
    done, _ = read_records(work)
    references = [case for case in cases if case[2] == "one"]
    for index, key in enumerate(references):
        if index % WORLD != rank or key in done:
            continue
        _append(records, {"started": key})
        signal.alarm(int(timeout * 2))
        outcome = _outcome(lambda: _train(key[0], key[1], "one", rank))
        signal.alarm(0)
        _append(records, {"key": key, **outcome})
    (work / f"references.rank{rank}").touch()
    for other in range(WORLD):
        _wait_for(work / f"references.rank{other}", timeout=math.inf)
    done, _ = read_records(work)
    for index, key in enumerate(cases):
        if key[2] == "one" or key in done or done.get((key[0], key[1], "one"), {}).get("status") != "ok":
            continue
        reference = done[(key[0], key[1], "one")]
        if key[2] == "tp2" and not reference["tp"] or key[2] == "pp2" and not reference["pp"]:
            continue
        if rank == 0:
            _append(records, {"started": key})
        _append(records, _distributed_case(key, index, rank, work, timeout) if rank == 0 else {"started": key})
        if rank != 0:
            _distributed_case(key, index, rank, work, timeout)


def _distributed_case(key: tuple, index: int, rank: int, work: Path, timeout: float) -> dict:
    """One (class, layout) on both ranks, in a process group of its own; rank 0 returns the record."""
    task, model_type, layout = key
    dist.init_process_group("gloo", init_method=f"file://{work}/group{index}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=timeout))
    dp, tp, pp = LAYOUTS[layout]

    def run() -> tuple[list[float], dict]:
        distributed.init(dp=dp, tp=tp, pp=pp, timeout=timeout)
        try:
            return _train(task, model_type, layout, rank)
        finally:
            distributed.destroy()

    signal.alarm(int(timeout * 2))
    outcome = _outcome(run)
    signal.alarm(0)
    (work / f"outcome{index}.rank{rank}.json").write_text(json.dumps(outcome))
    dist.destroy_process_group()
    if rank != 0:
        return outcome
    outcomes = [outcome]
    for other in range(1, WORLD):
        path = work / f"outcome{index}.rank{other}.json"
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
    (again only if a worker dies: its case is recorded as failing)."""
    cases = [(task, model_type, layout) for task, model_type, _ in rows for layout in ("one", *layouts)]
    while True:
        try:
            mp.start_processes(_worker, args=(cases, str(work), timeout), nprocs=WORLD, start_method="fork")
            return read_records(work)[0]
        except mp.ProcessException as died:
            done, started = read_records(work)
            lost = [key for key in started if key not in done]
            if not lost:
                raise
            for key in lost:
                _append(work / "records.rank0.jsonl",
                        {"key": key, "status": "error", "detail": f"worker died: {str(died).splitlines()[0]}"})


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
    lines = [f"# transformers coverage: libai_zoo.models.trainable on every class of transformers' auto mappings",
             "",
             f"- date: {datetime.date.today().isoformat()}",
             f"- torch {torch.__version__}, transformers {transformers.__version__}, Python {platform.python_version()}",
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
            plans = ["yes" if reference.get(key) else ("no" if reference.get("status") == "ok" else "?")
                     for key in ("tp", "pp")]
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
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="seconds a collective waits before the case fails (default: 120)")
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
