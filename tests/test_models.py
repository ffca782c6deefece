"""Every libai_zoo model against its `transformers` twin, in one process: Hugging Face
checkpoints load with equal outputs, losses and gradients; our checkpoints load back in
`transformers`; greedy generation picks the same tokens; bad input fails clearly."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from libai_zoo import distributed, models
from model_cases import (
    CASES,
    HIDDEN,
    SEQ,
    Family,
    deepseek_v3_config,
    gemma3_multimodal_config,
    hf_checkpoint_grads,
    hf_generate,
    hf_named_grads,
    main_output,
    make_hf_model,
    make_inputs,
    swin_config,
    swinv2_config,
    unscored,
)

TOL = 1e-5
#: Reading a sharded index is the loader's, not a family's: one model of each kind covers it.
SHARDED_CASES = ("gpt2", "llama", "bert_mlm", "vit_cls")


def compared(out: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return out[mask] if out.dim() >= 3 and out.shape[:2] == mask.shape else out


def max_diff(a, b, mask) -> float:
    return (compared(a, mask) - compared(b, mask)).abs().max().item()


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """case -> (transformers model, its save_pretrained directory, the same saved in small shards)."""
    dirs = {}
    for name, case in CASES.items():
        hf = make_hf_model(case)
        single = tmp_path_factory.mktemp(name)
        hf.save_pretrained(single)
        sharded = None
        if name in SHARDED_CASES:
            sharded = tmp_path_factory.mktemp(name + "_sharded")
            hf.save_pretrained(sharded, max_shard_size="20KB")
        dirs[name] = hf, single, sharded
    return dirs


@pytest.mark.parametrize("name,sharded", [(name, False) for name in CASES] + [(name, True) for name in SHARDED_CASES],
                         ids=[f"{name}-single_file" for name in CASES] + [f"{name}-sharded_index"
                                                                          for name in SHARDED_CASES])
def test_loads_hf_checkpoint_with_equal_outputs_loss_and_grads(hf_dirs, name, sharded, tmp_path):
    case = CASES[name]
    hf, single, shards = hf_dirs[name]
    path = shards if sharded else single
    if sharded:
        assert (path / "model.safetensors.index.json").is_file()
    zoo, info = case.zoo_class.from_pretrained(path, output_loading_info=True)
    assert info["missing_keys"] == [] and info["unexpected_keys"] == []
    assert sum(p.numel() for p in zoo.parameters()) == sum(p.numel() for p in hf.parameters())
    inputs, mask = make_inputs(case)
    ours, theirs = zoo(**inputs), hf(**inputs)
    assert max_diff(main_output(ours), main_output(theirs), mask) <= TOL
    if getattr(theirs, "pooler_output", None) is not None:
        assert (ours.pooler_output - theirs.pooler_output).abs().max().item() <= TOL
    if "labels" not in inputs:
        return
    assert abs(ours.loss.item() - theirs.loss.item()) <= TOL
    hf.zero_grad()
    ours.loss.backward()
    theirs.loss.backward()
    grads = hf_named_grads(zoo)
    hf_grads = hf_checkpoint_grads(hf, tmp_path)
    assert set(grads) == set(hf_grads)
    assert max((grads[n] - hf_grads[n]).abs().max().item() for n in grads) <= TOL


@pytest.mark.parametrize("name", list(CASES))
def test_save_pretrained_loads_in_transformers(hf_dirs, name, tmp_path):
    case = CASES[name]
    hf, path, _ = hf_dirs[name]
    zoo = case.zoo_class.from_pretrained(path)
    zoo.save_pretrained(tmp_path / "single")
    zoo.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    original = load_file(path / "model.safetensors")
    assert load_file(tmp_path / "single" / "model.safetensors").keys() == original.keys()
    for out in ("single", "sharded"):
        reloaded = case.hf_class.from_pretrained(tmp_path / out).eval()
        for key, tensor in reloaded.state_dict().items():  # bit-identical round trip
            assert torch.equal(tensor, hf.state_dict()[key]), key
        inputs, mask = make_inputs(case)
        inputs = unscored(case, inputs)
        assert max_diff(main_output(reloaded(**inputs)), main_output(zoo(**inputs)), mask) <= TOL
    config = json.loads((tmp_path / "single" / "config.json").read_text())
    assert config["architectures"] == [case.hf_class.__name__]


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c.generates])
def test_greedy_generate_equals_transformers(hf_dirs, name):
    case = CASES[name]
    hf, path, _ = hf_dirs[name]
    zoo = case.zoo_class.from_pretrained(path)
    ids = make_inputs(case)[0]["input_ids"]
    mask = torch.ones_like(ids)
    mask[-1, :3] = 0  # left padding, as generation wants it
    theirs = hf_generate(hf, ids, attention_mask=mask, max_new_tokens=20)
    ours = zoo.generate(ids, attention_mask=mask, max_new_tokens=20, eos_token_id=None)
    # an encoder-decoder returns the decoder's ids: its start token, then the new ones
    assert ours.shape == (2, (1 if case.kind == "seq2seq" else ids.shape[1]) + 20)
    assert torch.equal(ours, theirs)


def test_seq2seq_sampling_equals_transformers_under_the_same_seed(hf_dirs):
    """T5 samples as transformers does (temperature, top-k, top-p, then one draw per step from the
    global generator; stopping at the config's eos and padding after it): the same seed, the same ids."""
    case = CASES["t5_v1_1"]
    hf, path, _ = hf_dirs["t5_v1_1"]
    zoo = case.zoo_class.from_pretrained(path)
    ids = make_inputs(case)[0]["input_ids"]
    mask = torch.ones_like(ids)
    mask[-1, :3] = 0
    for seed in range(3):
        kw = dict(do_sample=True, temperature=1.5, top_k=40, top_p=0.9, max_new_tokens=12)
        torch.manual_seed(seed)
        theirs = hf.generate(ids, attention_mask=mask, **kw)
        torch.manual_seed(seed)
        assert torch.equal(zoo.generate(ids, attention_mask=mask, **kw), theirs)


def test_generate_stops_at_eos_and_pads():
    zoo = models.GPT2LMHeadModel(CASES["gpt2"].make_config()).eval()
    ids = torch.tensor([[5, 6, 7], [8, 9, 10]])
    first = zoo.generate(ids, max_new_tokens=1)[:, -1]
    out = zoo.generate(ids, max_new_tokens=5, eos_token_id=int(first[0]), pad_token_id=0)
    assert out[0, 3] == first[0] and (out[0, 4:] == 0).all()


def test_generate_follows_transformers_cache_name_without_a_deprecation_warning(monkeypatch):
    """transformers 5.24 renamed past_key_values to cache (and warns on the old name): a forward takes
    both, returns the installed name, and generate warns of nothing."""
    from transformers.utils import generic

    from libai_zoo.layers import KVCache
    from libai_zoo.models.causal_lm import CACHE_NAME

    warned = []
    monkeypatch.setattr(generic.logger, "warning_once", lambda *args, **kwargs: warned.append(args))
    zoo = models.LlamaForCausalLM(CASES["llama"].make_config()).eval()
    zoo.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=3, eos_token_id=None)
    assert warned == []
    layers = zoo.config.num_hidden_layers
    ids = torch.tensor([[5, 6, 7]])
    new = zoo(ids, cache=[KVCache(4) for _ in range(layers)])
    old = zoo(ids, past_key_values=[KVCache(4) for _ in range(layers)])
    assert torch.equal(new.logits, old.logits) and warned == []
    assert CACHE_NAME in new and len(new[CACHE_NAME]) == layers and new[CACHE_NAME][0].length == 3
    theirs = make_hf_model(CASES["llama"]).eval()(ids, use_cache=True)  # the installed transformers' own output
    assert list(new.keys()) == list(theirs.keys()) == ["logits", CACHE_NAME], (list(new.keys()), list(theirs.keys()))
    with pytest.raises(ValueError, match="not both"):
        zoo(ids, cache=[], past_key_values=[])


