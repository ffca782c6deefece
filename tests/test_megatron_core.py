"""Megatron-Core checkpoints <-> Hugging Face and libai_zoo, checked against megatron-core itself.

megatron-core (a test dependency, CPU-only here) builds GPT, Llama, Qwen3 (--qk-layernorm, a
window on every other layer) and Mistral (--window-size) GPTModels at tp 2 × pp 2 and saves them
as Megatron-LM does, in both formats (`mcore_reference.py build`), and two Mixtures of Experts in
the same run, their experts split over ep 2: Mixtral (--num-experts 4, top-2 renormalised, a
window), Qwen3-MoE (q/k norms, 8 experts of their own width, top-2 not renormalised:
--moe-router-pre-softmax, layer 0 dense) and Qwen2-MoE (q/k/v biases, a shared expert and its
sigmoid gate), as torch_dist. Its own forward on the torch_dist
checkpoint, loaded at tp 1, gives the reference logits. Our conversions must give those logits
through transformers and through libai_zoo, and our exports must load into a megatron-core
GPTModel (`dist_checkpointing.load`) with the same logits. Both megatron-core steps run as
scripts so its global state never enters this process. Logits only: Megatron-Core's
load-balancing loss is per layer and 1/k of transformers', so the losses differ by definition.
"""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import safetensors.torch
import torch
import transformers

from libai_zoo import models
from libai_zoo.convert import load_checkpoint_model
from libai_zoo.convert.megatron_core import write_megatron_core
from libai_zoo.convert.torch_dist import COMMON
from libai_zoo.layers import LayerSpec, MoESpec
from libai_zoo.models.decoder import DecoderForCausalLM, DecoderModel, DecoderSpec
from libai_zoo.models.hf_maps.llama import llama_weight_map
from libai_zoo.models.llama import llama_layer, llama_spec
from test_convert import convert, has_row, ok

REFERENCE = Path(__file__).with_name("mcore_reference.py")
VOCAB = 100  # mcore_reference.py's vocabulary (padded to 128 in its checkpoints)
IDS = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(9))
MOE_FAMILIES = ("mixtral", "qwen3_moe", "qwen2_moe")  # torch_dist only
FAMILIES = ("gpt", "gpt_rope", "llama", "qwen3", "mistral", *MOE_FAMILIES)
HF_KINDS = ("gpt2", "gpt2_untied", "gpt_neox", "qwen2", "llama", "qwen3", "mistral", "mixtral", "qwen3_moe",
            "qwen2_moe")  # tiny_hf's


def megatron_core(*argv) -> None:
    result = subprocess.run([sys.executable, "-W", "ignore", str(REFERENCE), *map(str, argv)], capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]


def mcore_logits(root: Path, checkpoints: list[Path]) -> dict[str, torch.Tensor]:
    """megatron-core's logits of IDS for each torch_dist checkpoint, loaded at tp 1 (first VOCAB columns)."""
    torch.save(IDS, root / "ids.pt")
    megatron_core("forward", *checkpoints, "--ids", root / "ids.pt", "--out", root / "logits.pt")
    return {Path(name).name: logits[..., :VOCAB] for name, logits in torch.load(root / "logits.pt").items()}


