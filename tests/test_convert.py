"""tools/convert: Hugging Face <-> libai_zoo checkpoints at any layout, Megatron-LM -> Hugging Face,
and `inspect`.

- A tiny GPT-2 goes HF -> zoo -> (trainer runs at dp2×tp2 and tp2×pp2 with lr 0, each saving a
  checkpoint at its layout) -> HF, and every tensor comes back bit-identical; the converted
  checkpoint trains on under ZeRO-3 at dp4 from the Hugging Face model's loss, and that ZeRO-3
  checkpoint converts to a (sharded) Hugging Face directory whose transformers logits are the
  training model's. The three runs share one 4-process call (start-up dominates on CPU).
- Megatron-LM checkpoints are written here, by a writer that follows Megatron's documented layout
  (independent of the converter), at tp2×pp2 and tp1×pp1 (QKV orders of checkpoint versions 3.0
  and 0), converted, and loaded with transformers: the logits are the source model's.
- inspect describes each kind; bad inputs fail with one line naming the problem.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch
import transformers
from safetensors.torch import load_file

from libai_zoo import distributed
from libai_zoo.config import LazyConfig
from libai_zoo.data import PackedTokenDataset
from libai_zoo.engine import DefaultTrainer
from support.forked import run_forked
from support.recipes import recipe

ROOT = Path(__file__).resolve().parents[1]
CLI = ROOT / "tools" / "convert"
VOCAB, SEQ, SAMPLES, GLOBAL_BATCH = 128, 16, 32, 8


# ------------------------------------------------------------------------------------ helpers
def _load_cli():
    spec = importlib.util.spec_from_file_location("convert_cli", CLI / "__main__.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


cli = _load_cli()


def convert(*argv) -> tuple[int, str, str]:
    """Run the CLI in this process: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = cli.main([str(a) for a in argv])
    return status, out.getvalue(), err.getvalue()


def ok(*argv) -> str:
    status, out, err = convert(*argv)
    assert status == 0, err
    return out


def tiny_gpt2(vocab: int = VOCAB, seed: int = 0) -> transformers.GPT2LMHeadModel:
    torch.manual_seed(seed)
    config = transformers.GPT2Config(vocab_size=vocab, n_positions=32, n_embd=32, n_layer=4, n_head=4, bos_token_id=1,
                                     eos_token_id=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config).eval()


def token_dataset(num_samples: int, seq_len: int, vocab: int, seed: int = 0) -> PackedTokenDataset:
    """Windows of one repeated random sequence: learnable in a few steps, so a run that trains
    shows it in its loss (built the same in every process)."""
    pattern = torch.randint(0, vocab, (seq_len,), generator=torch.Generator().manual_seed(seed))
    return PackedTokenDataset(pattern.repeat(num_samples), seq_len)


def has_row(text: str, *cells: str) -> bool:
    """Whether a line of `text` holds these table cells in order, separated by blanks."""
    return re.search(r"\s+".join(map(re.escape, cells)), text) is not None


def hf_tensors(directory: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


# ------------------------------------------------------------- HF -> zoo -> trainer -> HF (4 processes)
RUNS = {  # name -> (converted checkpoint, or "hf": the Hugging Face directory itself; steps, overrides)
    "dp2_tp2": ("zoo_dp2_tp2", 2, ["dist.dp=2", "dist.tp=2", "train.micro_batch_size=4", "optim.lr=0.0"]),
    "tp2_pp2": ("zoo_tp2_pp2", 2, ["dist.tp=2", "dist.pp=2", "train.micro_batch_size=4", "optim.lr=0.0"]),
    "hf_tp2_pp2": ("hf", 1, ["dist.tp=2", "dist.pp=2", "train.micro_batch_size=4", "optim.lr=0.0"]),
    "dp4_zero3": ("zoo_dp2_tp2", 3, ["dist.dp=4", "train.zero_stage=3", "train.micro_batch_size=2",
                                     "optim.lr=1e-2"]),
    "hf_dp2_tp2_zero3": ("hf", 1, ["dist.dp=2", "dist.tp=2", "train.zero_stage=3", "train.micro_batch_size=4",
                                   "optim.lr=0.0"]),
}
LOGIT_IDS = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(5))