def test_sampling_filters_keep_top_k_and_nucleus():
    from libai_zoo.models.generation import _filter

    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    assert torch.isfinite(_filter(logits, 1.0, 2, None)).tolist() == [[True, True, False, False, False]]
    probs = logits.softmax(-1)[0]  # 0.64, 0.24, 0.09, ...: the first two reach 0.85
    kept = torch.isfinite(_filter(logits, 1.0, None, float(probs[:2].sum()) - 1e-3))
    assert kept.tolist() == [[True, True, False, False, False]]
    torch.manual_seed(0)
    zoo = models.LlamaForCausalLM(CASES["llama"].make_config()).eval()
    sampled = zoo.generate(torch.tensor([[5, 6]]), max_new_tokens=8, do_sample=True, top_k=1, eos_token_id=None)
    assert torch.equal(sampled, zoo.generate(torch.tensor([[5, 6]]), max_new_tokens=8, eos_token_id=None))


def test_base_model_loads_the_body_of_a_task_checkpoint(hf_dirs):
    hf, path, _ = hf_dirs["gpt2"]
    body = models.GPT2Model.from_pretrained(path)
    inputs, mask = make_inputs(CASES["gpt2_body"])
    inputs.pop("labels", None)
    assert max_diff(body(**inputs).last_hidden_state, hf.transformer(**inputs).last_hidden_state, mask) <= TOL


