"""3-D parallel training equals one process: the same config, global batch and data trained for
10 steps under data, tensor and pipeline parallelism and ZeRO 1-3 logs the one-process loss at
every step (≤ 1e-5 relative), for a tiny GPT-2 and a tiny Llama; a checkpoint written at
dp2×tp2 with ZeRO-3 resumes at other layouts; bad layouts fail before the first step.

All 2-process layouts share one pair of forked gloo processes and all 4-process layouts one
quartet (start-up dominates on CPU); the parent runs the one-process references.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from distributed_runner import run_distributed
from libai_zoo import distributed
from libai_zoo.config import LazyConfig
from libai_zoo.data import IndexedDatasetWriter, load_tokenizer
from libai_zoo.engine import DefaultTrainer
from libai_zoo.layers import LMHead
from libai_zoo.utils import gradient_bytes, optimizer_state_bytes, parameter_bytes
from trainer_runs import losses, records, run_trainer

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
STEPS, GLOBAL_BATCH, TOL = 10, 8, 1e-5

CONFIG = '''
from libai_zoo.config import LazyCall, get_config
from libai_zoo.data import build_gpt_dataset
from libai_zoo.models import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

train = get_config("common/train.py").train
dist = get_config("common/train.py").dist
optim = get_config("common/optim.py").optim
models = dict(
    gpt2=LazyCall(GPT2LMHeadModel)(config=LazyCall(GPT2Config)(
        vocab_size=8192, n_positions=32, n_embd=32, n_layer=4, n_head=4, bos_token_id=0, eos_token_id=0,
        embd_pdrop=0.0, attn_pdrop=0.0, resid_pdrop=0.0)),
    llama=LazyCall(LlamaForCausalLM)(config=LazyCall(LlamaConfig)(
        vocab_size=8192, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=32, bos_token_id=0, eos_token_id=0)),
)
model = models["gpt2"]
dataloader = dict(train=LazyCall(build_gpt_dataset)(text_file="{text}", tokenizer_dir="{tokenizer}", seq_len=16,
                                                    cache_dir="{cache}"),
                  test=LazyCall(build_gpt_dataset)(text_file="{text}", tokenizer_dir="{tokenizer}", seq_len=16,
                                                   cache_dir="{cache}"))
'''

# name -> overrides; every layout trains the same global batch of 8 sequences for 10 steps.
LAYOUTS_2 = {
    "dp2": ["dist.dp=2", "train.micro_batch_size=4"],
    "tp2": ["dist.tp=2", "train.micro_batch_size=8"],
    "tp2_sp": ["dist.tp=2", "dist.sequence_parallel=true", "train.micro_batch_size=8"],
    "dp2_zero1": ["dist.dp=2", "train.zero_stage=1", "train.micro_batch_size=4"],
    "dp2_zero2": ["dist.dp=2", "train.zero_stage=2", "train.micro_batch_size=4"],
    "dp2_zero3": ["dist.dp=2", "train.zero_stage=3", "train.micro_batch_size=4"],
    "dp2_accum_ac": ["dist.dp=2", "train.micro_batch_size=1", "train.activation_checkpoint.enabled=true"],
    "pp2_1f1b": ["dist.pp=2", "train.micro_batch_size=4"],
    "pp2_interleaved": ["dist.pp=2", "train.micro_batch_size=2", "train.pipeline.schedule=interleaved_1f1b",
                        "train.pipeline.virtual_stages=2"],
    "pp2_1f1b_ac": ["dist.pp=2", "train.micro_batch_size=2", "train.activation_checkpoint.enabled=true"],
    "pp2_zero_bubble": ["dist.pp=2", "train.micro_batch_size=4", "train.pipeline.schedule=zero_bubble"],
}
LAYOUTS_4 = {
    "dp4": ["dist.dp=4", "train.micro_batch_size=2"],
    "tp4": ["dist.tp=4", "train.micro_batch_size=8"],
    "dp4_zero3": ["dist.dp=4", "train.zero_stage=3", "train.micro_batch_size=2"],
    "dp2_tp2": ["dist.dp=2", "dist.tp=2", "train.micro_batch_size=4"],
    "dp2_tp2_zero3": ["dist.dp=2", "dist.tp=2", "train.zero_stage=3", "train.micro_batch_size=4"],
    "dp2_tp2_zero3_accum_ac": ["dist.dp=2", "dist.tp=2", "train.zero_stage=3", "train.micro_batch_size=2",
                               "train.activation_checkpoint.enabled=true"],
    "pp4_gpipe": ["dist.pp=4", "train.micro_batch_size=2", "train.pipeline.schedule=gpipe"],
    "tp2_pp2": ["dist.tp=2", "dist.pp=2", "train.micro_batch_size=4"],
    "dp2_pp2": ["dist.dp=2", "dist.pp=2", "train.micro_batch_size=2"],
    # pipelines with ZeRO (FSDP2 inside each stage), one schedule each
    "dp2_pp2_zero1_1f1b": ["dist.dp=2", "dist.pp=2", "train.zero_stage=1", "train.micro_batch_size=2"],
    "dp2_pp2_zero2_gpipe": ["dist.dp=2", "dist.pp=2", "train.zero_stage=2", "train.micro_batch_size=2",
                            "train.pipeline.schedule=gpipe"],
    "dp2_pp2_zero3_interleaved": ["dist.dp=2", "dist.pp=2", "train.zero_stage=3", "train.micro_batch_size=2",
                                  "train.pipeline.schedule=interleaved_1f1b", "train.pipeline.virtual_stages=2"],
    "dp2_pp2_zero3_zero_bubble": ["dist.dp=2", "dist.pp=2", "train.zero_stage=3", "train.micro_batch_size=2",
                                  "train.pipeline.schedule=zero_bubble", "train.pipeline.virtual_stages=2"],
    "dp2_pp2_zero2_zbv": ["dist.dp=2", "dist.pp=2", "train.zero_stage=2", "train.micro_batch_size=2",
                          "train.pipeline.schedule=zbv", "train.pipeline.virtual_stages=2", "dataloader.test=null"],
}
# dp × tp × pp with ZeRO: 8 processes (2 cores run them in about a minute)
LAYOUTS_8 = {
    "dp2_tp2_pp2_zero1": ["dist.dp=2", "dist.tp=2", "dist.pp=2", "train.zero_stage=1", "train.micro_batch_size=2"],
    "dp2_tp2_pp2_zero3_interleaved": ["dist.dp=2", "dist.tp=2", "dist.pp=2", "train.zero_stage=3",
                                      "train.micro_batch_size=2", "train.pipeline.schedule=interleaved_1f1b",
                                      "train.pipeline.virtual_stages=2"],
}
MODELS = ("gpt2", "llama")


def train(config_file: str, output_dir: str, model: str, overrides: list[str], *, resume: bool = False,
          interrupt_after: int | None = None) -> dict[int, float]:
    """Run the trainer; return {step: loss} as rank 0 logged it (empty on other ranks)."""
    cfg = LazyConfig.load(config_file)
    cfg.model = cfg.models[model]
    cfg = LazyConfig.apply_overrides(cfg, [
        f"train.output_dir={output_dir}", f"train.max_iter={STEPS}", f"train.global_batch_size={GLOBAL_BATCH}",
        "train.log_period=1", "train.checkpoint.period=0", "optim.lr=3e-3", "train.clip_grad_norm=1.0",
        "train.eval.max_batches=1", *overrides])
    try:
        run_trainer(cfg, resume=resume, interrupt_after=interrupt_after)
    except KeyboardInterrupt:
        pass
    return losses(Path(output_dir))


INDEXED_LAYOUTS = {  # Megatron-format data: windows of 17 tokens as 16 inputs + 16 shift_labels
    "indexed_dp2": ["dist.dp=2", "train.micro_batch_size=4"],
    "indexed_pp2": ["dist.pp=2", "train.micro_batch_size=4"],
}


def _indexed_config(config_file: str) -> str:
    return str(Path(config_file).with_name("config_indexed.py"))


def _two_process_extras(config_file: str, out: str) -> dict:
    results = {}
    for name, overrides in INDEXED_LAYOUTS.items():
        results["gpt2", name] = train(_indexed_config(config_file), f"{out}/gpt2_{name}", "gpt2", overrides)
        results["gpt2", name, "eval"] = final_eval_loss(f"{out}/gpt2_{name}")
    return results


def final_eval_loss(output_dir: str) -> float | None:
    """The evaluation loss logged after the last step (one test batch of 8 sequences)."""
    path = Path(output_dir) / "metrics.json"
    return records(output_dir)[-1].get("eval/loss") if path.is_file() else None


def _layouts(config_file: str, out: str, layouts: dict, extra) -> dict:
    results = {}
    for model in MODELS:
        for name, overrides in layouts.items():
            results[model, name] = train(config_file, f"{out}/{model}_{name}", model, overrides)
            results[model, name, "eval"] = final_eval_loss(f"{out}/{model}_{name}")
    if extra is not None:
        results.update(extra(config_file, out))
    return results


def _errors(config_file: str, out: str) -> dict:
    """Bad layouts fail in the constructor, before the first step; the message names the fix."""
    errors = {}
    for name, overrides in {"zero_dp1": ["dist.tp=4", "train.zero_stage=2"],
                            "batch": ["dist.dp=4", "train.micro_batch_size=3"],
                            "pp_layers": ["dist.pp=4", "train.micro_batch_size=1", "train.pipeline.virtual_stages=2",
                                          "train.pipeline.schedule=interleaved_1f1b"],
                            "few_micro_batches": ["dist.pp=4", "train.micro_batch_size=4"],
                            "offload_on_cpu": ["dist.dp=4", "train.zero_stage=3", "train.zero_offload=true",
                                               "train.micro_batch_size=2"],
                            "zbv_eval": ["dist.dp=2", "dist.pp=2", "train.micro_batch_size=2",
                                         "train.pipeline.schedule=zbv", "train.pipeline.virtual_stages=2"]}.items():
        try:
            train(config_file, f"{out}/error_{name}", "gpt2", overrides)
        except Exception as error:  # noqa: BLE001 - the message is what is checked
            errors["error", name] = str(error)
    return {"errors": errors}


def _checkpoint_at_dp2_tp2_zero3(config_file: str, out: str) -> dict:
    train(config_file, f"{out}/ckpt", "gpt2", [*LAYOUTS_4["dp2_tp2_zero3"], "train.checkpoint.period=5"],
          interrupt_after=5)
    return {}


def _resume_at(layout: list[str]):
    def resume(config_file: str, out: str) -> dict:
        name = "_".join(o.split("=")[0].split(".")[-1] + o.split("=")[1] for o in layout
                        if o.startswith(("dist", "train.zero_stage")))
        target = f"{out}/resume_{name}"
        if torch.distributed.get_rank() == 0:
            shutil.copytree(f"{out}/ckpt", target)
            (Path(target) / "metrics.json").unlink()
        torch.distributed.barrier()
        return {("resume", name): train(config_file, target, "gpt2", [*layout, "train.checkpoint.period=5"],
                                        resume=True)}
    return resume


@contextmanager
def trained_one_step(config_file: str, output_dir: str, overrides: list[str]) -> Iterator[DefaultTrainer]:
    """The GPT-2 trainer after one step (its optimizer state exists); the context is torn down after."""
    cfg = LazyConfig.load(config_file)
    cfg.model = cfg.models["gpt2"]
    cfg = LazyConfig.apply_overrides(cfg, [f"train.output_dir={output_dir}", "train.max_iter=1",
                                           f"train.global_batch_size={GLOBAL_BATCH}", "train.checkpoint.period=0",
                                           *overrides])
    trainer = DefaultTrainer(cfg)
    try:
        trainer.resume_or_load(resume=False)
        trainer.train()
        yield trainer
    finally:
        distributed.destroy()


def state_bytes(config_file: str, output_dir: str, overrides: list[str]) -> int:
    """Parameter + gradient + optimizer-state bytes this rank holds after one step and a backward."""
    with trained_one_step(config_file, output_dir, overrides) as trainer:
        batch = next(iter(trainer.build_train_loader(trainer.cfg)))
        trainer.model(**batch).loss.backward()
        return (parameter_bytes(trainer.model) + gradient_bytes(trainer.model)
                + optimizer_state_bytes(trainer.optimizer))


def optimizer_bytes_per_rank(config_file: str, output_dir: str, overrides: list[str]) -> tuple[list[int], int]:
    """(AdamW state bytes of every rank after one step, state bytes of the largest parameter)."""
    with trained_one_step(config_file, output_dir, overrides) as trainer:
        per_rank = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(per_rank, optimizer_state_bytes(trainer.optimizer))
        largest = max(p.numel() for p in trainer.model.parameters()) * 4 * 2  # fp32 exp_avg + exp_avg_sq
        return per_rank, largest


def _four_process_extras(config_file: str, out: str) -> dict:
    results = {"zero3_bytes": state_bytes(config_file, f"{out}/bytes_dp4_zero3",
                                          ["dist.dp=4", "train.zero_stage=3", "train.micro_batch_size=2"]),
               "zero1_optimizer_bytes": optimizer_bytes_per_rank(config_file, f"{out}/bytes_dp4_zero1",
                                                                 ["dist.dp=4", "train.zero_stage=1",
                                                                  "train.micro_batch_size=2"])}
    results.update(_checkpoint_at_dp2_tp2_zero3(config_file, out))
    results.update(_resume_at(["dist.tp=4", "train.micro_batch_size=8"])(config_file, out))
    results.update(_resume_at(["dist.tp=2", "dist.pp=2", "train.micro_batch_size=4"])(config_file, out))
    results.update(_resume_at(["dist.dp=2", "dist.pp=2", "train.zero_stage=1", "train.micro_batch_size=2"])(
        config_file, out))
    results.update(_errors(config_file, out))
    return results


@pytest.fixture(scope="module", autouse=True)
def loss_in_chunks():
    """The training loss of every layout here runs chunk by chunk (`LMHead.loss_from_hidden`; at
    least 4 chunks per micro-batch), as a large vocabulary's would."""
    saved = LMHead.chunk_bytes
    LMHead.chunk_bytes = 8 * 8192 * 4  # 8 tokens of the 8192 vocabulary (16 at tp2)
    yield
    LMHead.chunk_bytes = saved


