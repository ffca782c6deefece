"""3-D parallel training equals one process: the same config, global batch and data trained for
4 steps under data, tensor and pipeline parallelism and ZeRO 1-3 logs the one-process loss at
every step (≤ 1e-5 relative), for a tiny GPT-2, a tiny Llama (and one with a single KV head),
each other family's tiny model (tests/model_cases.py, its distinguishing features on) at a pipeline
under ZeRO-3 (Llama and the families read from Hugging Face directories, as the recipes start), and a Mixture of Experts (Mixtral, 8 experts, an uneven router) with its experts
split over ep; a checkpoint written at dp2×tp2 with ZeRO-3 resumes at other layouts, the MoE's
written at ep2 resumes at ep4 and in one process; bad layouts fail before the first step.

Each run is a case (tests/support/cases.py): computed when a selected test asks for it, the cases of one
world size in one group of forked gloo processes, the one-process references once in the parent.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from layouts import (
    CP_LAYOUTS,
    CP_RESUME_AT,
    FAMILY_LAYOUTS,
    FP8_LAYOUTS,
    INDEXED_LAYOUTS,
    LAYOUTS,
    MOE_LAYOUTS,
    MOE_RESUME_AT,
    RESUME_AT,
    TRAINED,
    overrides,
)
from libai_zoo import distributed
from libai_zoo.config import LazyConfig
from libai_zoo.data import IndexedDatasetWriter, load_tokenizer
from libai_zoo.engine import DefaultTrainer, TrainStep
from libai_zoo.layers import LMHead
from libai_zoo.models import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, MixtralForCausalLM
from libai_zoo.parallel import DataParallel, materialize, parallelize
from libai_zoo.utils import gradient_bytes, optimizer_state_bytes, parameter_bytes
from model_cases import zoo_model
from support.cases import Case, Cases
from support.recipes import saved_recipe
from trainer_runs import losses, records, run_trainer

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
# 4 steps: a layout's error shows at the first step or two (a gradient off by a constant factor, which
# AdamW hides from the losses, shows in the gradient norms); each step of 4 gloo processes on 2 cores
# costs a fraction of a second of collective latency
STEPS, GLOBAL_BATCH, TOL = 4, 8, 1e-5
SAVED_AT = 2  # the checkpoints the resume cases start from: the rest of the run, steps 3-4, is theirs

def train(config_file: str, output_dir: str, model: str, overrides: list[str], *, resume: bool = False,
          interrupt_after: int | None = None) -> dict[int, float]:
    """Run the trainer; return {step: loss} as rank 0 logged it (empty on other ranks)."""
    cfg = LazyConfig.load(config_file)
    cfg.model = cfg.models[model]
    if model in cfg.get("dataloaders", {}):  # a model that reads no text
        cfg.dataloader = cfg.dataloaders[model]
    cfg = LazyConfig.apply_overrides(cfg, [
        f"train.output_dir={output_dir}", f"train.max_iter={STEPS}", f"train.global_batch_size={GLOBAL_BATCH}",
        "train.log_period=1", "train.checkpoint.period=null", "optim.lr=3e-3", "train.clip_grad_norm=1.0",
        "train.eval.max_batches=1", *overrides])
    try:
        run_trainer(cfg, resume=resume, interrupt_after=interrupt_after)
    except KeyboardInterrupt:
        pass
    return losses(Path(output_dir))


def final_eval_loss(output_dir: str) -> float | None:
    """The evaluation loss logged after the last step (one test batch of 8 sequences)."""
    path = Path(output_dir) / "metrics.json"
    return records(output_dir)[-1].get("eval/loss") if path.is_file() else None


@contextmanager
def trained_one_step(config_file: str, output_dir: str, overrides: list[str]) -> Iterator[DefaultTrainer]:
    """The GPT-2 trainer after one step (its optimizer state exists), not evaluated (the whole test set
    under ZeRO-3 was 10 s of all-gathers); the context is torn down after."""
    cfg = LazyConfig.load(config_file)
    cfg.model = cfg.models["gpt2"]
    cfg = LazyConfig.apply_overrides(cfg, [f"train.output_dir={output_dir}", "train.max_iter=1",
                                           f"train.global_batch_size={GLOBAL_BATCH}", "train.checkpoint.period=null",
                                           "dataloader.test=null", *overrides])
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


@pytest.fixture(scope="module", autouse=True)
def loss_in_chunks():
    """The training loss of every layout here runs chunk by chunk (`LMHead.loss_from_hidden`; at
    least 4 chunks per micro-batch), as a large vocabulary's would."""
    saved = LMHead.chunk_bytes
    LMHead.chunk_bytes = 8 * 8192 * 4  # 8 tokens of the 8192 vocabulary (16 at tp2)
    yield
    LMHead.chunk_bytes = saved