@pytest.fixture(scope="module")
def megatron(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    """(root of gpt/ and llama/, each with torch_dist/ and torch/ checkpoints; megatron-core's logits per family)."""
    root = tmp_path_factory.mktemp("megatron_core")
    megatron_core("build", root, "--tp", 2, "--pp", 2, "--ep", 2)
    for family in FAMILIES:
        (root / f"{family}_ref").symlink_to(root / family / "torch_dist")
    logits = mcore_logits(root, [root / f"{family}_ref" for family in FAMILIES])
    return root, {family: logits[f"{family}_ref"] for family in FAMILIES}


def _max_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def _hf_logits(directory: Path) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    with torch.no_grad():
        return model(IDS).logits


@pytest.mark.slow
@pytest.mark.system
@pytest.mark.parametrize("family, form", [(family, form) for family in FAMILIES for form in ("torch_dist", "torch")
                                          if form == "torch_dist" or family not in MOE_FAMILIES])
def test_megatron_core_to_hf_gives_megatron_cores_logits(megatron, tmp_path, family, form):
    root, reference = megatron
    out = ok("megatron-to-hf", root / family / form, tmp_path / "hf")
    assert "tp=2, pp=2" in out
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["vocab_size"] == VOCAB  # args.vocab_size: the padding is dropped
    if family == "gpt_rope":  # RoPE on half of each head, fused tanh GELU, untied: GPT-NeoX, sequential
        assert config["model_type"] == "gpt_neox" and not config["use_parallel_residual"]
        assert config["rope_parameters"]["partial_rotary_factor"] == 0.5 and config["hidden_act"] == "gelu_new"
    if family == "llama":
        assert config["num_key_value_heads"] == 2 and not config["tie_word_embeddings"]
        assert config["rope_parameters"]["rope_type"] == "llama3" and config["rope_parameters"]["rope_theta"] == 5e5
    if family == "qwen3":  # --qk-layernorm, --kv-channels 16, --window-size 3,0 skipped every 2nd layer
        assert config["model_type"] == "qwen3" and config["head_dim"] == 16 and config["sliding_window"] == 4
        assert config["layer_types"] == ["sliding_attention", "full_attention"] * 2
    if family == "mistral":
        assert config["model_type"] == "mistral" and config["head_dim"] == 16 and config["sliding_window"] == 5
    if family == "mixtral":  # every expert of both expert-parallel ranks, stacked over the layers in the file
        assert config["model_type"] == "mixtral" and config["sliding_window"] == 5
        assert (config["num_local_experts"], config["num_experts_per_tok"], config["intermediate_size"]) == (4, 2, 48)
    if family == "qwen3_moe":  # --moe-layer-freq [0, 1, 1, 1]: per-layer names, layer 0 a dense MLP
        assert config["model_type"] == "qwen3_moe" and config["head_dim"] == 16 and not config["norm_topk_prob"]
        assert (config["num_local_experts"], config["moe_intermediate_size"], config["intermediate_size"]) == \
            (8, 24, 48)  # Qwen3MoeConfig writes num_experts as num_local_experts
        assert config["mlp_only_layers"] == [0] and config["decoder_sparse_step"] == 1
    if family == "qwen2_moe":  # --add-qkv-bias, --moe-shared-expert-intermediate-size 40 with its gate
        assert config["model_type"] == "qwen2_moe" and config["qkv_bias"] and not config["norm_topk_prob"]
        assert (config["shared_expert_intermediate_size"], config["moe_intermediate_size"]) == (40, 24)
    assert _max_difference(_hf_logits(tmp_path / "hf"), reference[family]) <= 1e-5


@pytest.mark.slow
@pytest.mark.system
def test_megatron_core_to_zoo_and_our_exports_load_into_megatron_core(megatron, tmp_path):
    """megatron-to-zoo gives megatron-core's logits in libai_zoo; hf-to-megatron and
    zoo-to-megatron write checkpoints megatron-core loads with the same logits, and transformers'
    models reach megatron-core intact: GPT-2 with tanh GELU and with an untied head, Qwen2's q/k/v
    biases and window on its second layer, Llama with linear RoPE scaling, one KV head, head_dim != hidden / heads and biases,
    Qwen3's q/k norms with a window on one layer of two and Mistral's window (Megatron-Core's
    window (W - 1, 0) is Hugging Face's W: one position more or no window moves these logits by
    0.4 to 0.8); Mixtral with head_dim != hidden / heads and a window, Qwen3-MoE with
    renormalised top-k weights and a dense layer 1 (Megatron-Core's per-layer names) and
    Qwen2-MoE's gated shared expert with layer 0 dense (decoder_sparse_step 2), all read back by
    Transformer Engine's names (the pre-MLP norm of an MoE layer: `pre_mlp_layernorm`)."""
    root, reference = megatron
    exports, expected = [], {}
    for family in FAMILIES:
        ok("megatron-to-zoo", root / family / "torch_dist", tmp_path / f"zoo_{family}", "--tp", 2)
        zoo = load_checkpoint_model(tmp_path / f"zoo_{family}" / "model_0000000")
        with torch.no_grad():
            assert _max_difference(zoo(input_ids=IDS).logits, reference[family]) <= 1e-5
        ok("zoo-to-megatron", tmp_path / f"zoo_{family}", tmp_path / f"zoo_to_mc_{family}")
        form = "torch_dist" if family in MOE_FAMILIES else "torch"
        ok("megatron-to-hf", root / family / form, tmp_path / f"hf_{family}")
        ok("hf-to-megatron", tmp_path / f"hf_{family}", tmp_path / f"hf_to_mc_{family}")
        exports += [tmp_path / f"zoo_to_mc_{family}", tmp_path / f"hf_to_mc_{family}"]
        expected.update({f"zoo_to_mc_{family}": reference[family], f"hf_to_mc_{family}": reference[family]})
    for name in HF_KINDS:
        model = tiny_hf(name)
        model.save_pretrained(tmp_path / name)
        ok("hf-to-megatron", tmp_path / name, tmp_path / f"{name}_mc")
        exports.append(tmp_path / f"{name}_mc")
        with torch.no_grad():
            expected[f"{name}_mc"] = model(IDS).logits
    logits = mcore_logits(tmp_path, exports)
    assert set(logits) == set(expected)
    for name, want in expected.items():
        assert _max_difference(logits[name], want) <= 1e-5, name


def tiny_hf(kind: str, seed: int = 0) -> transformers.PreTrainedModel:
    """A small random transformers model of each exported form, biases and norms off their init."""
    torch.manual_seed(seed)
    if kind == "gpt2":  # tanh GELU (gelu_new), tied head
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, bos_token_id=1, eos_token_id=2))
    elif kind == "gpt2_untied":
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4, activation_function="gelu",
            tie_word_embeddings=False))
    elif kind == "gpt_neox":  # RoPE on a quarter of each head, linear scaling, erf GELU, tied head
        model = transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
            max_position_embeddings=64, use_parallel_residual=False, tie_word_embeddings=True,
            rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0,
                             "partial_rotary_factor": 0.25}, bos_token_id=1, eos_token_id=2))
    elif kind == "qwen2":  # biases on q/k/v only, grouped-query, tied head, a window from layer 1 on
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True, rope_theta=20000.0,
            use_sliding_window=True, sliding_window=3, max_window_layers=1))
    elif kind == "qwen3":  # per-head q/k norms, head_dim apart from hidden / heads, a window on layer 0 only
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=64, tie_word_embeddings=False,
            use_sliding_window=True, sliding_window=4, layer_types=["sliding_attention", "full_attention"],
            rope_theta=20000.0, bos_token_id=1, eos_token_id=2))
    elif kind == "mistral":  # a window on every layer, one KV head, head_dim apart from hidden / heads, tied head
        model = transformers.MistralForCausalLM(transformers.MistralConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=1, head_dim=16, max_position_embeddings=64, sliding_window=5,
            tie_word_embeddings=True, bos_token_id=1, eos_token_id=2))
    elif kind == "mixtral":  # 4 experts, top 2, a window, head_dim apart from hidden / heads
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=64, sliding_window=6, num_local_experts=4,
            num_experts_per_tok=2, rope_theta=20000.0, bos_token_id=1, eos_token_id=2))
    elif kind == "qwen3_moe":  # 8 experts narrower than the dense layer 1, top-2 renormalised, q/k norms, tied head
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=24, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64, num_experts=8,
            num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1], tie_word_embeddings=True,
            rope_theta=20000.0, bos_token_id=1, eos_token_id=2))
    elif kind == "qwen2_moe":  # a gated shared expert, q/k/v biases, top-2 renormalised, layer 0 dense
        model = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=24,
            shared_expert_intermediate_size=40, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=64, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
            decoder_sparse_step=2, rope_theta=20000.0, bos_token_id=1, eos_token_id=2))
    else:  # Llama with linear RoPE scaling, head_dim apart from hidden / heads, biases everywhere
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=1, head_dim=16, max_position_embeddings=64, attention_bias=True, mlp_bias=True,
            rope_scaling={"rope_type": "linear", "factor": 2.0}, bos_token_id=1, eos_token_id=2))
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    return model.eval()