@pytest.mark.parametrize("name", ["t5", "t5_v1_1"])
def test_t5_encoder_and_body_load_a_conditional_generation_checkpoint(hf_dirs, name):
    """T5EncoderModel reads the encoder of a T5ForConditionalGeneration directory (its decoder and head
    named nowhere), T5Model its encoder and decoder (the head left out), with transformers' outputs."""
    hf, path, _ = hf_dirs[name]
    inputs, mask = make_inputs(CASES[name])
    encoder, info = models.T5EncoderModel.from_pretrained(path, output_loading_info=True)
    assert info["missing_keys"] == [] and info["unexpected_keys"] == []
    theirs = hf.encoder(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).last_hidden_state
    assert max_diff(encoder(inputs["input_ids"], inputs["attention_mask"]).last_hidden_state, theirs, mask) <= TOL
    body = models.T5Model.from_pretrained(path)
    unlabelled = unscored(CASES[name], inputs)
    theirs = transformers.T5Model.from_pretrained(path).eval()(**unlabelled).last_hidden_state
    assert max_diff(body(**unlabelled).last_hidden_state, theirs, mask) <= TOL


@pytest.mark.parametrize("tied", [True, False])
def test_gemma3_text_model_loads_from_a_multimodal_checkpoint(tied, tmp_path, caplog):
    """Gemma 3 4B-27B are Gemma3ForConditionalGeneration directories (model_type gemma3): the text
    model loads from its text_config and language_model.* tensors (the head tied as the container
    says), and the vision tower and projector are named as skipped."""
    def config():
        multimodal = gemma3_multimodal_config()
        multimodal.tie_word_embeddings = tied
        return multimodal

    hf = make_hf_model(Family(transformers.Gemma3ForConditionalGeneration, None, config, "causal"))
    hf.save_pretrained(tmp_path)
    zoo, info = models.AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert isinstance(zoo, models.Gemma3ForCausalLM) and zoo.config.tie_word_embeddings == tied
    assert type(models.AutoConfig.from_pretrained(tmp_path)) is models.Gemma3TextConfig
    assert info["missing_keys"] == [] and info["unexpected_keys"] == []
    assert {name.split(".")[0] for name in info["skipped_keys"]} == {"vision_tower", "multi_modal_projector"}
    assert "skipped its other parts (vision_tower., multi_modal_projector." in caplog.text
    inputs, mask = make_inputs(CASES["gemma3"])
    ours, theirs = zoo(**inputs), hf(**inputs)
    assert max_diff(ours.logits, theirs.logits, mask) <= TOL and abs(ours.loss.item() - theirs.loss.item()) <= TOL
    body = models.Gemma3TextModel.from_pretrained(tmp_path)
    inputs.pop("labels")
    assert max_diff(body(**inputs).last_hidden_state, hf.model.language_model(**inputs).last_hidden_state,
                    mask) <= TOL


