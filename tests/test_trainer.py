"""DefaultTrainer end to end on a tiny GPT-2 and a slice of the shipped corpus (one process):
resume equals an uninterrupted run, a crash while checkpointing resumes from the previous
checkpoint, accumulation and activation checkpointing (full, selective, block) change no numbers, AMP works on CPU,
and the run writes config.yaml and metrics.json."""

from __future__ import annotations

import copy
import importlib.util
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from libai_zoo.config import FULL, RECOMPUTE_MODULES, ConfigError, LazyConfig, Recompute, instantiate
from libai_zoo.engine import DefaultTrainer, StepResult, TrainStep
from libai_zoo.models import GPT2Config, GPT2LMHeadModel
from libai_zoo.parallel import apply_activation_checkpointing
from libai_zoo.plan.activations import saved_bytes
from model_cases import zoo_model
from support.recipes import saved_recipe
from trainer_runs import losses, records, run_trainer

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def config_file(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("trainer")
    documents = (ROOT / "data/corpus/python_docs.txt").read_text().split("\n\n")[:300]
    (root / "text.txt").write_text("\n\n".join(documents))
    return saved_recipe(root / "config.yaml", "tiny_gpt2.py", f"dataloader.train.text_file={root / 'text.txt'}",
                        f"dataloader.train.cache_dir={root / 'cache'}")


def run(config_file: Path, output_dir: Path, *overrides: str, resume: bool = False,
        interrupt_after: int | None = None) -> DefaultTrainer:
    cfg = LazyConfig.apply_overrides(LazyConfig.load(str(config_file)), [
        f"train.output_dir={output_dir}", "train.max_iter=20", "train.micro_batch_size=4", "train.global_batch_size=4",
        "train.log_period=1", "train.checkpoint.period=5", "optim.lr=1e-3", *overrides])
    return run_trainer(cfg, resume=resume, interrupt_after=interrupt_after)


@pytest.fixture(scope="module")
def straight(config_file, tmp_path_factory) -> Path:
    output_dir = tmp_path_factory.mktemp("straight")
    run(config_file, output_dir)
    return output_dir


def test_run_writes_config_metrics_and_checkpoints(straight):
    saved = LazyConfig.load(str(straight / "config.yaml"))
    assert saved.train.max_iter == 20 and saved.model.config.n_layer == 2
    logged = records(straight)
    assert [r["iteration"] for r in logged] == list(range(1, 21))
    assert {"iteration", "loss", "lr", "tokens_per_s", "grad_norm", "samples_per_s"} <= set(logged[-1])
    assert logged[-1]["loss"] < logged[0]["loss"]
    assert (straight / "last_checkpoint").read_text() == "model_0000020"
    assert sorted(p.name for p in straight.glob("model_*")) == [f"model_{i:07d}" for i in (5, 10, 15, 20)]


def test_resume_equals_uninterrupted_run(config_file, straight, tmp_path):
    with pytest.raises(KeyboardInterrupt):
        run(config_file, tmp_path, interrupt_after=10)
    first = losses(tmp_path)
    (tmp_path / "metrics.json").unlink()
    run(config_file, tmp_path, resume=True)
    second = losses(tmp_path)
    assert sorted(first) == list(range(1, 11)) and sorted(second) == list(range(11, 21))
    reference = losses(straight)
    assert max(abs({**first, **second}[i] - reference[i]) for i in reference) <= 1e-6


def test_crash_while_checkpointing_resumes_from_previous(config_file, straight, tmp_path, monkeypatch):
    import libai_zoo.checkpoint.checkpointer as checkpointer

    real_save, calls = checkpointer.dcp.save, []

    def dying_save(state, checkpoint_id, **options):
        calls.append(checkpoint_id)
        real_save(state, checkpoint_id=checkpoint_id, **options)
        if len(calls) == 2:  # the second checkpoint (after step 10) dies with its files half written
            raise KeyboardInterrupt("killed")

    monkeypatch.setattr(checkpointer.dcp, "save", dying_save)
    with pytest.raises(KeyboardInterrupt):
        run(config_file, tmp_path)
    monkeypatch.setattr(checkpointer.dcp, "save", real_save)
    assert (tmp_path / "last_checkpoint").read_text() == "model_0000005"
    assert (tmp_path / "model_0000010.tmp").is_dir()
    (tmp_path / "metrics.json").unlink()
    trainer = run(config_file, tmp_path, resume=True)
    assert trainer.start_iter == 5 and not (tmp_path / "model_0000010.tmp").exists()
    resumed, reference = losses(tmp_path), losses(straight)
    assert sorted(resumed) == list(range(6, 21))
    assert max(abs(resumed[i] - reference[i]) for i in resumed) <= 1e-6


def test_tensorboard_writer_writes_events(config_file, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run(config_file, tmp_path, "train.max_iter=3", "train.tensorboard=true")
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("loss")] == [1, 2, 3]
    assert [e.value for e in events.Scalars("loss")] == pytest.approx([r["loss"] for r in records(tmp_path)])


def test_periodic_evaluation_is_logged(config_file, tmp_path):
    run(config_file, tmp_path, "train.max_iter=10", "train.eval.period=5", "train.eval.max_batches=2")
    evaluated = {r["iteration"]: r for r in records(tmp_path) if "eval/loss" in r}
    assert sorted(evaluated) == [5, 10]
    assert evaluated[10]["eval/perplexity"] == pytest.approx(math.exp(evaluated[10]["eval/loss"]), rel=1e-6)


def test_evaluation_off_the_log_period_is_written_too(config_file, tmp_path):
    run(config_file, tmp_path, "train.max_iter=8", "train.log_period=4", "train.eval.period=3",
        "train.eval.max_batches=1")
    logged = {r["iteration"]: r for r in records(tmp_path)}
    assert sorted(logged) == [1, 3, 4, 6, 8]
    assert sorted(i for i, r in logged.items() if "eval/loss" in r) == [3, 6, 8]


def load_train_tool():
    spec = importlib.util.spec_from_file_location("train_tool", ROOT / "tools" / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_train_tool_fast_dev_run_and_eval_only(config_file, straight, tmp_path):
    tool = load_train_tool()
    batch_sizes = ["train.micro_batch_size=4", "train.global_batch_size=4"]
    tool.main([str(config_file), f"train.output_dir={tmp_path}", *batch_sizes, "--fast-dev-run"])
    logged = records(tmp_path / "fast_dev_run")  # its own folder: nothing a real run reads
    assert [r["iteration"] for r in logged] == [1, 2] and "eval/loss" in logged[-1]
    assert not list(tmp_path.rglob("model_*")) and sorted(p.name for p in tmp_path.iterdir()) == ["fast_dev_run"]
    results = tool.main([str(config_file), f"train.output_dir={straight}", *batch_sizes, "train.eval.max_batches=2",
                         "--eval-only"])  # the newest checkpoint, without a flag
    assert set(results) == {"loss", "perplexity"} and results["loss"] < 9.0  # below ln(8192): it learned


def test_train_tool_resume_insists_on_a_checkpoint(config_file, straight, tmp_path):
    """--resume (LiBai's and detectron2's flag) resumes, and fails before building anything when there is nothing
    to resume; resuming stays the default and --no-resume starts over."""
    tool = load_train_tool()
    with pytest.raises(ConfigError, match=f"--resume: {tmp_path} holds no checkpoint.*without --resume"):
        tool.main([str(config_file), f"train.output_dir={tmp_path}", "--resume"])
    assert list(tmp_path.iterdir()) == []  # refused before the trainer wrote anything
    results = tool.main([str(config_file), f"train.output_dir={straight}", "train.micro_batch_size=4",
                         "train.global_batch_size=4", "train.eval.max_batches=2", "--eval-only", "--resume"])
    assert results["loss"] < 9.0  # the trained checkpoint, not fresh weights (ln 8192 = 9.01)
    with pytest.raises(SystemExit):  # one or the other
        tool.parse_args([str(config_file), "--resume", "--no-resume"])
    default = tool.parse_args([str(config_file)])
    assert not default.resume and not default.no_resume  # the default: resume when there is a checkpoint


def test_a_runs_records_say_what_trained_its_checkpoints(config_file, straight, tmp_path):
    """--eval-only, a start with nothing left to train, --fast-dev-run and a refused start (another model's
    checkpoint in the directory, named in one line with the two ways out) leave the run's config.yaml,
    metrics.json and goodput.json as its training wrote them; each checkpoint keeps the config that wrote it."""
    run_dir = tmp_path / "run"
    shutil.copytree(straight, run_dir)
    records_of = {name: (run_dir / name).read_bytes() for name in ("config.yaml", "metrics.json", "goodput.json")}
    tool = load_train_tool()
    common = [str(config_file), f"train.output_dir={run_dir}", "train.micro_batch_size=4", "train.global_batch_size=4"]
    tool.main([*common, "train.max_iter=40", "train.eval.max_batches=1", "--eval-only"])
    tool.main([*common, "train.max_iter=20"])  # nothing to train: no hook runs, no sample, no goodput restart
    tool.main([*common, "--fast-dev-run"])
    assert [r["iteration"] for r in records(run_dir / "fast_dev_run")] == [1, 2]
    with pytest.raises(ConfigError) as refused:
        tool.main([*common, "train.max_iter=22", "model.config.n_layer=3"])
    assert str(refused.value) == (
        f"{run_dir / 'model_0000020'} was written by another model than this run's (2 layers in it, 3 in this "
        f"model): start over in this directory with --no-resume (its checkpoints are then replaced), or give this "
        f"run its own train.output_dir")
    assert tool.is_config_error(refused.value)  # tools/train.py prints it as one line and exits 2
    assert {name: (run_dir / name).read_bytes() for name in records_of} == records_of
    assert LazyConfig.load(str(run_dir / "model_0000005" / "config.yaml")).train.max_iter == 20


def test_a_resumed_run_takes_the_configs_learning_rate(config_file, straight, tmp_path, monkeypatch):
    """The schedule's base lr and the optimizer's settings come from the config, not the checkpoint
    (Megatron's --override-opt_param-scheduler): a changed optim.lr applies from the resumed step, and
    again after a divergence rolls the run back to the earlier run's checkpoint."""
    shutil.copytree(straight, tmp_path, dirs_exist_ok=True)  # 20 steps at lr 1e-3
    for record in ("metrics.json", "log.txt"):
        (tmp_path / record).unlink()
    monkeypatch.setenv("LIBAI_ZOO_FAULT", "nan:rank=0:step=22:count=1")  # back to step 20 after step 22
    run(config_file, tmp_path, "train.max_iter=24", "optim.lr=2e-3", "optim.params.weight_decay=0.05",
        "train.max_bad_steps=1", "train.on_divergence=rollback", resume=True)
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=2e-3)
    schedule = instantiate({**OmegaConf.to_container(LazyConfig.load(str(config_file)).train.scheduler),
                            "optimizer": optimizer, "max_iter": 24})
    expected = []
    for _ in range(24):
        expected.append(optimizer.param_groups[0]["lr"])
        schedule.step()
    logged = records(tmp_path)
    assert [r["iteration"] for r in logged] == [21, 21, 22, 23, 24]  # step 22 diverged: 21 again from step 20's state
    assert [r["lr"] for r in logged] == pytest.approx([expected[20], *expected[20:]], rel=1e-12)
    assert ("group 0 lr: 0.001 -> 0.002; group 0 weight_decay: 0.01 -> 0.05; group 1 lr: 0.001 -> 0.002)"
            in (tmp_path / "log.txt").read_text())  # the no-decay group keeps its weight decay of 0
    assert LazyConfig.load(str(tmp_path / "config.yaml")).optim.lr == 2e-3


def test_train_tool_help():
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "train.py"), "--help"], capture_output=True,
                         text=True, check=True).stdout
    assert all(flag in out for flag in ("--resume", "--no-resume", "--eval-only", "--fast-dev-run", "key=value"))