def write_config(root: Path) -> tuple[Path, list[str]]:
    """The models' recipe (tests/support/configs/parallel_models.py) over the corpus's first 200
    documents, saved as `root`/config.yaml, and the Hugging Face directories its Llama and families
    load (as the recipes start, so that every layout reads its part of a directory); (its path, the
    documents)."""
    documents = (ROOT / "data/corpus/python_docs.txt").read_text().split("\n\n")[:200]
    (root / "text.txt").write_text("\n\n".join(documents))
    torch.manual_seed(0)  # the directories' weights, whatever the session ran before
    LlamaForCausalLM(LlamaConfig(vocab_size=8192, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                 num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=32,
                                 bos_token_id=0, eos_token_id=0)).save_pretrained(root / "hf" / "llama")
    for family in FAMILY_LAYOUTS:
        changes = FAMILY_CHANGES.get(family, dict(vocab_size=8192, num_hidden_layers=4))
        zoo_model(dict(swin="swin_cls").get(family, family), **changes).save_pretrained(root / "hf" / family)
    config_file = saved_recipe(root / "config.yaml", "parallel_models.py", f"hf_dir={root / 'hf'}",
                               f"dataloader.train.text_file={root / 'text.txt'}",
                               f"dataloader.train.cache_dir={root / 'cache'}")
    return config_file, documents


def setup(root: Path) -> None:
    """The configs the cases read: the models' recipe over the corpus's text, and over the same documents in
    Megatron's indexed format."""
    config_file, documents = write_config(root)
    tokenizer = load_tokenizer(ROOT / "data/tokenizer")
    with IndexedDatasetWriter(root / "corpus_text_document") as writer:
        for document in documents:
            writer.add_document(tokenizer(document).input_ids + [tokenizer.eos_token_id])
    saved_recipe(root / "config_indexed.yaml", "parallel_models_indexed.py", f"hf_dir={root / 'hf'}",
                 f"dataloader.train.prefixes=[{root / 'corpus_text_document'}]",
                 f"dataloader.train.cache_dir={root / 'cache'}")


def _run(root: str, name: str, model: str, layout: str, config: str = "config.yaml", extra: tuple = ()) -> dict:
    """Train `model` at `layout` for STEPS steps: the losses, gradient norms and the
    final evaluation loss rank 0 logged (a case whose evaluation no test compares, `EVALUATED`, skips it:
    it runs after the last step, so the losses are the same)."""
    out = f"{root}/{name}"
    if name not in EVALUATED:
        extra = (*extra, "dataloader.test=null")
    return {"losses": train(f"{root}/{config}", out, model, [*overrides(layout), *extra]),
            "grad_norms": losses(Path(out), "grad_norm"), "eval": final_eval_loss(out)}