@pytest.mark.parametrize("kind", HF_KINDS)
def test_hf_to_megatron_core_to_hf_is_bit_identical(tmp_path, kind):
    tiny_hf(kind).save_pretrained(tmp_path / "hf")
    out = ok("hf-to-megatron", tmp_path / "hf", tmp_path / "mc", "--make-vocab-size-divisible-by", 64)
    assert "release" in out
    assert (tmp_path / "mc" / "latest_checkpointed_iteration.txt").read_text() == "release"
    ok("megatron-to-hf", tmp_path / "mc", tmp_path / "back")
    before = safetensors.torch.load_file(tmp_path / "hf" / "model.safetensors")
    after = safetensors.torch.load_file(tmp_path / "back" / "model.safetensors")
    assert before.keys() == after.keys()
    assert all(torch.equal(before[name], after[name]) and before[name].dtype == after[name].dtype for name in before)
    configs = [json.loads((tmp_path / d / "config.json").read_text()) for d in ("hf", "back")]
    assert configs[0] == configs[1]
    # as Megatron-LM saves it after training: no config.json kept, the model rebuilt from the args alone
    common = torch.load(tmp_path / "mc" / "release" / COMMON, weights_only=False)
    del common["hf_config"]
    torch.save(common, tmp_path / "mc" / "release" / COMMON)
    ok("megatron-to-hf", tmp_path / "mc", tmp_path / "from_args")
    source = tiny_hf(kind)
    with torch.no_grad():
        assert _max_difference(_hf_logits(tmp_path / "from_args"), source(IDS).logits) <= 1e-6