# ------------------------------------------------------------------------------ the step itself
def tiny_gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4, embd_pdrop=0.0,
                                      attn_pdrop=0.0, resid_pdrop=0.0))


def batch(n: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (n, 16), generator=g)
    labels = ids.clone()
    labels[::3, 10:] = -100  # uneven padding: micro-batches hold different numbers of targets
    return {"input_ids": ids, "labels": labels}


def sgd_step(model, micro_batches, **kwargs) -> tuple[StepResult, list[torch.Tensor]]:
    step = TrainStep([model], torch.optim.SGD(model.parameters(), lr=0.1), device=torch.device("cpu"), **kwargs)
    metrics = step(micro_batches)
    return metrics, [p.detach().clone() for p in model.parameters()]


def test_accumulation_equals_one_big_batch():
    whole = batch(8, seed=1)
    micro = [{k: v[i:i + 2] for k, v in whole.items()} for i in range(0, 8, 2)]
    one, params_one = sgd_step(tiny_gpt2(), [whole])
    four, params_four = sgd_step(tiny_gpt2(), micro)
    assert abs(one.loss - four.loss) <= 1e-6
    assert max((a - b).abs().max().item() for a, b in zip(params_one, params_four)) <= 1e-6


def test_activation_checkpointing_gives_equal_gradients():
    plain, checkpointed = tiny_gpt2(), tiny_gpt2()
    assert apply_activation_checkpointing(checkpointed.transformer.h) == 2
    b = batch(4, seed=2)
    plain(**b).loss.backward()
    checkpointed(**b).loss.backward()
    for (name, p), q in zip(plain.named_parameters(), checkpointed.parameters()):
        assert (p.grad - q.grad).abs().max().item() <= 1e-6, name
    assert set(dict(plain.state_dict())) == set(dict(checkpointed.state_dict()))


