"""Pipeline parallelism (libai_zoo.parallel.pipeline) on 4 gloo processes against one process.

A tiny GPT-2 (tied embeddings) and a tiny Llama (untied), 4 layers each, run pipelined steps
over a fixed batch in every 4-rank layout below: two steps on the batch (the schedule reused,
gradients accumulating), then one on shorter sequences (shapes inferred again). The pipeline
reads only the model contract, so a BERT masked LM (a padded batch: the attention mask reaches
every stage) and a ViT classifier run pipelined too, in two of the layouts. The loss (mean over
every target of the global batch) and every parameter gradient, under its full-model name, must
equal those of the one-process model computed in the parent. All layouts share one run of 4
processes (start-up dominates on CPU): each rank sends its numbers back and the parent asserts.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from torch.distributed.tensor import DTensor

from libai_zoo.models import (
    BertConfig,
    BertForMaskedLM,
    GPT2LMHeadModel,
    LlamaForCausalLM,
    ViTConfig,
    ViTForImageClassification,
    get_layer_stack,
)
from libai_zoo.parallel.pipeline import (
    TARGETS,
    Pipeline,
    PipelineStageModule,
    StageLayers,
    prune_for_stage,
    split_layers,
    stage_shared_parameters,
)
from support.forked import run_forked

pytestmark = pytest.mark.slow

VOCAB, HIDDEN, LAYERS, BATCH, SEQ = 64, 32, 4, 8, 16
LOSS_TOL, GRAD_TOL = 1e-5, 1e-5

# (name, dp, tp, pp, schedule, virtual stages, micro-batches per step, sequence parallel, models)
LAYOUTS = [
    ("pp4_gpipe", 1, 1, 4, "gpipe", 1, 4, False, ("gpt2", "llama")),
    ("pp4_1f1b", 1, 1, 4, "1f1b", 1, 4, False, ("gpt2", "llama")),
    ("pp2_tp2_1f1b", 1, 2, 2, "1f1b", 1, 2, False, ("gpt2", "llama", "bert_mlm", "vit_cls")),
    ("pp2_tp2_sp_1f1b", 1, 2, 2, "1f1b", 1, 2, True, ("gpt2", "llama")),
    ("pp2_dp2_1f1b", 2, 1, 2, "1f1b", 1, 2, False, ("gpt2", "llama", "bert_mlm", "vit_cls")),
    ("pp2x2v_dp2_interleaved", 2, 1, 2, "interleaved_1f1b", 2, 2, False, ("gpt2", "llama")),
    ("pp2x2v_tp2_interleaved", 1, 2, 2, "interleaved_1f1b", 2, 4, False, ("gpt2",)),
    ("pp2x2v_tp2_sp_zero_bubble", 1, 2, 2, "zero_bubble", 2, 2, True, ("gpt2", "llama")),
    # V placement: stages 0 and 3 on pp rank 0, the tied copies on one rank
    ("pp2x2v_dp2_zbv", 2, 1, 2, "zbv", 2, 2, False, ("gpt2",)),
]
SHORT = 8  # the third step's sequence length: a new shape, so the stages infer shapes again


MODELS = ("gpt2", "llama", "bert_mlm", "vit_cls")
NO_DROPOUT = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def make_model(name: str):
    torch.manual_seed(0)
    if name == "bert_mlm":
        return BertForMaskedLM(BertConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                                          num_attention_heads=4, intermediate_size=64, max_position_embeddings=32,
                                          **NO_DROPOUT))
    if name == "vit_cls":
        return ViTForImageClassification(ViTConfig(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=4,
                                                   intermediate_size=64, image_size=12, patch_size=4, num_labels=3,
                                                   **NO_DROPOUT))
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


def make_batch(name: str) -> dict[str, torch.Tensor]:
    """The global batch of one model: token ids with some ignored targets (BERT: masked positions,
    right padding and token types), or images with class labels."""
    g = torch.Generator().manual_seed(1)
    if name == "vit_cls":
        return {"pixel_values": torch.randn(BATCH, 3, 12, 12, generator=g), "labels": torch.randint(0, 3, (BATCH,))}
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    if name == "bert_mlm":
        mask = torch.ones_like(ids)
        mask[1, 10:] = mask[6, 5:] = 0  # padding: the mask must reach the layers of every stage
        chosen = (torch.rand(ids.shape, generator=g) < 0.3) & mask.bool()
        return {"input_ids": ids, "attention_mask": mask, "token_type_ids": (torch.arange(SEQ) >= 4).long().expand(
            BATCH, -1).clone(), "labels": ids.masked_fill(~chosen, -100)}
    labels = ids.clone()
    labels[1, 5:9] = -100  # some ignored targets: the mean counts only the others
    labels[6, -3:] = -100
    return {"input_ids": ids, "labels": labels}


def shorter(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The batch's sequences cut to SHORT positions (images stay as they are)."""
    return {k: v[:, :SHORT] if v.dim() == 2 and "pixel_values" not in batch else v for k, v in batch.items()}