class UnusualModel(DecoderModel):
    """A family this converter has never seen, with options Megatron-Core cannot express: (1 + w)
    sandwich norms, a NoPE layer, soft-capped attention, q/k norms over the whole projection,
    scaled residuals, embeddings and logits."""

    config_class = models.LlamaConfig
    base_model_prefix = "model"
    weight_map = llama_weight_map

    @staticmethod
    def describe(config) -> DecoderSpec:
        def layer(config, index: int) -> LayerSpec:
            layer = replace(llama_layer(config, index), norm="rmsnorm_1p", norm_position="sandwich",
                            residual_multiplier=0.5)
            return layer.with_attention(rope_theta=10000.0 if index else None, softcap=50.0, qk_norm="projection")

        return llama_spec(config, layer=layer, embedding_multiplier=4.0, logit_softcap=30.0)


class UnusualForCausalLM(DecoderForCausalLM):
    body_class = UnusualModel


def test_what_megatron_core_cannot_express_is_refused_by_name(tmp_path):
    """The refusal reads the built model's layer description, so a family is refused for what it
    has, whatever its name: Pythia's parallel residual through hf-to-megatron (before its weights
    are read), and every option of a family unknown to the converter in one error."""
    torch.manual_seed(0)
    transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        use_parallel_residual=True)).save_pretrained(tmp_path / "pythia")
    (tmp_path / "pythia" / "model.safetensors").write_bytes(b"not read")
    status, _, err = convert("hf-to-megatron", tmp_path / "pythia", tmp_path / "mc")
    assert status == 1 and not (tmp_path / "mc").exists()
    assert "parallel_block (attention and MLP side by side: GPT-J, Pythia): Megatron-Core's GPT layer is " \
           "sequential" in err
    config = models.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                num_attention_heads=4)
    with pytest.raises(ValueError) as refused:
        write_megatron_core(UnusualForCausalLM(config), tmp_path / "unusual")
    for words in ("embedding_multiplier = 4.0: the embeddings scaled",
                  "logit_softcap = 30.0: final-logit soft-capping (Gemma 2)",
                  "layer 1 has attention rope_theta = 10000.0, layer 0 None: Megatron-Core builds every layer alike",
                  "norm 'rmsnorm_1p': Megatron-Core's layers have LayerNorm or RMSNorm",
                  "norm_position 'sandwich'", "residual_multiplier 0.5 (Granite)",
                  "no positions (rope_theta=None: NoPE layers)", "q/k norm 'projection' (over the whole projection",
                  "attention softcap = 50.0: attention logit soft-capping"):
        assert words in str(refused.value)
    assert not (tmp_path / "unusual").exists()