RECOMPUTATIONS = [FULL, Recompute("full", (), 1),
                  *(Recompute("selective", (name,), None) for name in RECOMPUTE_MODULES),
                  Recompute("selective", ("core_attn", "layernorm", "mlp_act"), 1)]


@pytest.mark.parametrize("name", ["gpt2", "qwen3_moe"])
def test_each_recomputation_gives_equal_losses_and_gradients(name):
    """Every recomputation choice (full, block, each selective module) gives the loss and gradients
    of none with attention dropout on (the recompute draws the forward's masks) and keeps fewer bytes
    for backward; GPT-2: LayerNorm, GELU; Qwen3-MoE: a dense layer, then an MoE one (q/k norms, SwiGLU
    experts); what exactly each keeps is test_planner_activations'."""
    torch.manual_seed(0)
    base = zoo_model(name, attn_pdrop=0.3) if name == "gpt2" else zoo_model(name, attention_dropout=0.3)
    base.train()
    ids = torch.randint(3, base.config.vocab_size, (2, 12))

    def run(recompute):
        model = copy.deepcopy(base)
        stack = model.transformer.h if name == "gpt2" else model.model.layers
        if recompute is not None:
            assert apply_activation_checkpointing(stack, recompute) == len(stack[:recompute.num_layers])
        torch.manual_seed(1)
        kept, loss = saved_bytes(lambda: model(input_ids=ids, labels=ids).loss, model)
        loss.backward()
        return loss.item(), torch.cat([p.grad.flatten() for p in model.parameters()]), kept

    loss, grads, kept = run(None)
    for recompute in RECOMPUTATIONS:
        if recompute.modules == ("moe",) and name == "gpt2":
            continue
        other, other_grads, other_kept = run(recompute)
        assert other == loss and (other_grads - grads).abs().max().item() <= 1e-6, recompute
        assert other_kept < kept, (recompute, other_kept, kept)