def test_kimi_k2_directory_loads_as_deepseek_v3(tmp_path):
    """Kimi K2 is DeepSeek-V3's architecture under model_type kimi_k2 (its hub config.json names its
    own code, 4.x keys: rope_scaling, rope_theta): AutoModelForCausalLM reads one as
    DeepseekV3ForCausalLM, with experts in one group and one shared expert (Kimi's shape), and skips
    the multi-token-prediction layer stored after the last one, as DeepSeek-V3's files hold it."""
    case = CASES["deepseek_v3"]
    kimi = Family(case.hf_class, case.zoo_class, lambda: deepseek_v3_config(n_group=1, topk_group=1, n_shared_experts=1),
                "causal")
    hf = make_hf_model(kimi)
    hf.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config.update(model_type="kimi_k2", auto_map={"AutoConfig": "configuration_deepseek.DeepseekV3Config"},
                  rope_theta=rope.pop("rope_theta"), rope_scaling={**rope, "type": rope.pop("rope_type")},
                  num_nextn_predict_layers=1)
    (tmp_path / "config.json").write_text(json.dumps(config))
    weights = load_file(tmp_path / "model.safetensors")
    weights["model.layers.2.eh_proj.weight"] = torch.zeros(HIDDEN, 2 * HIDDEN)  # the MTP layer
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    zoo, info = models.AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert type(zoo) is models.DeepseekV3ForCausalLM and zoo.config.model_type == "kimi_k2"
    assert info["missing_keys"] == [] and info["unexpected_keys"] == []
    inputs, mask = make_inputs(kimi)
    ours, theirs = zoo(**inputs), hf(**inputs)
    assert max_diff(ours.logits, theirs.logits, mask) <= TOL and abs(ours.loss.item() - theirs.loss.item()) <= TOL


def test_gemma_bf16_rounds_as_transformers(tmp_path):
    """Under bf16 Gemma scales the embeddings by sqrt(hidden) rounded to bf16, and normalises in
    float32 with its (1 + w) before the cast: both equal transformers' bit for bit (each differs
    in some elements done otherwise); the logits agree within bf16's resolution."""
    hf = make_hf_model(CASES["gemma"]).to(torch.bfloat16)
    hf.save_pretrained(tmp_path)
    zoo = models.GemmaForCausalLM.from_pretrained(tmp_path)
    assert zoo.lm_head.weight.dtype == torch.bfloat16
    inputs, mask = make_inputs(CASES["gemma"])
    with torch.no_grad():
        assert torch.equal(zoo.model.embed(inputs["input_ids"]), hf.model.embed_tokens(inputs["input_ids"]))
        x = torch.randn(2, SEQ, HIDDEN, generator=torch.Generator().manual_seed(0)).bfloat16() * 3
        assert torch.equal(zoo.model.norm(x), hf.model.norm(x))
        assert max_diff(zoo(**inputs).logits.float(), hf(**inputs).logits.float(), mask) <= 1e-2


def test_olmo2_bf16_norms_round_as_transformers(tmp_path):
    """OLMo 2's RMSNorms (the branch outputs', the final one, q/k over the whole projection) apply
    their weight in float32 before the cast back, Llama's after it: in bf16 the two differ in a
    quarter of the elements; ours equal transformers' bit for bit."""
    hf = make_hf_model(CASES["olmo2"]).to(torch.bfloat16)
    hf.save_pretrained(tmp_path)
    zoo = models.Olmo2ForCausalLM.from_pretrained(tmp_path)
    x = torch.randn(2, SEQ, HIDDEN, generator=torch.Generator().manual_seed(0)).bfloat16() * 3
    with torch.no_grad():
        assert torch.equal(zoo.model.norm(x), hf.model.norm(x))
        assert torch.equal(zoo.model.layers[0].mlp_out_norm(x), hf.model.layers[0].post_feedforward_layernorm(x))
        q = torch.randn(2, SEQ, zoo.model.layers[0].attn.q_norm.normalized_shape[0]).bfloat16()
        assert torch.equal(zoo.model.layers[0].attn.q_norm(q), hf.model.layers[0].self_attn.q_norm(q))