class UnusualMoE(models.MixtralModel):
    """Mixtral with gpt-oss's router (top-k, then softmax, with a bias), expert biases and token
    dropping, an expert count that changes from layer to layer, and dense layers of two widths."""

    @staticmethod
    def describe(config) -> DecoderSpec:
        def layer(config, index: int) -> LayerSpec:
            if index < 2:
                return llama_layer(config, index).with_mlp(ffn_hidden_size=48 + 16 * index)
            moe = MoESpec(num_experts=4 + 2 * (index == 3), top_k=2, ffn_hidden_size=24, router="topk_softmax",
                          router_bias=True, bias=True, capacity_factor=1.25)
            return replace(llama_layer(config, index), mlp=moe)

        return llama_spec(config, layer=layer, num_experts=4)


class UnusualMoEForCausalLM(models.MixtralForCausalLM):
    body_class = UnusualMoE


def test_what_megatron_core_cannot_express_of_an_moe_is_refused_by_name(tmp_path):
    config = models.MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                                  num_attention_heads=4, num_key_value_heads=2, num_local_experts=4)
    with pytest.raises(ValueError) as refused:
        write_megatron_core(UnusualMoEForCausalLM(config), tmp_path / "unusual")
    for words in ("layer 3's MoE has num_experts = 6, layer 2's 4", "dense layers of [48, 64] neurons",
                  "MoE router = 'topk_softmax': a router other than softmax then top-k",
                  "MoE router_bias = True: a router bias (gpt-oss)", "MoE bias = True: expert biases (gpt-oss)",
                  "MoE capacity_factor = 1.25: token dropping at a capacity"):
        assert words in str(refused.value)
    assert not (tmp_path / "unusual").exists()


def _rewrite_common(directory: Path, **changes) -> None:
    path = directory / "release" / COMMON
    common = torch.load(path, weights_only=False)
    common.update(changes)
    torch.save(common, path)


def test_args_that_disagree_with_the_tensors_are_named_together(tmp_path):
    tiny_hf("llama").save_pretrained(tmp_path / "hf")
    ok("hf-to-megatron", tmp_path / "hf", tmp_path / "mc")
    args = torch.load(tmp_path / "mc" / "release" / COMMON, weights_only=False)["args"]
    args.hidden_size, args.multi_latent_attention, args.normalization = 48, True, "LayerNorm"
    _rewrite_common(tmp_path / "mc", args=args)
    status, _, err = convert("megatron-to-hf", tmp_path / "mc", tmp_path / "back")
    assert status == 1
    assert "args.normalization = 'LayerNorm': the llama family (swiglu = True) has 'RMSNorm'" in err
    assert "args.multi_latent_attention = True is not converted" in err
    assert "decoder.layers.0.self_attention.linear_qkv.weight is (96, 32), the args make it (96, 48)" in err
    assert "embedding.word_embeddings.weight is (128, 32), the args make it (128, 48)" in err