def _errors(root: str) -> dict:
    """Bad layouts fail in the constructor, before the first step; the message names the fix."""
    errors = {}
    for name, bad in {"zero_dp1": ["dist.tp=4", "train.zero_stage=2"],
                      "batch": ["dist.dp=4", "train.micro_batch_size=3"],
                      "pp_layers": ["dist.pp=4", "train.micro_batch_size=1", "train.pipeline.virtual_stages=2",
                                    "train.pipeline.schedule=interleaved_1f1b"],
                      "few_micro_batches": ["dist.pp=4", "train.micro_batch_size=4"],
                      "offload_on_cpu": ["dist.dp=4", "train.zero_stage=3", "train.zero_offload=true",
                                         "train.micro_batch_size=2"],
                      "zbv_eval": ["dist.dp=2", "dist.pp=2", "train.micro_batch_size=2",
                                   "train.pipeline.schedule=zbv", "train.pipeline.virtual_stages=2"],
                      "ep_dp": ["dist.dp=4", "dist.ep=3"],
                      "experts": ["dist.dp=4", "dist.ep=4", "train.micro_batch_size=2",
                                  "model.num_local_experts=6"],
                      "cp_ep": ["dist.dp=2", "dist.ep=2", "dist.cp=2", "train.micro_batch_size=4"],
                      "cp_seq_len": ["dist.cp=4", "dataloader.train.seq_len=12"]}.items():
        try:
            train(f"{root}/config.yaml", f"{root}/error_{name}", "moe" if name == "experts" else "gpt2", bad)
        except Exception as error:  # noqa: BLE001 - the message is what is checked
            errors[name] = str(error)
    return errors


def _checkpoint(root: str) -> Path:
    """GPT-2 at dp2×tp2 ZeRO-3, stopped after step SAVED_AT and its checkpoint."""
    train(f"{root}/config.yaml", f"{root}/ckpt", "gpt2",
          [*overrides("dp2_tp2_zero3"), f"train.checkpoint.period={SAVED_AT}"], interrupt_after=SAVED_AT)
    return Path(root) / "ckpt"


def _resume(root: str, layout: str, checkpoint: str = "ckpt", model: str = "gpt2",
            extra: tuple = (f"train.checkpoint.period={SAVED_AT}",)) -> dict[int, float]:
    """Run `checkpoint`'s `model` resumed at `layout` to step STEPS."""
    target = f"{root}/{checkpoint}_resume_{layout}_{model}"
    rank0 = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    if rank0:
        shutil.copytree(f"{root}/{checkpoint}", target)
        (Path(target) / "metrics.json").unlink()
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    return train(f"{root}/config.yaml", target, model, [*overrides(layout), *extra], resume=True)


def _cp_checkpoint(root: str) -> Path:
    """GPT-2 at cp2 × dp2 with ZeRO-3 (sharded over dp × cp), stopped after step SAVED_AT and its checkpoint."""
    train(f"{root}/config.yaml", f"{root}/cp_ckpt", "gpt2",
          [*overrides("cp2_dp2_zero3"), f"train.checkpoint.period={SAVED_AT}"], interrupt_after=SAVED_AT)
    return Path(root) / "cp_ckpt"


def _step_with_a_part_without_targets(root: str, cp: int) -> tuple[float, float]:
    """(loss, gradient norm) of one step of a tiny GPT-2 at cp (1: one process) on a batch whose
    positions 4-11 of 16 score nothing: at cp2 they are rank 1's two chunks, whose mean loss over no
    targets would be NaN."""
    ctx = distributed.init(cp=cp)
    try:
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4,
                                           embd_pdrop=0.0, attn_pdrop=0.0, resid_pdrop=0.0))
        built = parallelize(model, ctx, data_parallel := DataParallel(ctx, 0))
        step = TrainStep(built.parts, torch.optim.SGD(built.parts[0].parameters(), lr=0.1), ctx=ctx,
                         data_parallel=data_parallel)
        ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
        labels = ids.clone()
        labels[:, 5:13] = -100  # position t is scored against labels[t + 1]
        result = step([{"input_ids": ids, "labels": labels}])
        return result.loss, result.grad_norm
    finally:
        distributed.destroy()


def _moe_checkpoint(root: str) -> Path:
    """The MoE at dp2_ep2 (ZeRO-3), stopped after step SAVED_AT and its checkpoint."""
    train(f"{root}/config.yaml", f"{root}/moe_ckpt", "moe",
          [*overrides("dp2_ep2_zero3"), f"train.checkpoint.period={SAVED_AT}"], interrupt_after=SAVED_AT)
    return Path(root) / "moe_ckpt"