def write_config(root: Path) -> tuple[Path, list[str]]:
    """CONFIG over the corpus's first 200 documents, written in `root`; (its path, the documents)."""
    documents = (ROOT / "data/corpus/python_docs.txt").read_text().split("\n\n")[:200]
    (root / "text.txt").write_text("\n\n".join(documents))
    config_file = root / "config.py"
    config_file.write_text(CONFIG.format(text=root / "text.txt", tokenizer=ROOT / "data/tokenizer",
                                         cache=root / "cache"))
    return config_file, documents


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("parallel")
    config_file, documents = write_config(root)
    reference = {model: train(str(config_file), str(root / f"one_{model}"), model, ["train.micro_batch_size=8"])
                 for model in MODELS}
    reference.update({(model, "eval"): final_eval_loss(str(root / f"one_{model}")) for model in MODELS})
    tokenizer = load_tokenizer(ROOT / "data/tokenizer")
    with IndexedDatasetWriter(root / "corpus_text_document") as writer:
        for document in documents:
            writer.add_document(tokenizer(document).input_ids + [tokenizer.eos_token_id])
    text_data = 'LazyCall(build_gpt_dataset)(text_file="{text}", tokenizer_dir="{tokenizer}", seq_len=16,'
    indexed_data = f'LazyCall(build_indexed_gpt_dataset)(prefixes=["{root}/corpus_text_document"], seq_len=16,'
    indexed = CONFIG.replace(text_data, indexed_data).replace(
        "import build_gpt_dataset", "import build_gpt_dataset, build_indexed_gpt_dataset")
    (root / "config_indexed.py").write_text(indexed.format(cache=root / "cache"))
    reference["indexed"] = train(str(root / "config_indexed.py"), str(root / "one_indexed"), "gpt2",
                                 ["train.micro_batch_size=8"])
    reference["indexed", "eval"] = final_eval_loss(str(root / "one_indexed"))
    two = run_distributed(_layouts, 2, str(config_file), str(root), LAYOUTS_2, _two_process_extras)[0]
    four = run_distributed(_layouts, 4, str(config_file), str(root), LAYOUTS_4, _four_process_extras)[0]
    if (root / "ckpt").is_dir():  # the 3-D mesh resumes the dp2×tp2 ZeRO-3 checkpoint too
        four.update(run_distributed(_layouts, 8, str(config_file), str(root), LAYOUTS_8, _resume_at(
            ["dist.dp=2", "dist.tp=2", "dist.pp=2", "train.zero_stage=3", "train.micro_batch_size=2"]))[0])
    four["one_process_bytes"] = state_bytes(str(config_file), str(root / "bytes_one"), ["train.micro_batch_size=8"])
    resumed_here = root / "resume_one_process"
    shutil.copytree(root / "ckpt", resumed_here)
    (resumed_here / "metrics.json").unlink()
    four["resume", "one_process"] = train(str(config_file), str(resumed_here), "gpt2",
                                          ["train.micro_batch_size=8", "train.checkpoint.period=5"], resume=True)
    four["checkpoint_dir"] = root / "ckpt"
    return reference, {**two, **four}