def _step(pipe, ctx, batch: dict[str, torch.Tensor]) -> float:
    """One pipelined step on this dp rank's rows: the mean loss over the global batch (from the loss
    `Pipeline.step` returns on every rank of the pp group)."""
    dp, model = ctx.dp, pipe.model_parts[0]
    count = model.num_loss_targets(model.split_batch(batch)[1]).item()  # over the global batch
    rows = slice(ctx.dp_rank * BATCH // dp, (ctx.dp_rank + 1) * BATCH // dp)
    inputs, targets = model.split_batch({k: v[rows] for k, v in batch.items()})
    value = torch.tensor([pipe.step(inputs, targets, loss_scale=dp / count).loss], dtype=torch.float64)
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.AVG, group=ctx.group("dp"))
    return value.item()


def _named_parameters(pipe) -> dict[str, torch.nn.Parameter]:
    """(full-model name, parameter) of this rank's model parts, each parameter once."""
    named = {}
    for part in pipe.model_parts:
        for name, param in part.named_parameters():
            if all(param is not seen for seen in named.values()):
                named[name] = param
    return named


def _grads(pipe, ctx) -> dict[str, torch.Tensor]:
    """Every local gradient under its full-model name, averaged over dp, whole (full_tensor: all tp ranks call)."""
    from libai_zoo import distributed

    for part in pipe.model_parts:
        distributed.finalize_grads(part)  # partial (sequence-parallel) gradients of norms
    pipe.tied.sync_grads()
    grads = {}
    for name, param in _named_parameters(pipe).items():
        grad = param.grad
        torch.distributed.all_reduce(grad.to_local() if isinstance(grad, DTensor) else grad,
                                     op=torch.distributed.ReduceOp.AVG, group=ctx.group("dp"))
        grads[name] = grad.full_tensor() if isinstance(grad, DTensor) else grad.clone()
        param.grad = None
    return grads


def _run_layout(layout, models: dict, batches: dict) -> dict:
    from libai_zoo import distributed

    name, dp, tp, pp, schedule, virtual, micro, sp, model_names = layout
    ctx = distributed.init(dp=dp, tp=tp, pp=pp, sequence_parallel=sp)
    results = {}
    for model_name in model_names:
        model = distributed.shard(copy.deepcopy(models[model_name]))
        pipe = Pipeline(model, ctx, schedule=schedule, num_micro_batches=micro, virtual_stages=virtual)
        batch = batches[model_name]
        first = _step(pipe, ctx, batch)
        second = _step(pipe, ctx, batch)  # the same shape: the schedule is reused, grads accumulate
        grads = _grads(pipe, ctx)
        short = _step(pipe, ctx, shorter(batch))
        results[model_name] = {
            "losses": (first, second), "short_loss": short, "grads": grads, "short_grads": _grads(pipe, ctx),
            "has_last": pipe.has_last,
            "keys": [list(s.model.state_dict()) for s in pipe.stages],
            "stage_indices": [s.stage_index for s in pipe.stages],
            "layers": [get_layer_stack(s.model).indices for s in pipe.stages],
            "duplicates": [n for n, p in _named_parameters(pipe).items()
                           if any(p is d for d in pipe.tied.duplicates())],
        }
    distributed.destroy()
    return results