def test_bf16_autocast_trains_on_cpu():
    model = tiny_gpt2()
    before = [p.detach().clone() for p in model.parameters()]
    metrics, after = sgd_step(model, [batch(4, seed=3)], amp_dtype=torch.bfloat16)
    assert torch.isfinite(torch.tensor(metrics.loss)) and not metrics.skipped
    assert all(p.dtype == torch.float32 for p in after)
    assert any(not torch.equal(a, b) for a, b in zip(before, after))


def test_fp16_scaler_skips_overflowed_step_and_lowers_scale():
    model = tiny_gpt2()
    step = TrainStep([model], torch.optim.SGD(model.parameters(), lr=0.1), device=torch.device("cpu"),
                     amp_dtype=torch.float16)
    before = copy.deepcopy(model.state_dict())
    hook = model.transformer.ln_f.weight.register_hook(lambda g: torch.full_like(g, float("inf")))
    metrics = step([batch(4, seed=4)])
    hook.remove()
    assert metrics.skipped and metrics.loss_scale == 2.0**15  # 2**16 halved
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    metrics = step([batch(4, seed=5)])
    assert not metrics.skipped and metrics.loss_scale == 2.0**15
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_expert_bias_update_moves_deepseek_v3_routers_against_the_step_load():
    """train.expert_bias_update_rate (DeepSeek-V3's auxiliary-loss-free balancing): after the step, its
    MoE layer's correction bias has moved by rate · sign(mean − load) of the tokens the layer routed
    over the step's micro-batches (counted on a copy run alike), and nothing else moved it."""
    torch.manual_seed(0)
    model = zoo_model("deepseek_v3")
    micro = [batch(2, seed=6), batch(2, seed=7)]
    alike = copy.deepcopy(model).train()
    for mb in micro:
        alike(**mb).loss.backward()
    load = alike.model.layers[1].mlp.take_routed_tokens()
    bias = model.model.layers[1].mlp.router.e_score_correction_bias
    before = bias.clone()
    sgd_step(model.train(), micro, expert_bias_update_rate=1e-3)
    assert load.sum() == 2 * 2 * 2 * 16 and (bias - before).tolist() == (1e-3 * torch.sign(load.mean() - load)).tolist()