def _assert_same(losses: dict[int, float], reference: dict[int, float], steps) -> None:
    assert sorted(losses) == list(steps)
    worst = max(abs(losses[i] - reference[i]) / abs(reference[i]) for i in steps)
    assert worst <= TOL, (worst, losses, reference)


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("layout", [*LAYOUTS_2, *LAYOUTS_4, *LAYOUTS_8])
def test_layout_equals_one_process(runs, layout, model):
    reference, results = runs
    _assert_same(results[model, layout], reference[model], range(1, STEPS + 1))


# Layouts whose one evaluation batch holds the same 8 sequences as the one-process run's
# (under pp an evaluation batch is all the micro-batches of a step).
SAME_EVAL_BATCH = ["tp2", "tp4", "pp2_1f1b", "pp2_interleaved", "pp2_zero_bubble", "pp4_gpipe", "tp2_pp2"]


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("layout", SAME_EVAL_BATCH)
def test_evaluation_equals_one_process(runs, layout, model):
    """Evaluation after the last step, pipelined (forward-only schedule) or not."""
    reference, results = runs
    ours, theirs = results[model, layout, "eval"], reference[model, "eval"]
    assert ours is not None and abs(ours - theirs) / theirs <= TOL, (ours, theirs)


def test_pipelined_evaluation_of_megatron_format_data(runs):
    reference, results = runs
    ours, theirs = results["gpt2", "indexed_pp2", "eval"], reference["indexed", "eval"]
    assert ours is not None and abs(ours - theirs) / theirs <= TOL, (ours, theirs)