def test_new_head_needs_strict_false(hf_dirs):
    _, path, _ = hf_dirs["bert_mlm"]
    with pytest.raises(ValueError, match=r"(?s)missing tensor\(s\): bert\.pooler\.dense\.weight.*strict=False"):
        models.BertForSequenceClassification.from_pretrained(path)
    model, info = models.BertForSequenceClassification.from_pretrained(path, strict=False, output_loading_info=True)
    assert sorted(info["missing_keys"]) == ["bert.pooler.dense.bias", "bert.pooler.dense.weight",
                                            "classifier.bias", "classifier.weight"]
    assert model.classifier.weight.std().item() == pytest.approx(0.02, rel=0.5)
    three = models.BertForSequenceClassification.from_pretrained(path, strict=False, num_labels=3)
    assert three.classifier.weight.shape == (3, 32) and three.config.num_labels == 3
    with pytest.raises(ValueError, match="has no attribute 'num_lables'"):
        models.BertForSequenceClassification.from_pretrained(path, strict=False, num_lables=3)


def test_pytorch_model_bin_loads(hf_dirs, tmp_path):
    hf, _, _ = hf_dirs["llama"]
    torch.save(hf.state_dict(), tmp_path / "pytorch_model.bin")
    hf.config.save_pretrained(tmp_path)
    zoo = models.LlamaForCausalLM.from_pretrained(tmp_path)
    inputs, mask = make_inputs(CASES["llama"])
    assert max_diff(zoo(**inputs).logits, hf(**inputs).logits, mask) <= TOL


def test_dtype_auto_and_explicit(hf_dirs, tmp_path):
    hf, _, _ = hf_dirs["gpt2"]
    copy.deepcopy(hf).to(torch.bfloat16).save_pretrained(tmp_path)  # the shared model keeps its float32 weights
    assert models.GPT2LMHeadModel.from_pretrained(tmp_path).lm_head.weight.dtype == torch.bfloat16
    assert models.GPT2LMHeadModel.from_pretrained(tmp_path, dtype=torch.float32).lm_head.weight.dtype == torch.float32


def test_config_round_trips_unknown_keys(hf_dirs, tmp_path):
    _, path, _ = hf_dirs["llama"]
    raw = json.loads((path / "config.json").read_text())
    raw["my_custom_key"] = {"kept": True}
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "config.json").write_text(json.dumps(raw))
    for file in path.glob("*.safetensors"):
        (tmp_path / "in" / file.name).write_bytes(file.read_bytes())
    models.LlamaForCausalLM.from_pretrained(tmp_path / "in").save_pretrained(tmp_path / "out")
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert saved["my_custom_key"] == {"kept": True}
    assert models.LlamaConfig.from_pretrained(tmp_path / "out").num_key_value_heads == 2


# ------------------------------------------------------------------------------------- bad input
def test_directory_without_config_json(tmp_path):
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        models.GPT2LMHeadModel.from_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        models.GPT2LMHeadModel.from_pretrained(tmp_path / "nowhere")


def test_model_type_mismatch(hf_dirs):
    _, path, _ = hf_dirs["bert"]
    with pytest.raises(ValueError, match="holds a 'bert' model .* GPT2LMHeadModel loads 'gpt2'"):
        models.GPT2LMHeadModel.from_pretrained(path)


def test_missing_and_misshaped_tensors_are_named(hf_dirs, tmp_path):
    _, path, _ = hf_dirs["gpt2"]
    tensors = load_file(path / "model.safetensors")
    del tensors["transformer.h.1.mlp.c_fc.bias"]
    tensors["transformer.ln_f.weight"] = torch.ones(31)
    tensors["transformer.extra.weight"] = torch.ones(2)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    with pytest.raises(ValueError) as error:
        models.GPT2LMHeadModel.from_pretrained(tmp_path)
    message = str(error.value)
    assert "1 missing tensor(s): transformer.h.1.mlp.c_fc.bias" in message
    assert "1 unexpected tensor(s): transformer.extra.weight" in message
    assert "transformer.ln_f.weight: checkpoint (31,), model (32,)" in message


def test_truncated_weight_file_is_named(hf_dirs, tmp_path):
    _, path, _ = hf_dirs["gpt2"]
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    data = (path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"model\.safetensors is truncated or corrupt .*: copy or download it again"):
        models.GPT2LMHeadModel.from_pretrained(tmp_path)