def test_best_checkpoint_and_max_to_keep(config_file, tmp_path):
    run(config_file, tmp_path, "train.eval.period=5", "train.eval.max_batches=1", "train.best_metric=loss",
        "train.best_mode=min", "train.checkpoint.max_to_keep=2")
    assert sorted(p.name for p in tmp_path.glob("model_*")) == ["model_0000015", "model_0000020", "model_best"]
    assert (tmp_path / "last_checkpoint").read_text() == "model_0000020"


def test_load_weight_from_a_hugging_face_directory(config_file, tmp_path):
    import transformers

    torch.manual_seed(3)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=8192, n_positions=32, n_embd=32, n_layer=2,
                                                              n_head=4)).eval()
    hf.save_pretrained(tmp_path / "hf")
    trainer = run(config_file, tmp_path / "run", "train.max_iter=0", f"train.load_weight={tmp_path / 'hf'}")
    ids = torch.randint(0, 8192, (2, 16))
    assert (trainer.model.eval()(ids).logits - hf(ids).logits).abs().max().item() <= 1e-5


def _tp2_losses(config_file: str, output_dir: str) -> dict[int, float]:
    run(Path(config_file), Path(output_dir), "dist.tp=2", "train.checkpoint.period=0", "train.max_iter=6")
    return losses(Path(output_dir)) if torch.distributed.get_rank() == 0 else {}


@pytest.mark.slow
def test_tensor_parallel_run_equals_one_process(config_file, tmp_path):
    """The same recipe at dist.tp=2 (two gloo processes) logs the one-process losses."""
    from support.forked import run_forked

    no_dropout = saved_recipe(  # dropout masks of split activations depend on the layout
        tmp_path / "no_dropout.yaml", config_file, "+model.config.embd_pdrop=0.0", "+model.config.attn_pdrop=0.0",
        "+model.config.resid_pdrop=0.0")
    run(no_dropout, tmp_path / "one", "train.checkpoint.period=0", "train.max_iter=6")
    tp2 = run_forked(_tp2_losses, 2, str(no_dropout), str(tmp_path / "tp2"))[0]
    one = losses(tmp_path / "one")
    assert sorted(tp2) == list(range(1, 7))
    assert max(abs(tp2[i] - one[i]) / one[i] for i in one) <= 1e-5


def test_resume_from_a_weights_only_checkpoint_says_use_load_weight(config_file, tmp_path):
    import transformers

    from libai_zoo.convert import hf_to_zoo

    transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=8192, n_positions=32, n_embd=32, n_layer=2,
                                                         n_head=4)).save_pretrained(tmp_path / "hf")
    hf_to_zoo(tmp_path / "hf", tmp_path / "run")
    with pytest.raises(ValueError, match=r"holds model weights only .* train.load_weight="):
        run(config_file, tmp_path / "run", resume=True)


def test_compiled_layers_train_like_eager_ones(config_file, straight, tmp_path):
    """train.compile names a torch.compile backend (aot_eager here: inductor's cold compile is too slow
    for CI); the compiled run logs the eager losses."""
    run(config_file, tmp_path, "train.checkpoint.period=0", "train.compile=aot_eager")
    compiled, eager = losses(tmp_path), losses(straight)
    assert max(abs(compiled[i] - eager[i]) for i in compiled) <= 1e-5


def test_lamb_from_the_config(config_file, tmp_path):
    """Any optimizer is one override away: LAMB takes the same parameter groups and keys as AdamW."""
    trainer = run(config_file, tmp_path, "optim._target_=libai_zoo.optim.Lamb", "optim.lr=2e-2",
                  "train.checkpoint.period=0", "train.max_iter=10")
    assert type(trainer.optimizer).__name__ == "Lamb"
    logged = losses(tmp_path)
    assert logged[10] < logged[1] - 0.03  # it learns: 10 LAMB steps lower the loss by about 0.05 here