def _train(config_file: str, root: str, hf_dir: str, name: str) -> dict:
    """One trainer run from a converted checkpoint (or the HF directory); {losses, logits after training} on rank 0."""
    source, steps, overrides = RUNS[name]
    weights = hf_dir if source == "hf" else f"{root}/{source}/model_0000000"
    cfg = LazyConfig.apply_overrides(LazyConfig.load(config_file), [
        f"train.output_dir={root}/run_{name}", f"train.max_iter={steps}", f"train.global_batch_size={GLOBAL_BATCH}",
        f"train.load_weight={weights}", "train.log_period=1", "train.checkpoint.period=0", *overrides])
    trainer = DefaultTrainer(cfg)
    try:
        trainer.resume_or_load(resume=False)
        trainer.train()
        logits = None
        if trainer.pipeline is None:
            with torch.no_grad():
                logits = trainer.model.eval()(input_ids=LOGIT_IDS).logits
    finally:
        distributed.destroy()
    metrics = Path(root) / f"run_{name}" / "metrics.json"
    losses = {r["iteration"]: r["loss"] for r in map(json.loads, metrics.read_text().splitlines())} \
        if metrics.is_file() else {}
    return {"losses": losses, "logits": logits}


def _bad_checkpoint_error(config_file: str, root: str) -> str | None:
    """This rank's error for a directory lacking the final norm, which only the last of 2 pipeline
    stages holds: every rank must raise (none may wait for a stage that failed alone)."""
    cfg = LazyConfig.apply_overrides(LazyConfig.load(config_file), [
        f"train.output_dir={root}/run_bad_hf", f"train.global_batch_size={GLOBAL_BATCH}",
        f"train.load_weight={root}/hf_without_ln_f", "dist.tp=2", "dist.pp=2", "train.micro_batch_size=4"])
    trainer = DefaultTrainer(cfg)
    try:
        trainer.resume_or_load(resume=False)
    except ValueError as error:
        return str(error)
    finally:
        distributed.destroy()
    return None


def _all_runs(config_file: str, root: str, hf_dir: str) -> dict:
    results = {name: _train(config_file, root, hf_dir, name) for name in RUNS}
    results["bad_hf"] = _bad_checkpoint_error(config_file, root)
    return results


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("hf") / "gpt2"
    tiny_gpt2().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory, hf_dir):
    root = tmp_path_factory.mktemp("convert_runs")
    ok("hf-to-zoo", hf_dir, root / "zoo_dp2_tp2", "--dp", 2, "--tp", 2)
    ok("hf-to-zoo", hf_dir, root / "zoo_tp2_pp2", "--tp", 2, "--pp", 2)
    cfg = recipe("converted_gpt2.py", f"dataloader.train.num_samples={SAMPLES}", f"dataloader.train.seq_len={SEQ}",
                 f"dataloader.train.vocab={VOCAB}")
    cfg.model = LazyConfig.load(root / "zoo_dp2_tp2" / "config.yaml", keys="model").model  # what hf-to-zoo recorded
    config_file = root / "config.yaml"
    LazyConfig.save(cfg, config_file)
    shutil.copytree(hf_dir, root / "hf_without_ln_f")
    weights = safetensors.torch.load_file(hf_dir / "model.safetensors")
    safetensors.torch.save_file({k: v for k, v in weights.items() if "ln_f" not in k},
                                root / "hf_without_ln_f" / "model.safetensors", metadata={"format": "pt"})
    ranks = run_forked(_all_runs, 4, str(config_file), str(root), str(hf_dir))
    return root, {**ranks[0], "bad_hf_per_rank": [rank["bad_hf"] for rank in ranks]}


def _hf_loss(hf_dir: Path) -> float:
    """transformers' loss on the first global batch (the trainer's step 1 without shuffling)."""
    batch = torch.stack([token_dataset(SAMPLES, SEQ, VOCAB)[i]["input_ids"] for i in range(GLOBAL_BATCH)])
    model = transformers.GPT2LMHeadModel.from_pretrained(hf_dir).eval()
    with torch.no_grad():
        return model(input_ids=batch, labels=batch).loss.item()