@pytest.mark.parametrize("layout", list(INDEXED_LAYOUTS))
def test_megatron_format_data_trains_alike_under_dp_and_pp(runs, layout):
    """Windows of seq_len + 1 tokens give shift_labels; the pipeline scores them unshifted too."""
    reference, results = runs
    _assert_same(results["gpt2", layout], reference["indexed"], range(1, STEPS + 1))


@pytest.mark.parametrize("where", ["tp4", "tp2_pp2", "dp2_pp2_zero_stage1", "dp2_tp2_pp2_zero_stage3",
                                   "one_process"])
def test_checkpoint_from_dp2_tp2_zero3_resumes_elsewhere(runs, where):
    reference, results = runs
    _assert_same(results["resume", where], reference["gpt2"], range(6, STEPS + 1))


def test_zero3_at_dp4_holds_under_a_third_of_the_state(runs):
    """Parameters, gradients and AdamW moments per rank under FSDP2 at dp=4 vs one process: ~1/4."""
    _, results = runs
    ratio = results["zero3_bytes"] / results["one_process_bytes"]
    assert 0.2 <= ratio <= 0.3, ratio


def test_zero1_cuts_the_optimizer_state_evenly(runs):
    """FSDP2 shards every tensor over dp: each of 4 ranks holds a quarter of AdamW's state, give or
    take one tensor's rounding (ZeroRedundancyOptimizer's whole tensors put 72% on rank 0)."""
    _, results = runs
    per_rank, largest = results["zero1_optimizer_bytes"]
    quarter = sum(per_rank) / 4
    assert all(abs(b - quarter) <= largest for b in per_rank), (per_rank, largest)
    assert max(per_rank) / quarter < 1.05, per_rank


