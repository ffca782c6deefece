"""Pipeline parallelism (libai_zoo.parallel.pipeline) on 4 gloo processes against one process.

A tiny GPT-2 (tied embeddings) and a tiny Llama (untied), 4 layers each, run pipelined steps
over a fixed batch in every 4-rank layout below: two steps on the batch (the schedule reused,
gradients accumulating), then one on shorter sequences (shapes inferred again). The loss (mean
over every target token of the global batch) and every parameter gradient, under its full-model
name, must equal those of the one-process model computed in the parent. All layouts share one
run of 4 processes (start-up dominates on CPU): each rank sends its numbers back and the parent
asserts.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from torch.distributed.tensor import DTensor

from distributed_runner import run_distributed
from libai_zoo.models import GPT2LMHeadModel, LlamaForCausalLM
from libai_zoo.parallel.pipeline import SCHEDULES, Pipeline, StageLayers, prune_for_stage, split_layers

pytestmark = pytest.mark.slow

VOCAB, HIDDEN, LAYERS, BATCH, SEQ = 64, 32, 4, 8, 16
LOSS_TOL, GRAD_TOL = 1e-5, 1e-5

# (name, dp, tp, pp, schedule, virtual stages, micro-batches per step, sequence parallel, models)
LAYOUTS = [
    ("pp4_gpipe", 1, 1, 4, "gpipe", 1, 4, False, ("gpt2", "llama")),
    ("pp4_1f1b", 1, 1, 4, "1f1b", 1, 4, False, ("gpt2", "llama")),
    ("pp2_tp2_1f1b", 1, 2, 2, "1f1b", 1, 2, False, ("gpt2", "llama")),
    ("pp2_tp2_sp_1f1b", 1, 2, 2, "1f1b", 1, 2, True, ("gpt2", "llama")),
    ("pp2_dp2_1f1b", 2, 1, 2, "1f1b", 1, 2, False, ("gpt2", "llama")),
    ("pp2x2v_dp2_interleaved", 2, 1, 2, "interleaved_1f1b", 2, 2, False, ("gpt2", "llama")),
    ("pp2x2v_tp2_interleaved", 1, 2, 2, "interleaved_1f1b", 2, 4, False, ("gpt2",)),
]
if "zero_bubble" in SCHEDULES:
    LAYOUTS.append(("pp2x2v_tp2_zero_bubble", 1, 2, 2, "zero_bubble", 2, 2, False, ("gpt2", "llama")))
if "zbv" in SCHEDULES:  # V placement: stages 0 and 3 on pp rank 0, the tied copies on one rank
    LAYOUTS.append(("pp2x2v_dp2_zbv", 2, 1, 2, "zbv", 2, 2, False, ("gpt2",)))
SHORT = 8  # the third step's sequence length: a new shape, so the stages infer shapes again


def make_model(name: str):
    torch.manual_seed(0)
    if name == "gpt2":
        config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS, n_head=4, n_inner=64,
                                         n_positions=32, bos_token_id=1, eos_token_id=2, resid_pdrop=0.0,
                                         embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True)
        return GPT2LMHeadModel(config)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                                      num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                                      max_position_embeddings=32, tie_word_embeddings=False, attention_dropout=0.0,
                                      bos_token_id=1, eos_token_id=2)
    return LlamaForCausalLM(config)


def make_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = ids.clone()
    labels[1, 5:9] = -100  # some ignored targets: the mean counts only the others
    labels[6, -3:] = -100
    return ids, labels


def _step(pipe, ctx, ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor | None, float]:
    """One pipelined step on this dp rank's rows; (the returned loss, the mean loss over the global batch)."""
    dp = ctx.dp
    local = slice(ctx.dp_rank * len(ids) // dp, (ctx.dp_rank + 1) * len(ids) // dp)
    targets = (labels[:, 1:] != -100).sum().item()  # over the global batch
    loss = pipe.step(ids[local], labels[local], loss_scale=dp / targets)
    value = torch.tensor([pipe.broadcast_loss(loss)], dtype=torch.float64)
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.AVG, group=ctx.group("dp"))
    return loss, value.item()