def _moe_from_hugging_face(root: str) -> float:
    """A Mixtral directory (one tensor per expert) read at dp2_ep2 with ZeRO-3, each rank reading
    its experts' rows only: the largest difference of the gathered parameters from the directory's."""
    path = Path(root) / "mixtral_hf"
    zoo_model("mixtral", num_local_experts=8).save_pretrained(path)  # rank 0 writes, the others wait
    ctx = distributed.init(dp=4, ep=2)
    with torch.device("meta"):
        model = MixtralForCausalLM.from_pretrained(path)
    built = parallelize(model, ctx, DataParallel(ctx, 3))
    materialize(built.parts[0], ctx.device, seed=0, model=built.model)
    expected = MixtralForCausalLM.from_pretrained(path)
    try:
        return max((param.full_tensor() - expected.get_parameter(name)).abs().max().item()
                   for name, param in built.model.named_parameters())
    finally:
        distributed.destroy()


def _fp8_broken_scale(root: str, broken: str) -> dict:
    """Float8 GPT-2 with one scale broken: "unreduced" at tp2 + SP (each rank scales its part of an
    operand by its own maximum), "stale" at dp2 ZeRO-3 (the float8 all-gather's scales computed after
    the first step only)."""
    from unittest import mock

    import torchao.float8.float8_scaling_utils as scaling

    from libai_zoo.engine import train_step
    layout = FP8_BROKEN[broken]
    if broken == "unreduced":
        cast = scaling.hp_tensor_to_float8_dynamic
        patch = mock.patch.object(scaling, "hp_tensor_to_float8_dynamic",
                                  lambda *args, **kwargs: cast(*args, **{**kwargs, "reduce_amax": False}))
    else:
        precompute, calls = train_step.precompute_float8_scales, []

        def first_only(layers):
            if not calls:
                calls.append(layers)
                precompute(layers)
        patch = mock.patch.object(train_step, "precompute_float8_scales", first_only)
    with patch:
        return _run(root, f"fp8_{broken}", "fp8", layout, "config.yaml", FAMILY_OPTIONS["fp8"])


def _fp8_checkpoint(root: str) -> Path:
    """Float8 GPT-2 at dp2 ZeRO-3 (weights gathered in float8), stopped after step SAVED_AT and its checkpoint."""
    train(f"{root}/config.yaml", f"{root}/fp8_ckpt", "fp8",
          [*overrides("dp2_zero3"), *FAMILY_OPTIONS["fp8"], f"train.checkpoint.period={SAVED_AT}"],
          interrupt_after=SAVED_AT)
    return Path(root) / "fp8_ckpt"


def _state_bytes(root: str, layout: str) -> int:
    return state_bytes(f"{root}/config.yaml", f"{root}/bytes_{layout}", overrides(layout))


def _optimizer_bytes_dp4_zero1(root: str) -> tuple[list[int], int]:
    return optimizer_bytes_per_rank(f"{root}/config.yaml", f"{root}/optimizer_bytes_dp4_zero1",
                                    ["dist.dp=4", "train.zero_stage=1", "train.micro_batch_size=2"])


#: a family's model as the trainer's tests build it (default: the tokenizer's vocabulary, 4 layers)
FAMILY_CHANGES = {"swin": dict(image_size=8, patch_size=1, num_channels=1, num_labels=10, embed_dim=16,
                               depths=[2, 2], num_heads=[2, 4], window_size=4, drop_path_rate=0.0,
                               use_absolute_embeddings=False, out_features=None, out_indices=None)}

# A family's own training options, in its one-process reference too: DeepSeek-V3's bias update (the
# correction biases then move alike at every layout only if each step's routed tokens are summed over dp)
FAMILY_OPTIONS = {"deepseek_v3": ("train.expert_bias_update_rate=0.001",),
                  "fp8": ("train.fp8.enabled=true",),
                  "fp8_rowwise": ("train.fp8.enabled=true", "train.fp8.recipe=rowwise")}

# torch's rowwise float8 GEMM writes bf16 (torchao casts it to the float32 asked for), so a row layer's
# partial sums over tp are rounded before they are summed: within bf16's rounding of one process (5.6e-5)
MODEL_TOL = {"fp8_rowwise": 2e-4}
MODEL_OF = {f"{model}_{layout}": model for model, layouts in TRAINED.items() for layout in layouts}  # case -> model
FP8_RESUME = (f"train.checkpoint.period={SAVED_AT}", "train.fp8.enabled=true")
FP8_BROKEN = {"unreduced": "tp2_sp", "stale": "dp2_zero3"}  # a broken scale -> the layout that shows it