def _errors(models: dict) -> dict:
    from libai_zoo import distributed

    ctx = distributed.init(dp=1, tp=1, pp=4)
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
    except TypeError as error:
        errors["no_contract"] = str(error)
    distributed.destroy()
    return errors


def _ranks(models: dict, batches: dict) -> dict:
    results = {layout[0]: _run_layout(layout, models, batches) for layout in LAYOUTS}
    results["errors"] = _errors(models)
    return results


def _reference(model, batch: dict) -> dict:
    model = copy.deepcopy(model)
    out = model(**batch)
    out.loss.backward()
    return {"loss": out.loss.item(), "keys": set(model.state_dict()),
            "grads": {n: p.grad.clone() for n, p in model.named_parameters()}}


@pytest.fixture(scope="module")
def pipeline_results():
    models = {name: make_model(name) for name in MODELS}
    batches = {name: make_batch(name) for name in MODELS}
    refs = {name: (_reference(model, batches[name]), _reference(model, shorter(batches[name])))
            for name, model in models.items()}
    return run_forked(_ranks, 4, models, batches), refs


# The last stage's copy of a weight tied to the first stage's: (its name, the first stage's name).
TIED = {"gpt2": ("lm_head.weight", "transformer.wte.weight"),
        "bert_mlm": ("mlm_head.decoder.weight", "bert.embeddings.word_embeddings.weight")}


def _check_grads(model_name: str, rank: int, grads: dict, ref_grads: dict, factor: int) -> set:
    copy_name, original = TIED.get(model_name, (None, None))
    for param_name, grad in grads.items():
        ref_name = original if param_name == copy_name else param_name
        diff = (grad - factor * ref_grads[ref_name]).abs().max().item()
        assert diff <= GRAD_TOL, (model_name, rank, param_name, diff)
    return {original if n == copy_name else n for n in grads}


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
            for loss, ref_loss in zip((*r["losses"], r["short_loss"]), (ref["loss"], ref["loss"], short["loss"])):
                assert abs(loss - ref_loss) <= LOSS_TOL * abs(ref_loss), (model_name, rank, loss, ref_loss)
            for stage_keys in r["keys"]:
                assert set(stage_keys) <= ref["keys"], set(stage_keys) - ref["keys"]
                seen_keys |= set(stage_keys)
            seen_grads |= _check_grads(model_name, rank, r["grads"], ref["grads"], 2)
            _check_grads(model_name, rank, r["short_grads"], short["grads"], 1)
            if model_name in TIED:  # the last stage's copy of the tied weight
                assert r["duplicates"] == ([TIED[model_name][0]] if r["has_last"] else [])
        assert seen_keys == ref["keys"]  # the stages together hold the whole model, under its names
        assert seen_grads == set(ref["grads"])


def test_stage_placement(pipeline_results):
    results, _ = pipeline_results
    # pp ranks are dim 0 of the mesh (pp, dp, tp): global ranks 0-1 are pp rank 0 at pp2 × dp2
    interleaved = results[0]["pp2x2v_dp2_interleaved"]["gpt2"]
    assert interleaved["stage_indices"] == [0, 2] and interleaved["layers"] == [[0], [2]]
    assert results[3]["pp2x2v_dp2_interleaved"]["gpt2"]["stage_indices"] == [1, 3]
    assert results[2]["pp4_1f1b"]["gpt2"]["layers"] == [[2]]
    assert results[0]["pp2x2v_dp2_zbv"]["gpt2"]["stage_indices"] == [0, 3]