def _grads(pipe, ctx) -> dict[str, torch.Tensor]:
    """Every local gradient under its full-model name, averaged over dp, whole (full_tensor: all tp ranks call)."""
    from libai_zoo import dist

    for module in pipe.modules():
        dist.finalize_grads(module)  # partial (sequence-parallel) gradients of norms
    pipe.sync_tied_grads()
    grads = {}
    for name, param in pipe.named_parameters():
        grad = param.grad
        torch.distributed.all_reduce(grad.to_local() if isinstance(grad, DTensor) else grad,
                                     op=torch.distributed.ReduceOp.AVG, group=ctx.group("dp"))
        grads[name] = grad.full_tensor() if isinstance(grad, DTensor) else grad.clone()
        param.grad = None
    return grads


def _run_layout(layout, models: dict, ids: torch.Tensor, labels: torch.Tensor) -> dict:
    from libai_zoo import dist

    name, dp, tp, pp, schedule, virtual, micro, sp, model_names = layout
    ctx = dist.init(dp=dp, tp=tp, pp=pp, sequence_parallel=sp)
    results = {}
    for model_name in model_names:
        model = dist.shard(copy.deepcopy(models[model_name]))
        pipe = Pipeline(model, ctx, schedule=schedule, num_micro_batches=micro, virtual_stages=virtual)
        loss, first = _step(pipe, ctx, ids, labels)
        _, second = _step(pipe, ctx, ids, labels)  # the same shape: the schedule is reused, grads accumulate
        grads = _grads(pipe, ctx)
        _, short = _step(pipe, ctx, ids[:, :SHORT], labels[:, :SHORT])
        results[model_name] = {
            "losses": (first, second), "short_loss": short, "grads": grads, "short_grads": _grads(pipe, ctx),
            "loss_on_last_rank": loss is not None, "has_last": pipe.has_last,
            "keys": [list(s.model.state_dict()) for s in pipe.stages],
            "stage_indices": [s.stage_index for s in pipe.stages],
            "layers": [list(s.model.get_submodule(f"{s.model.base_model_prefix}.{s.body.layers_name}").indices)
                       for s in pipe.stages],
            "duplicates": [n for n, p in pipe.named_parameters() if any(p is d for d in pipe.tied_duplicates())],
        }
    dist.destroy()
    return results


def _errors(models: dict) -> dict:
    from libai_zoo import dist

    ctx = dist.init(dp=1, tp=1, pp=4)
    errors = {}
    for key, kwargs in {"too_many_stages": dict(schedule="interleaved_1f1b", num_micro_batches=4, virtual_stages=2),
                        "too_few_micro_batches": dict(schedule="1f1b", num_micro_batches=1),
                        "unknown_schedule": dict(schedule="dualpipe", num_micro_batches=4)}.items():
        try:
            Pipeline(models["gpt2"], ctx, **kwargs)
        except ValueError as error:
            errors[key] = str(error)
    try:
        Pipeline(models["gpt2"].transformer, ctx, num_micro_batches=4)
    except ValueError as error:
        errors["not_a_causal_lm"] = str(error)
    dist.destroy()
    return errors


def _ranks(models: dict, ids: torch.Tensor, labels: torch.Tensor) -> dict:
    results = {layout[0]: _run_layout(layout, models, ids, labels) for layout in LAYOUTS}
    results["errors"] = _errors(models)
    return results


def _reference(model, ids, labels) -> dict:
    model = copy.deepcopy(model)
    out = model(ids, labels=labels)
    out.loss.backward()
    return {"loss": out.loss.item(), "keys": set(model.state_dict()),
            "grads": {n: p.grad.clone() for n, p in model.named_parameters()}}


@pytest.fixture(scope="module")
def pipeline_results():
    ids, labels = make_batch()
    models = {name: make_model(name) for name in ("gpt2", "llama")}
    refs = {name: (_reference(model, ids, labels), _reference(model, ids[:, :SHORT], labels[:, :SHORT]))
            for name, model in models.items()}
    return run_distributed(_ranks, 4, models, ids, labels), refs


def _check_grads(model_name: str, rank: int, grads: dict, ref_grads: dict, factor: int) -> set:
    for param_name, grad in grads.items():
        tied = model_name == "gpt2" and param_name == "lm_head.weight"  # the last stage's copy
        ref_name = "transformer.wte.weight" if tied else param_name
        diff = (grad - factor * ref_grads[ref_name]).abs().max().item()
        assert diff <= GRAD_TOL, (model_name, rank, param_name, diff)
    return {"transformer.wte.weight" if model_name == "gpt2" and n == "lm_head.weight" else n for n in grads}