def test_hf_to_zoo_writes_checkpoint_pointer_and_records(hf_dir, tmp_path):
    out = ok("hf-to-zoo", hf_dir, tmp_path / "zoo", "--dp", 2, "--tp", 2)
    zoo = tmp_path / "zoo"
    assert f"train.load_weight={zoo / 'model_0000000'}" in out and "dp=2 tp=2 pp=1 (4 processes)" in out
    assert (zoo / "last_checkpoint").read_text() == "model_0000000"
    assert (zoo / "model_0000000" / ".metadata").is_file()
    assert not list((zoo / "model_0000000").glob("trainer_state_rank*.pt"))  # weights only
    assert json.loads((zoo / "hf_config.json").read_text()) == json.loads((hf_dir / "config.json").read_text())
    record = LazyConfig.load(zoo / "config.yaml")
    assert (record.dist.dp, record.dist.tp, record.dist.pp) == (2, 2, 1)
    assert record.conversion.world_size == 4 and record.conversion.model_class == "GPT2LMHeadModel"


@pytest.mark.slow
@pytest.mark.parametrize("run, target", [("dp2_tp2", "run_dp2_tp2"), ("tp2_pp2", "run_tp2_pp2/model_0000002")])
def test_hf_zoo_layout_hf_is_bit_identical(runs, hf_dir, tmp_path, run, target):
    """The trainer loaded the converted checkpoint at the layout, stepped with lr 0 and saved at
    that layout; back in Hugging Face form every tensor equals the original."""
    root, results = runs
    ok("zoo-to-hf", root / target, tmp_path / "hf")
    original, final = hf_tensors(hf_dir), hf_tensors(tmp_path / "hf")
    assert sorted(final) == sorted(original)
    assert all(torch.equal(final[name], original[name]) for name in original)
    assert results[run]["losses"][1] == pytest.approx(_hf_loss(hf_dir), rel=1e-5)


@pytest.mark.slow
def test_hugging_face_directory_loads_into_pipeline_stages(runs, hf_dir):
    """train.load_weight=HF_DIR at tp2×pp2: the last stage's copy of the tied embedding loads too."""
    _, results = runs
    assert results["hf_tp2_pp2"]["losses"][1] == pytest.approx(_hf_loss(hf_dir), rel=1e-5)


@pytest.mark.slow
def test_a_checkpoint_missing_a_last_stage_tensor_fails_on_every_rank(runs):
    _, results = runs
    for error in results["bad_hf_per_rank"]:
        assert error is not None and "2 missing tensor(s): transformer.ln_f.weight, transformer.ln_f.bias" \
            in error, error


@pytest.mark.slow
def test_hugging_face_directory_loads_by_slices_under_zero3(runs, hf_dir):
    """Each rank reads its tp slice of each tensor and keeps its ZeRO-3 shard of it: the first
    loss is the checkpoint's."""
    _, results = runs
    assert results["hf_dp2_tp2_zero3"]["losses"][1] == pytest.approx(_hf_loss(hf_dir), rel=1e-5)


@pytest.mark.slow
def test_converted_checkpoint_trains_on_under_zero3(runs, hf_dir):
    _, results = runs
    losses = results["dp4_zero3"]["losses"]
    assert sorted(losses) == [1, 2, 3]
    assert all(math.isfinite(loss) for loss in losses.values())
    assert losses[1] == pytest.approx(_hf_loss(hf_dir), rel=1e-5)
    assert losses[3] < losses[1] - 0.1  # it learns the repeated sequence


@pytest.mark.slow
def test_zero3_checkpoint_to_sharded_hf_gives_the_training_models_logits(runs, tmp_path):
    root, results = runs
    out = ok("zoo-to-hf", root / "run_dp4_zero3", tmp_path / "hf", "--max-shard-size", "100KB")
    assert "model_0000003" in out
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "hf").glob("model-*.safetensors"))) > 1
    theirs = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        logits = theirs(input_ids=LOGIT_IDS).logits
    assert (logits - results["dp4_zero3"]["logits"]).abs().max().item() <= 1e-5