def test_clear_errors(pipeline_results):
    errors = pipeline_results[0][0]["errors"]
    assert "pp × virtual stages = 8 is larger than the number of layers 4" in errors["too_many_stages"]
    assert errors["too_few_micro_batches"] == ("1F1B needs at least pp = 4 micro-batches per step, got 1: "
                                               "raise train.global_batch_size or lower micro_batch_size")
    assert "unknown pipeline schedule 'dualpipe'" in errors["unknown_schedule"]
    assert "'1f1b'" in errors["unknown_schedule"]
    assert "GPT2Model does not implement the model contract" in errors["no_contract"]
    assert "lacks layer_stack" in errors["no_contract"] and "head" in errors["no_contract"]


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


@pytest.mark.parametrize("case", ["t5", "t5_v1_1"])
@pytest.mark.parametrize("edges", [(3,), (2,), (1, 3, 5), (4,)], ids=["decoder_starts_on_stage0", "at_the_boundary",
                                                                      "four_stages", "decoder_on_both_stages"])
def test_encoder_decoder_stages_chain_to_the_models_loss(case, edges):
    """T5 (2 encoder, 4 decoder blocks) cut anywhere: each stage holds the shared table under the
    name its copy has (`shared` first, `decoder.embed_tokens` where the decoder starts, `lm_head`
    when tied), whose canonical name is the whole model's; the stages run one after another, the
    encoder's output carried, give the model's summed loss."""
    from model_cases import zoo_model

    torch.manual_seed(0)
    model = zoo_model(case, num_decoder_layers=4).eval()
    ranges = split_layers(6, len(edges) + 1, list(edges))
    stages = [prune_for_stage(model, r, s == 0, s == len(ranges) - 1) for s, r in enumerate(ranges)]
    whole = dict(model.named_parameters())
    for shared in stage_shared_parameters(model, ranges):
        assert shared.canonical in whole, shared
        for stage, name in shared.names.items():
            assert torch.equal(dict(stages[stage].named_parameters())[name], whole[shared.canonical]), (stage, name)
    ids = torch.randint(3, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    labels = torch.randint(3, 96, (2, 6), generator=torch.Generator().manual_seed(2))
    inputs, targets = model.split_batch({"input_ids": ids, "labels": labels})
    others = {key: value for key, value in inputs.items() if key != "input_ids"}
    sent = (ids,)
    for index, (stage, layer_range) in enumerate(zip(stages, ranges)):
        module = PipelineStageModule(stage, index, len(ranges), layer_range).eval()
        sent = module(*sent, **others, **{TARGETS: targets})
        sent = sent if isinstance(sent, tuple) else (sent,)
    expected = model(input_ids=ids, labels=labels).loss * (labels != -100).sum()
    assert (sent[0] - expected).abs().item() <= 1e-5 * expected.abs().item()


@pytest.mark.parametrize("schedule, virtual, message", [
    ("zbv", 2, "splits backward into input and weight passes"),
    ("zero_bubble", 1, "splits backward into input and weight passes"),
    ("interleaved_1f1b", 3, r"decoder.relative_attention_bias.weight is held by pipeline stages \[2, 4\], all on pp rank 0"),
])
def test_encoder_decoder_layouts_that_cannot_run_are_refused_naming_the_fix(schedule, virtual, message):
    """A zero-bubble schedule with the encoder's output carried between stages, and a rank holding a
    stack's shared weight twice under one name (2 encoder, 4 decoder blocks in 6 interleaved stages)."""
    from libai_zoo.config import ConfigError
    from libai_zoo.parallel import check_stage_holdings
    from model_cases import zoo_model

    with torch.device("meta"):
        model = zoo_model("t5", num_layers=2, num_decoder_layers=4)
    with pytest.raises(ConfigError, match=message):
        check_stage_holdings(model, 2, schedule=schedule, virtual_stages=virtual)
    check_stage_holdings(model, 2, schedule="1f1b", boundaries=[4])  # the decoder on both stages: runs