def test_experts_not_where_megatron_core_keeps_them_are_refused_by_name(tmp_path):
    """Megatron-LM issue 5845: a Mixtral conversion that wrote the experts under names
    Megatron-Core does not read (here SequentialMLP's in-memory `local_experts.{e}`), so every
    expert stayed random. Each expert tensor must be read: the ones missing and the ones no
    parameter takes are named, with the routing options that the MoE families lack."""
    from libai_zoo.convert.torch_dist import read_common, read_tensors, write_checkpoint

    tiny_hf("mixtral").save_pretrained(tmp_path / "hf")
    ok("hf-to-megatron", tmp_path / "hf", tmp_path / "mc")
    out = ok("inspect", tmp_path / "mc")
    assert "num_experts=4 moe_router_topk=2 moe_ffn_hidden_size=48 moe_router_pre_softmax=False moe_layer_freq=1" in out
    assert has_row(out, "decoder.layers.mlp.experts.experts.linear_fc1.weight", "[2, 4, 96, 32]", "float32")
    release = tmp_path / "mc" / "release"
    tensors = {}
    for name, tensor in read_tensors(release).items():
        if ".experts.experts." in name:
            tensors.update({name.replace("experts.experts.", f"experts.local_experts.{e}."): expert
                            for e, expert in enumerate(tensor)})
        else:
            tensors[name] = tensor
    common = read_common(release)
    common["args"].moe_router_score_function, common["args"].moe_expert_capacity_factor = "sigmoid", 1.0
    write_checkpoint(tmp_path / "broken" / "release", tensors, common)
    (tmp_path / "broken" / "latest_checkpointed_iteration.txt").write_text("release")
    status, _, err = convert("megatron-to-hf", tmp_path / "broken", tmp_path / "back")
    assert status == 1 and not (tmp_path / "back").exists()
    for words in ("missing decoder.layers.1.mlp.experts.experts.linear_fc1.weight (4, 96, 32)",
                  "missing decoder.layers.0.mlp.experts.experts.linear_fc2.weight (4, 32, 48)",
                  "unexpected decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight (96, 32)",
                  "args.moe_router_score_function = 'sigmoid': sigmoid scores (DeepSeek-V3's router)",
                  "args.moe_expert_capacity_factor = 1.0: token dropping at an expert capacity"):
        assert words in err
    # per-rank torch files of an MoE (one per expert-parallel rank) are not read: torch_dist is
    files = tmp_path / "torch_files" / "iter_0000001" / "mp_rank_00"
    files.mkdir(parents=True)
    torch.save({"args": read_common(release)["args"], "iteration": 1, "checkpoint_version": 3.0,
                "model": {"decoder.layers.0.mlp.router.weight": torch.zeros(4, 32)}}, files / "model_optim_rng.pt")
    (tmp_path / "torch_files" / "latest_checkpointed_iteration.txt").write_text("1")
    status, _, err = convert("megatron-to-hf", tmp_path / "torch_files", tmp_path / "back")
    assert status == 1 and "per-rank torch files of a Mixture of Experts (args.num_experts = 4)" in err
    assert "--ckpt-convert-format torch_dist" in err


def test_a_missing_tensor_is_named(tmp_path):
    tiny_hf("gpt2_untied").save_pretrained(tmp_path / "hf")
    ok("hf-to-megatron", tmp_path / "hf", tmp_path / "mc")
    args = torch.load(tmp_path / "mc" / "release" / COMMON, weights_only=False)["args"]
    args.untie_embeddings_and_output_weights = False
    _rewrite_common(tmp_path / "mc", args=args)
    status, _, err = convert("megatron-to-hf", tmp_path / "mc", tmp_path / "back")
    assert status == 1 and "unexpected output_layer.weight (128, 32)" in err
    args.untie_embeddings_and_output_weights, args.add_bias_linear = True, False
    _rewrite_common(tmp_path / "mc", args=args)
    status, _, err = convert("megatron-to-hf", tmp_path / "mc", tmp_path / "back")
    assert status == 1 and "args.add_bias_linear = False: GPT-2's linear layers have biases" in err