def _world(layout: str) -> int:
    return LAYOUTS[layout].world_size


def _reference(model: str, layout: str) -> str:
    """The one-process case `model` at `layout` equals: at the layout's micro-batch size for a model
    whose numbers are a micro-batch's (the MoE's auxiliary loss, float8's scales over its tokens)."""
    mb = LAYOUTS[layout].micro_batch_size
    if model == "moe" or (model in FP8_LAYOUTS and mb != LAYOUTS["one"].micro_batch_size):
        return f"{model}_one_mb{mb}"
    return f"{model}_one"


CASES = {
    **{f"{model}_one": Case(1, _run, (f"{model}_one", model, "one", "config.yaml", FAMILY_OPTIONS.get(model, ())))
       for model in TRAINED if model != "moe"},
    **{f"moe_one_mb{mb}": Case(1, _run, (f"moe_one_mb{mb}", "moe", "one", "config.yaml",
                                         (f"train.micro_batch_size={mb}",))) for mb in (4, 2)},
    "fp8_one_mb4": Case(1, _run, ("fp8_one_mb4", "fp8", "one", "config.yaml",
                                  (*FAMILY_OPTIONS["fp8"], "train.micro_batch_size=4"))),
    "indexed_one": Case(1, _run, ("indexed_one", "gpt2", "one", "config_indexed.yaml")),
    **{f"{model}_{layout}": Case(_world(layout), _run, (f"{model}_{layout}", model, layout, "config.yaml",
                                                         FAMILY_OPTIONS.get(model, ())),
                                 needs=(_reference(model, layout),))
       for model, layouts in TRAINED.items() for layout in layouts},
    **{f"indexed_{layout}": Case(_world(layout), _run, (f"indexed_{layout}", "gpt2", layout, "config_indexed.yaml"),
                                 needs=("indexed_one",)) for layout in INDEXED_LAYOUTS},
    "ckpt": Case(4, _checkpoint, needs=("gpt2_one",)),
    **{f"resume_{layout}": Case(_world(layout), _resume, (layout,), needs=("ckpt",)) for layout in RESUME_AT},
    "cp_ckpt": Case(4, _cp_checkpoint, needs=("gpt2_one",)),
    **{f"cp{cp}_part_without_targets": Case(cp, _step_with_a_part_without_targets, (cp,)) for cp in (1, 2)},
    **{f"cp_resume_{layout}": Case(_world(layout), _resume, (layout, "cp_ckpt"), needs=("cp_ckpt",))
       for layout in CP_RESUME_AT},
    "moe_ckpt": Case(4, _moe_checkpoint, needs=("moe_one_mb2",)),
    "moe_from_hugging_face": Case(4, _moe_from_hugging_face),
    **{f"moe_resume_{layout}": Case(_world(layout), _resume, (layout, "moe_ckpt", "moe", (
        f"train.checkpoint.period={SAVED_AT}", *extra)), needs=("moe_ckpt",))
       for layout, extra in MOE_RESUME_AT.items()},
    **{f"fp8_{broken}": Case(2, _fp8_broken_scale, (broken,), needs=(_reference("fp8", layout),))
       for broken, layout in FP8_BROKEN.items()},
    "fp8_ckpt": Case(2, _fp8_checkpoint, needs=("fp8_one_mb4",)),
    # a float8 run's checkpoint resumed with float8 (in one process) and without it, a bf16 one's with it
    "fp8_resume_one": Case(1, _resume, ("one", "fp8_ckpt", "fp8", (*FP8_RESUME, "train.micro_batch_size=4")),
                           needs=("fp8_ckpt",)),
    "fp8_resume_one_without_fp8": Case(1, _resume, ("one", "fp8_ckpt", "gpt2", (
        f"train.checkpoint.period={SAVED_AT}", "train.micro_batch_size=4")), needs=("fp8_ckpt",)),
    "resume_dp2_zero3_fp8": Case(2, _resume, ("dp2_zero3", "ckpt", "gpt2", FP8_RESUME), needs=("ckpt",)),
    "bytes_one": Case(1, _state_bytes, ("one",)),
    "bytes_dp4_zero3": Case(4, _state_bytes, ("dp4_zero3",)),
    "optimizer_bytes_dp4_zero1": Case(4, _optimizer_bytes_dp4_zero1),
    "errors": Case(4, _errors),
}
RUNS = Cases(__file__, CASES, setup)
runs = RUNS.fixture()