# ------------------------------------------------------------------------- what a newcomer hit
def test_a_failed_run_logs_where_it_stopped_and_does_no_success_work(config_file, tmp_path):
    """No "trained N steps" line and no sample (generation would run collectives a dead peer never joins)."""
    from libai_zoo.engine import GenerateSample

    sample = GenerateSample(tokenizer=str(ROOT / "data/tokenizer"), prompt="Return the", max_new_tokens=2)
    cfg = LazyConfig.apply_overrides(LazyConfig.load(str(config_file)), [
        f"train.output_dir={tmp_path}", "train.max_iter=5", "train.micro_batch_size=4", "train.global_batch_size=4",
        "train.checkpoint.period=0"])
    with pytest.raises(KeyboardInterrupt):
        run_trainer(cfg, interrupt_after=3, hooks=[sample])
    log = (tmp_path / "log.txt").read_text()
    assert "the run stopped at iteration 3: KeyboardInterrupt: stopped after 3 steps" in log
    assert "trained" not in log and "sample after" not in log and not hasattr(sample, "text")
    run_trainer(LazyConfig.apply_overrides(cfg, [f"train.output_dir={tmp_path / 'whole'}", "train.max_iter=2"]),
                hooks=[sample])
    assert "trained 2 steps" in (tmp_path / "whole" / "log.txt").read_text() and isinstance(sample.text, str)


def test_a_hook_registered_after_the_writers_has_its_scalars_on_the_same_line(config_file, tmp_path):
    """Hooks record in after_step and the writers write in report_step, so a hook's order does not
    matter: a config's own hook (registered after the built-in writers) reaches each step's line."""
    from libai_zoo.engine import HookBase

    class Records(HookBase):
        def after_step(self) -> None:
            self.trainer.storage.put_scalar("custom", float(self.trainer.iter + 1))

    cfg = LazyConfig.apply_overrides(LazyConfig.load(str(config_file)), [
        f"train.output_dir={tmp_path}", "train.max_iter=3", "train.micro_batch_size=4", "train.global_batch_size=4",
        "train.log_period=1", "train.checkpoint.period=0"])
    run_trainer(cfg, hooks=[Records()])
    assert [(r["iteration"], r.get("custom")) for r in records(tmp_path)] == [(1, 1.0), (2, 2.0), (3, 3.0)]


def test_checkpoint_period_null_saves_nothing_and_zero_the_last_step(config_file, tmp_path):
    run(config_file, tmp_path / "null", "train.max_iter=2", "train.checkpoint.period=null")
    run(config_file, tmp_path / "zero", "train.max_iter=2", "train.checkpoint.period=0")
    assert len(records(tmp_path / "null")) == 2 and not list((tmp_path / "null").glob("model_*"))
    assert sorted(p.name for p in (tmp_path / "zero").glob("model_*")) == ["model_0000002"]


def test_a_short_run_cuts_a_longer_warmup_with_a_warning(config_file, tmp_path):
    run(config_file, tmp_path, "train.max_iter=3", "train.scheduler.warmup_iters=40", "train.checkpoint.period=0")
    assert [r["lr"] for r in records(tmp_path)] == pytest.approx([1e-3 / 3, 2e-3 / 3, 1e-3])
    assert "warmup_iters = 40 is longer than the run (max_iter = 3): warming up over all 3 steps" in \
        (tmp_path / "log.txt").read_text()


def test_clip_grad_norm_null_means_no_clipping(config_file, tmp_path):
    run(config_file, tmp_path / "null", "train.max_iter=3", "train.clip_grad_norm=null", "train.checkpoint.period=0")
    run(config_file, tmp_path / "huge", "train.max_iter=3", "train.clip_grad_norm=1e9", "train.checkpoint.period=0")
    unclipped, huge = records(tmp_path / "null"), records(tmp_path / "huge")
    assert [r["loss"] for r in unclipped] == [r["loss"] for r in huge]
    assert all(r["grad_norm"] > 1.0 for r in unclipped)  # the default (1.0) would have clipped them


def test_a_start_reads_the_config_once_and_builds_the_meta_model_once(config_file, tmp_path, monkeypatch):
    """The run's settings are parsed once and the meta model built once: the layout checks and the
    build read the same ones (the config is not read two ways)."""
    import libai_zoo.engine.default_trainer as trainer_module
    calls = {"run_settings": 0, "instantiate_model": 0}

    def counted(name):
        original = getattr(trainer_module, name)

        def call(*args, **kwargs):
            calls[name] += 1
            return original(*args, **kwargs)
        monkeypatch.setattr(trainer_module, name, call)
    counted("run_settings")
    counted("instantiate_model")
    trainer = run(config_file, tmp_path, "train.max_iter=1")
    assert calls == {"run_settings": 1, "instantiate_model": 1}
    assert trainer.settings.train.max_iter == 1 and trainer.settings.seq_len == 32