def test_checkpoint_from_dp2_tp2_zero3_exports_to_transformers(runs, tmp_path):
    import transformers

    from libai_zoo.convert import export_to_hf, load_checkpoint_model

    reference, results = runs
    checkpoint = results["checkpoint_dir"] / "model_0000005"
    ours = export_to_hf(checkpoint, tmp_path / "hf")
    theirs = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    ids = torch.randint(0, 8192, (2, 16))
    assert (ours(ids).logits - theirs(ids).logits).abs().max().item() <= 1e-5
    again = load_checkpoint_model(checkpoint)
    assert torch.equal(again(ids).logits, ours(ids).logits)


def test_bad_layouts_fail_before_the_first_step(runs):
    _, results = runs
    errors = results["errors"]
    assert "train.zero_stage = 2 shards over data parallelism, but dist.dp = 1" in errors["error", "zero_dp1"]
    assert "global_batch_size = 8 is not a multiple of micro_batch_size × dp = 3 × 4" in errors["error", "batch"]
    assert "pp × virtual stages = 8 is larger than the number of layers 4" in errors["error", "pp_layers"]
    assert "1F1B needs at least pp = 4 micro-batches per step, got 2" in errors["error", "few_micro_batches"]
    assert "this run is already on the CPU" in errors["error", "offload_on_cpu"]
    assert "schedule = 'zbv' cannot evaluate" in errors["error", "zbv_eval"]