@pytest.mark.slow
def test_inspect_libai_zoo_checkpoints(runs):
    root, _ = runs
    out = ok("inspect", root / "run_dp4_zero3")
    assert "last_checkpoint -> model_0000003" in out
    assert "layout (its config.yaml): dp=4 tp=1 pp=1 zero_stage=3" in out
    assert "iteration = 3" in out
    assert "4 chunks (4 along dim 0)" in out  # FSDP's dim-0 shards, one per rank
    assert "model.transformer.h.0.attn.qkv.weight" in out and "optim.state.transformer.wte.weight.exp_avg" in out
    out = ok("inspect", root / "zoo_dp2_tp2" / "model_0000000")
    assert "trainer state: none" in out
    assert "target layout of a conversion" in out
    assert has_row(out, "model.transformer.wte.weight", "[128, 32]", "float32", "1 chunk")


# --------------------------------------------------------------------------- hf-to-zoo in one process
def test_hf_to_zoo_refuses_a_layout_the_model_cannot_take(hf_dir, tmp_path):
    status, _, err = convert("hf-to-zoo", hf_dir, tmp_path / "a", "--tp", 3)
    assert status == 1
    assert "num_heads = 4 is not divisible by tp = 3" in err and "vocabulary size = 128" in err
    status, _, err = convert("hf-to-zoo", hf_dir, tmp_path / "b", "--pp", 5)
    assert "pp = 5 is larger than the number of layers 4" in err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_hf_to_zoo_loads_in_one_process_and_exports_back(hf_dir, tmp_path):
    """No process group: the checkpoint loads whole (load_checkpoint_model) and exports unchanged."""
    from libai_zoo.convert import load_checkpoint_model

    ok("hf-to-zoo", hf_dir, tmp_path / "zoo")
    model = load_checkpoint_model(tmp_path / "zoo" / "model_0000000")
    ours = transformers.GPT2LMHeadModel.from_pretrained(hf_dir).eval()
    with torch.no_grad():
        assert torch.allclose(model(input_ids=LOGIT_IDS).logits, ours(input_ids=LOGIT_IDS).logits, atol=1e-5)
    ok("zoo-to-hf", tmp_path / "zoo" / "model_0000000", tmp_path / "hf")
    original, back = hf_tensors(hf_dir), hf_tensors(tmp_path / "hf")
    assert sorted(back) == sorted(original) and all(torch.equal(back[n], original[n]) for n in original)
    status, _, err = convert("hf-to-zoo", hf_dir, tmp_path / "zoo")
    assert status == 1 and "is not empty" in err


@pytest.mark.parametrize("case", ["bert_cls", "roberta_mlm", "llama", "qwen2", "vit_cls", "t5", "t5_v1_1", "swin_cls",
                                  "swinv2_cls"])
def test_hf_to_zoo_to_hf_for_every_model_family(tmp_path, case):
    """The class comes from config.json (model_type, architectures); tp = 2 is checked (GQA: 2 KV heads)."""
    from model_cases import CASES, make_hf_model

    make_hf_model(CASES[case]).save_pretrained(tmp_path / "hf")
    ok("hf-to-zoo", tmp_path / "hf", tmp_path / "zoo", "--tp", 2)
    out = ok("zoo-to-hf", tmp_path / "zoo", tmp_path / "back")
    assert CASES[case].zoo_class.__name__ in out
    original, back = hf_tensors(tmp_path / "hf"), hf_tensors(tmp_path / "back")
    assert sorted(back) == sorted(original) and all(torch.equal(back[n], original[n]) for n in original)


def test_an_encoder_decoder_has_no_megatron_core_form(tmp_path):
    from model_cases import CASES, make_hf_model

    make_hf_model(CASES["t5"]).save_pretrained(tmp_path / "hf")
    status, _, err = convert("hf-to-megatron", tmp_path / "hf", tmp_path / "megatron")
    assert status == 1 and "T5ForConditionalGeneration has no Megatron-Core form" in err


# ---------------------------------------------------------------------- Megatron-LM checkpoints
MEGATRON_VOCAB = 200  # padded by the writer to a multiple of 128 × tp, as Megatron-LM does