def _params(names) -> list:
    """Case names as parameters; the 8-process ones are system tests."""
    return [pytest.param(name, marks=pytest.mark.system) if CASES[name].world_size == 8 else name
            for name in names]


def _assert_same(losses: dict[int, float], reference: dict[int, float], steps, tol: float = TOL) -> None:
    assert sorted(losses) == list(steps)
    worst = max(abs(losses[i] - reference[i]) / abs(reference[i]) for i in steps)
    assert worst <= tol, (worst, losses, reference)


@pytest.mark.parametrize("case", _params(MODEL_OF))
def test_layout_equals_one_process(runs, case):
    model = MODEL_OF[case]
    reference = _reference(model, case.removeprefix(f"{model}_"))
    _assert_same(runs(case)["losses"], runs(reference)["losses"], range(1, STEPS + 1), MODEL_TOL.get(model, TOL))


@pytest.mark.parametrize("case", [f"t5_{layout}" for layout in FAMILY_LAYOUTS["t5"]])
def test_encoder_decoder_gradients_equal_one_process(runs, case):
    """The gradient norms too: the shared table's three copies (encoder, decoder and head stages)
    summed once, the encoder's output's gradient back from both decoder stages."""
    _assert_same(runs(case)["grad_norms"], runs("t5_one")["grad_norms"], range(1, STEPS + 1))


@pytest.mark.parametrize("case", [f"moe_{layout}" for layout in MOE_LAYOUTS])
def test_expert_gradients_equal_one_process(runs, case):
    """The gradient norm counts each expert once, at its one-process size: AdamW hides a gradient off
    by a constant factor from the losses (the experts' summed over ep by the all-to-all's backward
    must be scaled by 1/ep), the norm does not."""
    reference = _reference("moe", case.removeprefix("moe_"))
    _assert_same(runs(case)["grad_norms"], runs(reference)["grad_norms"], range(1, STEPS + 1))


@pytest.mark.parametrize("case", [f"{model}_{layout}" for model, layouts in TRAINED.items() for layout in layouts
                                  if layout in CP_LAYOUTS])
def test_context_parallel_gradients_equal_one_process(runs, case):
    """Each cp rank's gradient is its tokens' share (keys and values it lent the others included): the
    average over dp × cp, scaled by dp·cp over the global targets, is the one-process gradient."""
    model = MODEL_OF[case]
    reference = _reference(model, case.removeprefix(f"{model}_"))
    _assert_same(runs(case)["grad_norms"], runs(reference)["grad_norms"], range(1, STEPS + 1))


# Layouts whose one evaluation batch holds the same 8 sequences as the one-process run's
# (under pp an evaluation batch is all the micro-batches of a step; under cp each rank scores its part);
# not for float8, whose scales are a micro-batch's (a pipeline's evaluation runs micro-batches of 4).
SAME_EVAL_BATCH = ["tp2", "tp4", "pp2_1f1b", "pp2_interleaved", "pp2_zero_bubble", "pp4_gpipe", "tp2_pp2", "cp2",
                   "cp2_tp2_sp", "cp2_pp2", "cp4"]
EVAL_CASES = [f"{model}_{layout}" for model, layouts in TRAINED.items() for layout in layouts
              if layout in SAME_EVAL_BATCH and model not in FP8_LAYOUTS]
