"""Every libai_zoo model at tp=2 (two gloo processes) against its `transformers` twin: loaded
with ``shard=True`` (each rank reading only its slices) and with ``from_pretrained`` +
``distributed.shard``; outputs, loss, gradients, greedy generation, sequence parallelism, saving back
to a Hugging Face directory, and the error for a tp that neither divides the KV heads nor is a
multiple of them (a multiple replicates them: qwen3_one_kv_head).

Each model is a case (tests/support/cases.py): the selected ones share one pair of processes (start-up
dominates on CPU), and a failure names its model; the parent computes the `transformers`
references and asserts on the numbers the ranks send back.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor

from libai_zoo import distributed
from libai_zoo.optim import clip_grad_norm_
from model_cases import (
    CASES,
    hf_checkpoint_grads,
    hf_generate,
    hf_named_grads,
    main_output,
    make_hf_model,
    make_inputs,
    qwen3_config,
)
from support.cases import Case, Cases

pytestmark = pytest.mark.slow

TP, TOL, NEW_TOKENS = 2, 1e-5, 20
# RoBERTa's encoder and classifier are BERT's layers (run here as bert and bert_cls): its MLM stands for it
TP_CASES = [name for name in CASES if name not in ("roberta", "roberta_cls")]


def _admits_sequence_parallelism(name: str) -> bool:
    """Whether the case's task model runs under sequence parallelism (its layout_problems; built on
    meta): Swin refuses it."""
    with torch.device("meta"):
        model = CASES[name].zoo_class(CASES[name].make_config())
    return not model.layout_problems(sequence_parallel=True, cp=1, ep=1)


SEQUENCE_PARALLEL_CASES = tuple(name for name in TP_CASES
                                if CASES[name].kind not in ("encoder", "image", "seq2seq_body", "text_encoder")
                                and _admits_sequence_parallelism(name))
TIED = {"gpt2": ("lm_head", "transformer.wte"), "llama_tied_bias": ("lm_head", "model.embed_tokens"),
        "gemma": ("lm_head", "model.embed_tokens"), "t5": ("lm_head", "shared"), "mt5": ("lm_head", "shared"),
        "bert_mlm": ("mlm_head.decoder", "bert.embeddings.word_embeddings"),
        "roberta_mlm": ("mlm_head.decoder", "roberta.embeddings.word_embeddings")}


def _diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    if a.dim() >= 3 and a.shape[:2] == mask.shape:
        a, b = a[mask], b[mask]
    return (a - b).abs().max().item()


def _run_case(model, case, ref) -> dict:
    inputs, mask = make_inputs(case)
    out = model(**inputs)
    result = {"output": _diff(main_output(out), ref["output"], mask)}
    if "router_logits" in ref:  # each MoE layer's [tokens, E], of the whole sequence under SP too
        result["router_logits"] = max((ours - theirs).abs().max().item()
                                      for ours, theirs in zip(out.router_logits, ref["router_logits"], strict=True))
    if "loss" in ref:
        result["loss"] = abs(out.loss.item() - ref["loss"])
        out.loss.backward()
        grads = hf_named_grads(model)  # gathered: every rank takes part
        result["grad_names"] = set(grads) == set(ref["grads"])
        distributed.finalize_grads(model)
        result["grad_norm"] = abs(clip_grad_norm_(model.parameters(), 0.0).item() - ref["grad_norm"])
        result["grads"] = max((grads[n] - ref["grads"][n]).abs().max().item() for n in grads)
    return result


def _tp2(root: str, name: str) -> dict:
    """Model `name` at tp2: loaded with shard=True and through distributed.shard (and with
    sequence parallelism), generating, saving; the numbers against its reference."""
    ctx = distributed.init(dp=1, tp=TP)
    case, path = CASES[name], Path(root) / name
    ref = torch.load(path / "ref.pt", weights_only=False)
    model, info = case.zoo_class.from_pretrained(path / "sharded", shard=True, output_loading_info=True)
    results = {"shard=True": _run_case(model, case, ref)}
    results["shard=True"]["bytes_read"] = info["bytes_read"]
    results["shard=True"]["bytes_held"] = sum(  # this rank's parameter memory, tied ones once
        (p.to_local() if isinstance(p, DTensor) else p).nbytes for p in model.parameters())
    if case.generates:
        ids, mask = ref["prompt"]
        generated = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, eos_token_id=None)
        results["generate"] = torch.equal(generated, ref["generated"])
        torch.manual_seed(ctx.rank)  # each rank draws differently: the tokens must still agree
        results["sampled"] = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=True,
                                            temperature=2.0, top_k=20, eos_token_id=None)
    if name in TIED:
        head, embedding = (model.get_submodule(m) for m in TIED[name])
        results["tied"] = head.weight is embedding.weight
    model.save_pretrained(Path(root) / "saved" / name, max_shard_size="20KB")
    full = distributed.shard(case.zoo_class.from_pretrained(path / "single"))
    results["dist.shard"] = _run_case(full, case, ref)
    if name in SEQUENCE_PARALLEL_CASES:
        sp = distributed.shard(case.zoo_class.from_pretrained(path / "single"), sequence_parallel=True)
        results["sequence_parallel"] = _run_case(sp, case, ref)
        if case.generates:  # the trainer's end-of-run sample: the same model, sequences whole for generation
            ids, mask = ref["prompt"]
            with distributed.whole_sequences(sp.eval()):
                generated = sp.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, eos_token_id=None)
            results["sequence_parallel"]["generate"] = torch.equal(generated, ref["generated"])
    return results


def _heads_error(root: str) -> str | None:
    distributed.init(dp=1, tp=TP)
    try:
        CASES["qwen3"].zoo_class.from_pretrained(Path(root) / "qwen3_three_kv_heads", shard=True)
    except ValueError as error:
        return str(error)
    return None


def _reference(root: str, name: str) -> dict:
    """transformers' outputs, loss, gradients and generation for model `name`, and its files
    (whole and in 20 KB shards); kept in ref.pt for the ranks."""
    case, path = CASES[name], Path(root) / name
    hf = make_hf_model(case)
    hf.save_pretrained(path / "single")
    hf.save_pretrained(path / "sharded", max_shard_size="20KB")
    inputs, _ = make_inputs(case)
    out = hf(**inputs)
    stored = load_file(path / "single" / "model.safetensors").values()
    ref = {"output": main_output(out).detach(), "model_bytes": sum(t.numel() * t.element_size() for t in stored)}
    if getattr(out, "router_logits", None):
        ref["router_logits"] = [logits.detach() for logits in out.router_logits]
    if "labels" in inputs:
        out.loss.backward()
        ref["loss"] = out.loss.item()
        ref["grads"] = hf_checkpoint_grads(hf, Path(root) / f"{name}_grads")
        ref["grad_norm"] = torch.stack([g.norm() for g in ref["grads"].values()]).norm().item()
    if case.generates:
        ids = inputs["input_ids"]
        mask = torch.ones_like(ids)
        mask[-1, :3] = 0
        ref["prompt"] = ids, mask
        ref["generated"] = hf_generate(hf, ids, attention_mask=mask, max_new_tokens=NEW_TOKENS)
    torch.save(ref, path / "ref.pt")
    return ref


def _three_kv_heads(root: Path) -> None:
    """A Qwen3 with 6 heads in 3 KV groups: tp2 neither splits the KV heads nor replicates them evenly."""
    CASES["qwen3"].hf_class(qwen3_config(num_attention_heads=6, num_key_value_heads=3)).save_pretrained(
        root / "qwen3_three_kv_heads")


RUNS = Cases(__file__, {
    **{f"ref_{name}": Case(1, _reference, (name,)) for name in TP_CASES},
    **{name: Case(TP, _tp2, (name,), needs=(f"ref_{name}",)) for name in TP_CASES},
    "heads_error": Case(TP, _heads_error),
}, _three_kv_heads, param="name")
tp_results = RUNS.fixture("tp_results")


@pytest.mark.parametrize("how", ["shard=True", "dist.shard"])
@pytest.mark.parametrize("name", TP_CASES)
def test_tp2_equals_transformers(tp_results, name, how):
    ref = tp_results(f"ref_{name}")
    for rank_results in tp_results.ranks(name):
        r = rank_results[how]
        assert r["output"] <= TOL and r.get("router_logits", 0) <= TOL
        if "loss" in ref:
            assert r["loss"] <= TOL and r["grad_names"] and r["grads"] <= TOL
            assert r["grad_norm"] <= 1e-5 * ref["grad_norm"]  # the global norm over shards, counted once


@pytest.mark.parametrize("name", SEQUENCE_PARALLEL_CASES)
def test_tp2_sequence_parallel_equals_transformers(tp_results, name):
    ref = tp_results(f"ref_{name}")
    for rank_results in tp_results.ranks(name):
        r = rank_results["sequence_parallel"]
        assert r["output"] <= TOL and r["loss"] <= TOL and r["grads"] <= TOL and r.get("router_logits", 0) <= TOL
        assert r["grad_norm"] <= 1e-5 * ref["grad_norm"]
        assert r.get("generate", not CASES[name].generates)  # generated with SP lifted (`whole_sequences`)


@pytest.mark.parametrize("name", [n for n in TP_CASES if CASES[n].generates])
def test_tp2_greedy_generate_equals_transformers(tp_results, name):
    assert all(rank_results["generate"] for rank_results in tp_results.ranks(name))


@pytest.mark.parametrize("name", list(TIED))
def test_tp2_keeps_tied_weights_one_parameter(tp_results, name):
    assert all(rank_results["tied"] for rank_results in tp_results.ranks(name))


@pytest.mark.parametrize("name", [n for n in TP_CASES if CASES[n].generates])
def test_tp2_sampling_agrees_across_ranks(tp_results, name):
    first, second = (rank_results["sampled"] for rank_results in tp_results.ranks(name))
    assert torch.equal(first, second)


@pytest.mark.parametrize("name", ["llama", "gpt2", "bert_mlm"])
def test_shard_true_reads_and_holds_about_half_the_bytes(tp_results, name):
    """Half, plus the replicated norms, biases and position tables (a large share of these tiny models)."""
    ref = tp_results(f"ref_{name}")
    for rank_results in tp_results.ranks(name):
        r = rank_results["shard=True"]
        read, held = r["bytes_read"] / ref["model_bytes"], r["bytes_held"] / ref["model_bytes"]
        assert 0.5 <= read <= 0.62 and 0.5 <= held <= 0.62, (read, held)


@pytest.mark.parametrize("name", TP_CASES)
def test_tp2_save_pretrained_loads_in_transformers(tp_results, name):
    ref, _ = tp_results(f"ref_{name}"), tp_results(name)  # the ranks saved it
    case = CASES[name]
    reloaded = case.hf_class.from_pretrained(tp_results.root / "saved" / name).eval()
    inputs, mask = make_inputs(case)
    assert _diff(main_output(reloaded(**inputs)), ref["output"], mask) <= TOL


@pytest.mark.cases("heads_error")
def test_tp_that_neither_divides_nor_is_a_multiple_of_the_kv_heads(tp_results):
    """(A multiple replicates each KV head: the case qwen3_one_kv_head.)"""
    assert "num_kv_heads = 3 is not divisible by tp = 2, nor tp by it" in tp_results("heads_error")