@pytest.mark.parametrize("layout", LAYOUTS, ids=[layout[0] for layout in LAYOUTS])
def test_pipeline_equals_one_process(pipeline_results, layout):
    """Two steps on the batch (gradients accumulate: twice the reference), then one on shorter sequences."""
    results, refs = pipeline_results
    name, model_names = layout[0], layout[-1]
    for model_name in model_names:
        ref, short = refs[model_name]
        seen_keys, seen_grads = set(), set()
        for rank, rank_results in enumerate(results):
            r = rank_results[name][model_name]
            assert r["loss_on_last_rank"] == r["has_last"]
            for loss, ref_loss in zip((*r["losses"], r["short_loss"]), (ref["loss"], ref["loss"], short["loss"])):
                assert abs(loss - ref_loss) <= LOSS_TOL * abs(ref_loss), (model_name, rank, loss, ref_loss)
            for stage_keys in r["keys"]:
                assert set(stage_keys) <= ref["keys"], set(stage_keys) - ref["keys"]
                seen_keys |= set(stage_keys)
            seen_grads |= _check_grads(model_name, rank, r["grads"], ref["grads"], 2)
            _check_grads(model_name, rank, r["short_grads"], short["grads"], 1)
            if model_name == "gpt2" and layout[3] > 1:  # the last stage's copy of the tied weight
                assert r["duplicates"] == (["lm_head.weight"] if r["has_last"] else [])
        assert seen_keys == ref["keys"]  # the stages together hold the whole model, under its names
        assert seen_grads == set(ref["grads"])


def test_stage_placement(pipeline_results):
    results, _ = pipeline_results
    # pp ranks are dim 0 of the mesh (pp, dp, tp): global ranks 0-1 are pp rank 0 at pp2 × dp2
    interleaved = results[0]["pp2x2v_dp2_interleaved"]["gpt2"]
    assert interleaved["stage_indices"] == [0, 2] and interleaved["layers"] == [[0], [2]]
    assert results[3]["pp2x2v_dp2_interleaved"]["gpt2"]["stage_indices"] == [1, 3]
    assert results[2]["pp4_1f1b"]["gpt2"]["layers"] == [[2]]
    if "zbv" in SCHEDULES:
        assert results[0]["pp2x2v_dp2_zbv"]["gpt2"]["stage_indices"] == [0, 3]


def test_clear_errors(pipeline_results):
    errors = pipeline_results[0][0]["errors"]
    assert "pp × virtual stages = 8 is larger than the number of layers 4" in errors["too_many_stages"]
    assert errors["too_few_micro_batches"] == ("1F1B needs at least pp = 4 micro-batches per step, got 1: "
                                               "raise train.global_batch_size or lower micro_batch_size")
    assert "unknown pipeline schedule 'dualpipe'" in errors["unknown_schedule"]
    assert "'1f1b'" in errors["unknown_schedule"]
    assert "causal LM" in errors["not_a_causal_lm"]


def test_split_layers():
    assert split_layers(10, 4) == [range(0, 3), range(3, 6), range(6, 8), range(8, 10)]
    assert split_layers(14, 4, [3, 7, 11]) == [range(0, 3), range(3, 7), range(7, 11), range(11, 14)]
    with pytest.raises(ValueError, match="larger than the number of layers 4"):
        split_layers(4, 5)
    with pytest.raises(ValueError, match="increase strictly"):
        split_layers(8, 3, [4, 4])
    with pytest.raises(ValueError, match="2 indices for 3 stages"):
        split_layers(8, 3, [4])


def test_prune_keeps_names_and_ties_in_one_process():
    model = make_model("gpt2")
    middle = prune_for_stage(model, range(1, 3), is_first=False, is_last=False)
    layers = middle.transformer.h
    assert isinstance(layers, StageLayers) and [type(layer).__name__ for layer in layers] == ["TransformerLayer"] * 2
    assert layers[2] is list(layers)[1] and middle.lm_head is None and middle.transformer.wte is None
    assert set(middle.state_dict()) == {k for k in model.state_dict() if k.startswith(("transformer.h.1.",
                                                                                       "transformer.h.2."))}
    whole = prune_for_stage(model, range(0, 4), is_first=True, is_last=True)
    assert whole.lm_head.weight is whole.transformer.wte.weight  # one stage: still one parameter
    last = prune_for_stage(model, range(3, 4), is_first=False, is_last=True)
    assert last.lm_head.weight is not model.lm_head.weight and torch.equal(last.lm_head.weight, model.lm_head.weight)