#: the `_run` cases that evaluate: those compared here and their references, and (run, not compared) the
#: pipelined evaluation of an encoder-decoder, of a family under zero bubble, of float8 and of experts over ep
#: (zbv cannot evaluate: its case does not)
EVALUATED = {*EVAL_CASES, *(f"{MODEL_OF[case]}_one" for case in EVAL_CASES), "indexed_pp2_1f1b", "indexed_one",
             "t5_dp2_pp2_zero3_interleaved", "gemma3_dp2_pp2_zero3_zero_bubble", "fp8_pp2_1f1b", "moe_ep2_pp2"}


@pytest.mark.parametrize("case", EVAL_CASES)
def test_evaluation_equals_one_process(runs, case):
    """Evaluation after the last step, pipelined (forward-only schedule) or not."""
    ours, theirs = runs(case)["eval"], runs(f"{MODEL_OF[case]}_one")["eval"]
    assert ours is not None and abs(ours - theirs) / theirs <= TOL, (ours, theirs)


@pytest.mark.cases("indexed_pp2_1f1b")
def test_pipelined_evaluation_of_megatron_format_data(runs):
    ours, theirs = runs("indexed_pp2_1f1b")["eval"], runs("indexed_one")["eval"]
    assert ours is not None and abs(ours - theirs) / theirs <= TOL, (ours, theirs)


@pytest.mark.parametrize("case", [f"indexed_{layout}" for layout in INDEXED_LAYOUTS])
def test_megatron_format_data_trains_alike_under_dp_and_pp(runs, case):
    """Windows of seq_len + 1 tokens give shift_labels; the pipeline scores them unshifted too."""
    _assert_same(runs(case)["losses"], runs("indexed_one")["losses"], range(1, STEPS + 1))


@pytest.mark.parametrize("case", _params(f"resume_{layout}" for layout in RESUME_AT))
def test_checkpoint_from_dp2_tp2_zero3_resumes_elsewhere(runs, case):
    _assert_same(runs(case), runs("gpt2_one")["losses"], range(SAVED_AT + 1, STEPS + 1))


@pytest.mark.parametrize("case", [f"cp_resume_{layout}" for layout in CP_RESUME_AT])
def test_checkpoint_from_cp2_resumes_at_another_cp(runs, case):
    """Saved with ZeRO-3 over dp × cp (the cp ranks' equal parameters sharded among them), resumed
    with each sequence split over 4 ranks, and whole in one process."""
    _assert_same(runs(case), runs("gpt2_one")["losses"], range(SAVED_AT + 1, STEPS + 1))


@pytest.mark.cases("cp2_part_without_targets", "cp1_part_without_targets")
def test_a_cp_rank_without_targets_adds_nothing(runs):
    """Its part still runs (attention's exchange needs it), scoring one dummy target weighted 0."""
    ours, theirs = runs("cp2_part_without_targets"), runs("cp1_part_without_targets")
    assert all(abs(a - b) / b <= TOL for a, b in zip(ours, theirs)), (ours, theirs)


@pytest.mark.parametrize("case", [f"moe_resume_{layout}" for layout in MOE_RESUME_AT])
def test_moe_checkpoint_resumes_at_another_ep(runs, case):
    """Experts saved split over ep2 (ZeRO-3 over edp) load split over ep4, and whole in one process."""
    _assert_same(runs(case), runs("moe_one_mb2")["losses"], range(SAVED_AT + 1, STEPS + 1))


@pytest.mark.cases("moe_from_hugging_face")
def test_moe_reads_its_experts_from_hugging_face_files(runs):
    assert runs("moe_from_hugging_face") == 0.0


@pytest.mark.parametrize("case", ["fp8_unreduced", "fp8_stale"])
def test_a_broken_float8_scale_moves_the_loss(runs, case):
    """The float8 layouts' equality is not vacuous: a scale taken over a rank's part of an operand, or
    one left from an earlier step's weights, moves the losses and gradient norms well past the
    tolerance (measured: the gradient norm by 3e-3 and 1.6e-3)."""
    ours, theirs = runs(case), runs(_reference("fp8", FP8_BROKEN[case.removeprefix("fp8_")]))
    worst = max(abs(ours[key][i] - theirs[key][i]) / abs(theirs[key][i])
                for key in ("losses", "grad_norms") for i in range(1, STEPS + 1))
    assert worst > 100 * TOL, (worst, ours, theirs)