def write_megatron(model: transformers.GPT2LMHeadModel, root: Path, tp: int, pp: int, *, version: float = 3.0,
                   encoder: str = "encoder", iteration: int | str = 10, numpy_rng: bool = False) -> Path:
    """A Megatron-LM GPT checkpoint of `model`, written from Megatron's layout (not by the converter):
    iter_XXXXXXX/mp_rank_TT[_PPP]/model_optim_rng.pt with model.language_model.{embedding, encoder},
    Linear weights [out, in], fused QKV per head in the order of `version`, tp splits by rows
    (column parallel, vocabulary) or columns (row parallel), stage-local layer numbers."""
    config = model.config
    hf = {name: t.detach().clone() for name, t in model.state_dict().items()}
    hidden, heads, layers = config.n_embd, config.n_head, config.n_layer
    head_dim, per_stage = hidden // heads, layers // pp
    multiple = 128 * tp
    padded = -(-config.vocab_size // multiple) * multiple
    pad = torch.randn(padded - config.vocab_size, hidden, generator=torch.Generator().manual_seed(3))
    words = torch.cat([hf["transformer.wte.weight"], pad])
    untied = not config.tie_word_embeddings  # Megatron-LM's --untie-embeddings-and-output-weights
    head = torch.cat([hf["lm_head.weight"], pad]) if untied else None

    def rows(t: torch.Tensor, rank: int) -> torch.Tensor:
        return t.chunk(tp, dim=0)[rank].clone()

    def columns(t: torch.Tensor, rank: int) -> torch.Tensor:
        return t.chunk(tp, dim=1)[rank].clone()

    def qkv(t: torch.Tensor, rank: int) -> torch.Tensor:
        fused = t.t() if t.dim() == 2 else t                    # Linear layout: rows q | k | v
        fused = fused.reshape(3, heads, head_dim, *fused.shape[1:])
        fused = fused[:, rank * heads // tp:(rank + 1) * heads // tp]  # this rank's heads
        if version >= 2:
            fused = fused.movedim(0, 1)                          # [head][q, k, v][head_dim]
        elif version == 1.0:
            fused = fused.movedim(0, 2)                          # [head][head_dim][q, k, v]
        return fused.reshape(-1, *fused.shape[3:]).clone()       # version 0: [q, k, v][head][head_dim]

    args = argparse.Namespace(
        num_layers=layers, hidden_size=hidden, ffn_hidden_size=4 * hidden, num_attention_heads=heads,
        kv_channels=head_dim, max_position_embeddings=config.n_positions, seq_length=config.n_positions,
        padded_vocab_size=padded, make_vocab_size_divisible_by=128, tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp, openai_gelu=True, bias_gelu_fusion=False,
        layernorm_epsilon=config.layer_norm_epsilon, hidden_dropout=0.0, attention_dropout=0.0,
        position_embedding_type="learned_absolute", add_bias_linear=True, params_dtype=torch.float32,
        untie_embeddings_and_output_weights=untied)
    directory = root / ("release" if iteration == "release" else f"iter_{iteration:07d}")
    for t in range(tp):
        for p in range(pp):
            language_model, stage = {}, {}
            if p == 0:
                language_model["embedding"] = {"word_embeddings": {"weight": rows(words, t)},
                                               "position_embeddings": {"weight": hf["transformer.wpe.weight"]}}
            for local in range(per_stage):
                h, m = f"transformer.h.{p * per_stage + local}.", f"layers.{local}."
                stage.update({
                    m + "input_layernorm.weight": hf[h + "ln_1.weight"],
                    m + "input_layernorm.bias": hf[h + "ln_1.bias"],
                    m + "self_attention.query_key_value.weight": qkv(hf[h + "attn.c_attn.weight"], t),
                    m + "self_attention.query_key_value.bias": qkv(hf[h + "attn.c_attn.bias"], t),
                    m + "self_attention.dense.weight": columns(hf[h + "attn.c_proj.weight"].t(), t),
                    m + "self_attention.dense.bias": hf[h + "attn.c_proj.bias"],
                    m + "post_attention_layernorm.weight": hf[h + "ln_2.weight"],
                    m + "post_attention_layernorm.bias": hf[h + "ln_2.bias"],
                    m + "mlp.dense_h_to_4h.weight": rows(hf[h + "mlp.c_fc.weight"].t(), t),
                    m + "mlp.dense_h_to_4h.bias": rows(hf[h + "mlp.c_fc.bias"], t),
                    m + "mlp.dense_4h_to_h.weight": columns(hf[h + "mlp.c_proj.weight"].t(), t),
                    m + "mlp.dense_4h_to_h.bias": hf[h + "mlp.c_proj.bias"],
                })
            if p == pp - 1:
                stage.update({"final_layernorm.weight": hf["transformer.ln_f.weight"],
                              "final_layernorm.bias": hf["transformer.ln_f.bias"]})
            language_model[encoder] = stage
            if p == pp - 1 and untied:
                language_model["output_layer"] = {"weight": rows(head, t)}
            megatron_model = {"language_model": language_model}
            if p == pp - 1 and pp > 1 and not untied:
                megatron_model["word_embeddings_for_head"] = {"weight": rows(words, t)}
            state = {"args": args, "checkpoint_version": version,
                     "iteration": 0 if iteration == "release" else iteration, "model": megatron_model,
                     "optimizer": {"state": {}, "param_groups": [{"lr": 1e-4}]}}
            if numpy_rng:
                import numpy as np

                state["rng_state"] = [{"np_rng_state": np.random.RandomState(0).get_state(),
                                       "torch_rng_state": torch.get_rng_state()}]
            shard = directory / (f"mp_rank_{t:02d}" if pp == 1 else f"mp_rank_{t:02d}_{p:03d}")
            shard.mkdir(parents=True)
            torch.save(state, shard / "model_optim_rng.pt")
    (root / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return root


@pytest.fixture(scope="module")
def megatron_source() -> transformers.GPT2LMHeadModel:
    return tiny_gpt2(vocab=MEGATRON_VOCAB, seed=1)


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


MEGATRON_IDS = torch.randint(0, MEGATRON_VOCAB, (2, 12), generator=torch.Generator().manual_seed(9))


@pytest.mark.parametrize("tp, pp, version, encoder, iteration", [
    (2, 2, 3.0, "encoder", 10), (1, 1, 3.0, "encoder", 20), (1, 1, 0, "transformer", "release"),
    (2, 1, 1.0, "encoder", 30)])
def test_megatron_to_hf_gives_the_source_models_logits(megatron_source, tmp_path, tp, pp, version, encoder,
                                                       iteration):
    write_megatron(megatron_source, tmp_path / "megatron", tp, pp, version=version, encoder=encoder,
                   iteration=iteration)
    if (tp, pp) == (1, 1):
        assert (tmp_path / "megatron" / str(iteration if iteration == "release" else f"iter_{iteration:07d}")
                / "mp_rank_00" / "model_optim_rng.pt").is_file()
    out = ok("megatron-to-hf", tmp_path / "megatron", tmp_path / "hf", "--vocab-size", MEGATRON_VOCAB)
    assert f"tp={tp}, pp={pp}" in out
    converted = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    assert converted.config.vocab_size == MEGATRON_VOCAB and converted.config.n_layer == 4
    difference = (_logits(converted, MEGATRON_IDS) - _logits(megatron_source, MEGATRON_IDS)).abs().max().item()
    assert difference <= 1e-5


def test_megatron_to_hf_keeps_the_padded_vocabulary_by_default(megatron_source, tmp_path):
    write_megatron(megatron_source, tmp_path / "megatron", 2, 1)
    ok("megatron-to-hf", tmp_path / "megatron" / "iter_0000010", tmp_path / "hf")  # an iteration directory works too
    converted = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    assert converted.config.vocab_size == 256  # 200 padded to a multiple of 128 × tp
    ours = _logits(converted, MEGATRON_IDS)[..., :MEGATRON_VOCAB]
    assert (ours - _logits(megatron_source, MEGATRON_IDS)).abs().max().item() <= 1e-5


def test_megatron_untied_output_layer_becomes_lm_head(tmp_path):
    source = tiny_gpt2(vocab=MEGATRON_VOCAB, seed=2)
    source.config.tie_word_embeddings = False
    source = transformers.GPT2LMHeadModel(source.config).eval()  # its own head
    write_megatron(source, tmp_path / "megatron", 2, 2)
    ok("megatron-to-hf", tmp_path / "megatron", tmp_path / "hf", "--vocab-size", MEGATRON_VOCAB)
    converted = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    assert not converted.config.tie_word_embeddings
    assert (_logits(converted, MEGATRON_IDS) - _logits(source, MEGATRON_IDS)).abs().max().item() <= 1e-5


def test_megatron_numpy_rng_state_needs_allow_numpy(megatron_source, tmp_path):
    write_megatron(megatron_source, tmp_path / "megatron", 1, 1, numpy_rng=True)
    status, _, err = convert("megatron-to-hf", tmp_path / "megatron", tmp_path / "hf")
    assert status == 1 and "pickles numpy objects" in err and "--allow-numpy" in err
    ok("megatron-to-hf", tmp_path / "megatron", tmp_path / "hf", "--allow-numpy", "--vocab-size", MEGATRON_VOCAB)
    converted = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    assert (_logits(converted, MEGATRON_IDS) - _logits(megatron_source, MEGATRON_IDS)).abs().max().item() <= 1e-5


def test_megatron_missing_shard_names_the_file(megatron_source, tmp_path):
    write_megatron(megatron_source, tmp_path / "megatron", 2, 2)
    shutil.rmtree(tmp_path / "megatron" / "iter_0000010" / "mp_rank_01_001")
    status, _, err = convert("megatron-to-hf", tmp_path / "megatron", tmp_path / "hf")
    assert status == 1
    assert "missing 1 shard file(s)" in err and str(Path("mp_rank_01_001") / "model_optim_rng.pt") in err
    assert "tp = 2, pp = 2" in err


def test_inspect_megatron_and_hf(megatron_source, hf_dir, tmp_path):
    write_megatron(megatron_source, tmp_path / "megatron", 2, 2)
    out = ok("inspect", tmp_path / "megatron")
    assert "iteration 10, from latest_checkpointed_iteration.txt" in out
    assert "layout: tp=2 pp=2 (4 shard files" in out and "checkpoint_version 3.0" in out
    assert "num_layers=4 hidden_size=32 num_attention_heads=4" in out
    assert "mp_rank_01_001 (tp rank 1, pp rank 1)" in out
    assert has_row(out, "model.language_model.encoder.layers.0.self_attention.query_key_value.weight", "[48, 32]",
                   "float32")
    out = ok("inspect", hf_dir)
    assert "model_type: gpt2, architectures: GPT2LMHeadModel" in out
    assert "weight files: model.safetensors" in out
    assert has_row(out, "transformer.wte.weight", "[128, 32]", "float32")


# ------------------------------------------------------------------------------------ bad inputs
@pytest.mark.parametrize("command, message", [
    ("hf-to-zoo", "has no config.json"), ("zoo-to-hf", "is not a libai_zoo checkpoint"),
    ("megatron-to-hf", "is not a Megatron-LM checkpoint"), ("inspect", "is not a checkpoint this tool knows")])
def test_a_directory_that_is_no_checkpoint_is_a_clear_error(tmp_path, command, message):
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    argv = [command, tmp_path] + ([] if command == "inspect" else [tmp_path / "out"])
    status, out, err = convert(*argv)
    assert status == 1 and out == ""
    assert err.startswith(f"python tools/convert {command}: error: ") and message in err and str(tmp_path) in err


def test_cli_help_and_errors_in_a_subprocess(tmp_path):
    for argv in ([], ["hf-to-zoo"], ["zoo-to-hf"], ["megatron-to-hf"], ["inspect"]):
        result = subprocess.run([sys.executable, str(CLI), *argv, "--help"], capture_output=True, text=True,
                                timeout=60)
        assert result.returncode == 0, result.stderr
        assert result.stdout.startswith(f"usage: python tools/convert {' '.join(argv)}".rstrip())
    result = subprocess.run([sys.executable, str(CLI), "inspect", str(tmp_path)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "is not a checkpoint this tool knows" in result.stderr
    result = subprocess.run([sys.executable, str(CLI), "zoo-to-hf", "a", "b", "--max-shard-size", "lots"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "'lots' is not a size" in result.stderr