class Unsafe:
    """Anything that is not data: unpickling it would call os.system."""

    def __reduce__(self):
        import os

        return os.system, ("echo pwned",)


def test_pickles_that_would_run_code_are_refused(tmp_path):
    tiny_hf("gpt2").save_pretrained(tmp_path / "hf")
    ok("hf-to-megatron", tmp_path / "hf", tmp_path / "mc")
    _rewrite_common(tmp_path / "mc", extra=Unsafe())
    status, _, err = convert("megatron-to-hf", tmp_path / "mc", tmp_path / "back")
    assert status == 1 and "posix.system" in err and "not loaded for safety" in err
    _rewrite_common(tmp_path / "mc", extra=None)
    metadata = tmp_path / "mc" / "release" / ".metadata"
    metadata.write_bytes(pickle.dumps(Unsafe()))
    status, _, err = convert("megatron-to-hf", tmp_path / "mc", tmp_path / "back")
    assert status == 1 and "posix.system is not a torch.distributed.checkpoint metadata class" in err


def test_megatron_enums_in_args_are_read_as_text(tmp_path):
    """Megatron-LM's args hold enums (attention_backend = AttnBackend.auto); the pickle is written
    in a subprocess, since importing megatron.core widens torch's weights_only allow-list for the
    whole process."""
    tiny_hf("gpt2").save_pretrained(tmp_path / "hf")
    ok("hf-to-megatron", tmp_path / "hf", tmp_path / "mc")
    common = tmp_path / "mc" / "release" / COMMON
    script = ("import sys, torch; from megatron.core.transformer.enums import AttnBackend; "
              "c = torch.load(sys.argv[1], weights_only=False); c['args'].attention_backend = AttnBackend.flash; "
              "torch.save(c, sys.argv[1])")
    subprocess.run([sys.executable, "-W", "ignore", "-c", script, str(common)], check=True, timeout=120)
    assert "megatron.core.transformer.enums.AttnBackend" in torch.serialization.get_unsafe_globals_in_checkpoint(
        str(common))
    out = ok("inspect", tmp_path / "mc")
    assert "format: torch_dist" in out and "swiglu=False" in out
    assert has_row(out, "decoder.layers.self_attention.linear_qkv.weight", "[2, 96, 32]", "float32")
    ok("megatron-to-hf", tmp_path / "mc", tmp_path / "back")


def test_layernorm_1p_checkpoints_get_their_one_back(tmp_path):
    """--apply-layernorm-1p stores each norm's gamma - 1: the reader adds the 1 back."""
    from libai_zoo.convert.torch_dist import read_common, read_tensors, write_checkpoint

    source = tiny_hf("gpt_neox")
    source.save_pretrained(tmp_path / "hf")
    ok("hf-to-megatron", tmp_path / "hf", tmp_path / "mc")
    release = tmp_path / "mc" / "release"
    common = read_common(release)
    common["args"].apply_layernorm_1p = True
    norms = ("layer_norm_weight", "final_layernorm.weight")
    tensors = {name: t - 1.0 if name.endswith(norms) else t for name, t in read_tensors(release).items()}
    write_checkpoint(tmp_path / "mc_1p" / "release", tensors, common)
    (tmp_path / "mc_1p" / "latest_checkpointed_iteration.txt").write_text("release")
    ok("megatron-to-hf", tmp_path / "mc_1p", tmp_path / "back")
    with torch.no_grad():
        assert _max_difference(_hf_logits(tmp_path / "back"), source(IDS).logits) <= 1e-6