@pytest.mark.cases("fp8_ckpt", "fp8_resume_one", "fp8_resume_one_without_fp8", "resume_dp2_zero3_fp8", "ckpt",
                   "fp8_one_mb4", "gpt2_one")
def test_float8_checkpoints_stay_in_high_precision(runs):
    """Saved at dp2 ZeRO-3 with float8 all-gathers, resumed in one process with float8 it continues
    the one-process float8 run; without float8, from the same weights, within float8's rounding
    of it; a bf16 run's checkpoint resumes with float8 within that of the bf16 run."""
    steps = range(SAVED_AT + 1, STEPS + 1)
    _assert_same(runs("fp8_resume_one"), runs("fp8_one_mb4")["losses"], steps)
    for case, reference in (("fp8_resume_one_without_fp8", "fp8_one_mb4"), ("resume_dp2_zero3_fp8", "gpt2_one")):
        ours, theirs = runs(case), runs(reference)["losses"]
        worst = max(abs(ours[i] - theirs[i]) / theirs[i] for i in steps)
        assert sorted(ours) == list(steps) and 0 < worst < 0.01, (case, worst, ours, theirs)


@pytest.mark.cases("bytes_dp4_zero3", "bytes_one")
def test_zero3_at_dp4_holds_under_a_third_of_the_state(runs):
    """Parameters, gradients and AdamW moments per rank under FSDP2 at dp=4 vs one process: ~1/4."""
    ratio = runs("bytes_dp4_zero3") / runs("bytes_one")
    assert 0.2 <= ratio <= 0.3, ratio


@pytest.mark.cases("optimizer_bytes_dp4_zero1")
def test_zero1_cuts_the_optimizer_state_evenly(runs):
    """FSDP2 shards every tensor over dp: each of 4 ranks holds a quarter of AdamW's state, give or
    take one tensor's rounding (ZeroRedundancyOptimizer's whole tensors put 72% on rank 0)."""
    per_rank, largest = runs("optimizer_bytes_dp4_zero1")
    quarter = sum(per_rank) / 4
    assert all(abs(b - quarter) <= largest for b in per_rank), (per_rank, largest)
    assert max(per_rank) / quarter < 1.05, per_rank


@pytest.mark.cases("ckpt")
def test_checkpoint_from_dp2_tp2_zero3_exports_to_transformers(runs, tmp_path):
    import transformers

    from libai_zoo.convert import export_to_hf, load_checkpoint_model

    checkpoint = runs("ckpt") / f"model_{SAVED_AT:07d}"
    ours = export_to_hf(checkpoint, tmp_path / "hf")
    theirs = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    ids = torch.randint(0, 8192, (2, 16))
    assert (ours(ids).logits - theirs(ids).logits).abs().max().item() <= 1e-5
    again = load_checkpoint_model(checkpoint)
    assert torch.equal(again(ids).logits, ours(ids).logits)


@pytest.mark.cases("errors")
def test_bad_layouts_fail_before_the_first_step(runs):
    errors = runs("errors")
    assert "train.zero_stage = 2 shards over data parallelism, but dist.dp = 1" in errors["zero_dp1"]
    assert "global_batch_size = 8 is not a multiple of micro_batch_size × dp = 3 × 4" in errors["batch"]
    assert "pp × virtual stages = 8 is larger than the number of layers 4" in errors["pp_layers"]
    assert "1F1B needs at least pp = 4 micro-batches per step, got 2" in errors["few_micro_batches"]
    assert "this run is already on the CPU" in errors["offload_on_cpu"]
    assert "schedule = 'zbv' cannot evaluate" in errors["zbv_eval"]
    assert "dp = 4 is not a multiple of ep = 3" in errors["ep_dp"] and "choose an ep that divides 4" in errors["ep_dp"]
    assert "num_experts = 6 is not divisible by ep × tp = 4 × 1 = 4" in errors["experts"]
    assert "ep = 2 with cp = 2" in errors["cp_ep"] and "set dist.ep=1" in errors["cp_ep"]
    assert "sequence length 12 does not split into 2·cp = 8 equal chunks" in errors["cp_seq_len"]