def test_missing_weight_file_of_an_index(hf_dirs, tmp_path):
    _, _, path = hf_dirs["gpt2"]
    for file in path.iterdir():
        if not file.name.startswith("model-00002"):
            (tmp_path / file.name).write_bytes(file.read_bytes())
    with pytest.raises(FileNotFoundError, match="model-00002-of-.*safetensors"):
        models.GPT2LMHeadModel.from_pretrained(tmp_path)


def test_unsupported_config_options_fail_clearly():
    with pytest.raises(ValueError, match="reorder_and_upcast_attn"):
        models.GPT2Model(transformers.GPT2Config(reorder_and_upcast_attn=True))
    with pytest.raises(ValueError, match="rope_type 'dynamic'"):
        models.LlamaModel(CASES["llama"].make_config().__class__(
            rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}))
    with pytest.raises(ValueError, match="quantization_config.*fp8.*dequantize"):
        models.DeepseekV3Model(deepseek_v3_config(quantization_config={"quant_method": "fp8"}))
    with pytest.raises(ValueError, match="position_embedding_type"):
        models.BertModel(transformers.BertConfig(position_embedding_type="relative_key"))
    with pytest.raises(ValueError, match=r"quantization_config \(mxfp4\).*Mxfp4Config\(dequantize=True\)"):
        models.GptOssModel(CASES["gpt_oss"].make_config().__class__(quantization_config={"quant_method": "mxfp4"}))


def test_swin_refuses_what_it_cannot_run():
    """Swin's blocks know their resolution from the config: images of another size or channel count
    are refused, naming both. A Swin stage smaller than its window is refused (transformers' bias
    table is for the config's window: it cannot run one either; Swin V2 fits the window to it), as
    are a tp that does not divide every stage's heads and the splits Swin has no use for."""
    model = models.SwinForImageClassification(swin_config())
    for wrong in ((2, 3, 24, 24), (2, 1, 20, 20)):  # another size, another channel count
        with pytest.raises(ValueError, match=rf"pixel_values of shape \({', '.join(map(str, wrong))}\) do not match "
                                             rf"the config: expected \[B, 3, 20, 20\]"):
            model(torch.randn(wrong))
    with pytest.raises(ValueError, match="stage 2 runs at 3×3 patches, fewer than window_size = 4: .*transformers "
                                         "cannot run it either.*a window_size of at most 3"):
        models.SwinModel(swin_config(window_size=4))
    assert models.Swinv2Model(swinv2_config(window_size=4)).layers[-1].attn.window_size == 2  # 10 // 4 patches
    assert distributed.tp_problems(model, 4) == [
        "num_heads = 2 is not divisible by tp = 4: choose a tp that divides the number of heads",
        "num_heads of a window's position bias = 2 is not divisible by tp = 4: choose a tp that divides every "
        "stage's number of heads"]
    assert distributed.tp_problems(model, 2) == []
    refused = model.layout_problems(sequence_parallel=True, cp=2, ep=2)
    assert [problem.split(": ")[-1] for problem in refused] == ["set dist.sequence_parallel=false", "set dist.cp=1",
                                                                 "set dist.ep=1"]
    assert model.layout_problems(sequence_parallel=False, cp=1, ep=1) == []


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_shift_labels_scores_every_position(hf_dirs, name):
    """shift_labels (transformers' name): a window of S + 1 tokens gives S inputs and S aligned targets."""
    import torch.nn.functional as F

    hf, path, _ = hf_dirs[name]
    zoo = CASES[name].zoo_class.from_pretrained(path)
    window = torch.randint(3, 128, (2, 13))
    ours = zoo(window[:, :-1], shift_labels=window[:, 1:])
    expected = F.cross_entropy(hf(window[:, :-1]).logits.flatten(0, 1), window[:, 1:].flatten())
    assert abs(ours.loss.item() - expected.item()) <= TOL
    _, targets = zoo.split_batch({"input_ids": window[:, :-1], "shift_labels": window[:, 1:]})
    assert int(zoo.num_loss_targets(targets)) == 24
