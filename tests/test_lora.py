"""LoRA in one process: the adapted layer's arithmetic, what is frozen, PEFT's adapter format both
ways for every family (checked with peft itself, under each family's Hugging Face module names),
the merged export that transformers loads, and a LoRA run of the
trainer (frozen base, exact resume, continuing from an exported adapter). Layouts: test_lora_parallel.py."""

from __future__ import annotations

import json
from pathlib import Path

import peft
import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import save_file
from torch import nn

from libai_zoo.config import ConfigError, LazyConfig
from libai_zoo.convert import load_checkpoint_model
from libai_zoo.hf import apply_lora_config, load_peft_adapter, read_peft_adapter, save_peft_adapter
from libai_zoo.layers import Experts, Linear, MoE, apply_lora, is_adapter_parameter, merge_lora
from libai_zoo.models import Gemma3ForCausalLM, GPT2LMHeadModel, LlamaForCausalLM, Phi3ForCausalLM, RobertaForMaskedLM
from libai_zoo.utils import gradient_bytes, optimizer_state_bytes
from model_cases import CASES, gemma3_text_config, make_hf_model, make_inputs
from support.recipes import saved_recipe
from test_convert import cli
from trainer_runs import losses, run_trainer

ROOT = Path(__file__).resolve().parents[1]
convert = cli.main


def test_adapted_linear_is_its_weight_plus_the_scaled_low_rank_update():
    torch.manual_seed(0)
    x = torch.randn(3, 5, 8)
    for parallel in ("col", "row", "data"):
        layer = Linear(8, 12, parallel=parallel)
        lora = layer.add_lora(4, alpha=6.0)
        nn.init.normal_(lora.B)
        expected = F.linear(x, layer.weight + 6.0 / 4 * lora.B @ lora.A, layer.bias)
        assert (layer(x) - expected).abs().max() < 1e-5, parallel
    partial = Linear(8, 12, parallel="row", reduce_output=False)  # a fused block adds the bias after its reduction
    nn.init.normal_(partial.add_lora(2, alpha=2.0).B)
    assert (partial(x) + partial.bias - F.linear(x, partial.weight + partial.lora.delta_weight(), partial.bias)
            ).abs().max() < 1e-5


def test_expert_adapters_are_each_experts_own_low_rank_update():
    """Per projection and expert e: x (W[e] + scale · B[e] A[e])ᵀ, in the grouped GEMMs (ranks of
    16-byte rows) and in the per-expert loop (rank 2), against an explicit per-expert computation."""
    torch.manual_seed(0)
    counts = torch.tensor([3, 0, 5, 4])  # an expert without tokens
    tokens = torch.randn(int(counts.sum()), 32)
    for rank in (4, 2):
        experts = Experts(4, 32, 16)
        for param in experts.parameters():
            nn.init.normal_(param, std=0.2)
        names = apply_lora(experts, rank, 6.0, target_modules=["gate_proj", "up_proj", "down_proj"])
        assert names == ["gate_proj", "up_proj", "down_proj"]
        assert experts._groupable([tokens]) == (rank == 4)
        for adapter in experts.lora.values():
            assert adapter.A.shape[:2] == adapter.B.shape[::2] == (4, rank)  # the experts' dim first, then rank
            nn.init.normal_(adapter.B, std=0.2)
        outputs = []
        for e, x in enumerate(tokens.split(counts.tolist())):
            gate, up, down = (getattr(experts, name)[e] + 6.0 / rank * experts.lora[name].B[e] @ experts.lora[name].A[e]
                              for name in ("gate_proj", "up_proj", "down_proj"))
            outputs.append(F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down))
        assert (experts(tokens, counts) - torch.cat(outputs)).abs().max() < 1e-5, rank
        experts.grouped_mm = False
        assert (experts(tokens, counts) - torch.cat(outputs)).abs().max() < 1e-5, rank
    with pytest.raises(ValueError, match="expert adapters take none"):
        apply_lora(MoE(32, 4, 2, 16), 4, dropout=0.1, target_modules=["experts"])



def tiny_llama_hf(path: Path) -> Path:
    config = transformers.LlamaConfig(vocab_size=8192, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


def tiny_gpt2_hf(path: Path) -> Path:
    config = transformers.GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=0,
                                     eos_token_id=0)
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(config).save_pretrained(path)
    return path


def tiny_roberta_hf(path: Path) -> Path:
    config = transformers.RobertaConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                        num_attention_heads=4, max_position_embeddings=20, type_vocab_size=1)
    torch.manual_seed(0)
    transformers.RobertaForMaskedLM(config).save_pretrained(path)
    return path


def tiny_gemma3_hf(path: Path) -> Path:
    """Gemma 3's text model (model_cases'): Llama's module names, and q/k norms PEFT must leave alone."""
    torch.manual_seed(0)
    transformers.Gemma3ForCausalLM(gemma3_text_config(vocab_size=96)).save_pretrained(path)
    return path


def tiny_phi3_hf(path: Path) -> Path:
    config = transformers.Phi3Config(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                     bos_token_id=0, eos_token_id=0, pad_token_id=None)
    torch.manual_seed(0)
    transformers.Phi3ForCausalLM(config).save_pretrained(path)
    return path


# family -> (a tiny Hugging Face directory, the zoo class, the transformers Auto class that loads it)
FAMILIES = {"llama": (tiny_llama_hf, LlamaForCausalLM, transformers.AutoModelForCausalLM),
            "gemma3": (tiny_gemma3_hf, Gemma3ForCausalLM, transformers.AutoModelForCausalLM),
            "gpt2": (tiny_gpt2_hf, GPT2LMHeadModel, transformers.AutoModelForCausalLM),
            "roberta": (tiny_roberta_hf, RobertaForMaskedLM, transformers.AutoModelForMaskedLM),
            "phi3": (tiny_phi3_hf, Phi3ForCausalLM, transformers.AutoModelForCausalLM)}


def test_apply_lora_freezes_the_base_and_refuses_unknown_targets(tmp_path):
    model = LlamaForCausalLM.from_pretrained(tiny_llama_hf(tmp_path / "hf"))
    adapted = apply_lora(model, 4, 8.0)
    assert len(adapted) == 2 * 5  # qkv, out, gate, up, down per layer
    trainable = sorted({name.split(".", 3)[-1] for name, p in model.named_parameters() if p.requires_grad})
    assert trainable == [f"{layer}.lora.{factor}" for layer in ("attn.out", "attn.qkv", "mlp.down", "mlp.gate",
                                                                "mlp.up") for factor in "AB"]
    assert all(name.endswith(("lora.A", "lora.B")) for name, p in model.named_parameters() if p.requires_grad)
    with pytest.raises(ValueError, match=r"\['q_proj'\] match no Linear layer.*'qkv'"):
        apply_lora(LlamaForCausalLM.from_pretrained(tmp_path / "hf"), 4, target_modules=["qkv", "q_proj"])
    with pytest.raises(ValueError, match="merge them first"):
        model.save_pretrained(tmp_path / "out")


def _randomised_adapters(model: nn.Module) -> None:
    """B is zero at the start (the adapted model equals its base): give it values to compare
    (ours: `….lora.B`, experts' `….lora.<projection>.B`; PEFT's: `….lora_B.default.weight`)."""
    generator = torch.Generator().manual_seed(1)
    for name, param in model.named_parameters():
        if is_adapter_parameter(name) and name.endswith(".B") or name.endswith("lora_B.default.weight"):
            param.data = torch.randn(param.shape, generator=generator) * 0.1


LLAMA_NAMES = ["o_proj", "q_proj", "k_proj", "v_proj", "down_proj"]  # every Llama-shaped family's
# Each family: the modules a PEFT-trained adapter targets (Hugging Face's names; the first, the
# attention's output, at another rank and alpha), the rank our fused qkv takes from their r=2
# adapters (3 × 2 from q, k and v; 2 from a packed qkv) and how many Linear layers of a layer (of
# each layer: a tuple) the default targets adapt (attention qkv and out, the MLP's). A
# tests/model_cases.py family is one line.
LORA_FAMILIES = {
    "llama": (LLAMA_NAMES, 6, 5),
    "gemma3": (LLAMA_NAMES, 6, 5),
    "gpt2": (["c_proj", "c_attn", "c_fc"], 2, 4),  # GPT-2's c_attn is one module in PEFT too
    "roberta": (["attention.output.dense", "query", "key", "value", "intermediate.dense"], 6, 4),
    "phi3": (["o_proj", "qkv_proj", "gate_up_proj", "down_proj"], 2, 5),  # qkv_proj: one module in PEFT too
    "qwen3": (LLAMA_NAMES, 6, 5),
    "mistral": (LLAMA_NAMES, 6, 5),
    "pythia": (["dense", "query_key_value", "dense_4h_to_h"], 2, 4),
    "gemma": (LLAMA_NAMES, 6, 5),
    "gemma2": (LLAMA_NAMES, 6, 5),
    "granite": (LLAMA_NAMES, 6, 5),
    "smollm3": (LLAMA_NAMES, 6, 5),
    "olmo2": (LLAMA_NAMES, 6, 5),
    "gpt_oss": (LLAMA_NAMES[:4], 6, 2),  # the attention only: the experts are stacked parameters, no Linear
    # MoE (our adapters: MOE_TARGETS): PEFT on transformers 5 turns the experts' projections into
    # adapters on their stacked parameters (target_parameters), gate and up into gate_up_proj's
    "qwen3_moe": (LLAMA_NAMES, 6, (2, 5)),  # layer 1 is MoE: down_proj is its experts' (layer 0's dense one is not)
    "mixtral": (["o_proj", "q_proj", "k_proj", "v_proj", "w1", "w3", "w2"], 6, 5),
    "qwen2_moe": (LLAMA_NAMES, 6, (5, 2)),  # layer 0 is MoE (its shared expert is not adapted), layer 1 dense
    "olmoe": (["o_proj", "q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "down_proj"], 6, 5),
}
# what our adapters of an MoE family adapt: the attention and the experts (PEFT cannot hold a Qwen-MoE's dense MLPs')
MOE_TARGETS = {family: ["qkv", "out", "experts"] for family in ("qwen3_moe", "mixtral", "qwen2_moe", "olmoe")}


def family_hf(family: str, path: Path) -> tuple[Path, type, type]:
    """A tiny transformers checkpoint of `family` written at `path` (FAMILIES', or a
    tests/model_cases.py case's model, its norms' weights drawn away from 1), the libai_zoo class
    that loads it and the transformers class that does."""
    if family in FAMILIES:
        make_hf, cls, hf_class = FAMILIES[family]
        return make_hf(path), cls, hf_class
    case = CASES[family]
    make_hf_model(case).save_pretrained(path)
    return path, case.zoo_class, case.hf_class


@pytest.mark.parametrize("family", LORA_FAMILIES)
def test_peft_loads_our_adapter_and_transformers_our_merged_model(family, tmp_path):
    """Phi-3's gate_up_proj holds the adapters of our gate and up joined (rank 2r): back here each
    takes the whole A and its rows of B, the same update."""
    hf_dir, cls, hf_class = family_hf(family, tmp_path / "hf")
    model = cls.from_pretrained(hf_dir)
    adapted = apply_lora(model, 4, 8.0, target_modules=MOE_TARGETS.get(family))
    per_layer = LORA_FAMILIES[family][2]
    assert len(adapted) == (sum(per_layer) if isinstance(per_layer, tuple)
                            else model.config.num_hidden_layers * per_layer)
    assert not [name for name in adapted if "norm" in name]  # Qwen3's q_norm and k_norm stay as they are
    _randomised_adapters(model)
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(2))
    expected = model(ids).logits
    assert (expected - cls.from_pretrained(hf_dir)(ids).logits).abs().max() > 1e-2  # the adapters matter

    save_peft_adapter(model, tmp_path / "adapter", base_model_name_or_path=str(hf_dir))
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["fan_in_fan_out"]) == (4, 8.0, family == "gpt2")
    base = hf_class.from_pretrained(hf_dir).eval()
    with_adapter = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    assert (with_adapter(ids).logits - expected).abs().max() <= 1e-5

    reloaded = cls.from_pretrained(hf_dir)
    apply_lora_config(reloaded, {"adapter": str(tmp_path / "adapter")})
    load_peft_adapter(reloaded, tmp_path / "adapter")
    # the experts' gate and up come back with their joined rank (2r, B zero in the other's columns):
    # equal up to rounding
    assert (reloaded(ids).logits - expected).abs().max() <= (1e-6 if family in MOE_TARGETS else 0)

    assert merge_lora(model) == len(adapted)
    model.save_pretrained(tmp_path / "merged")
    merged = hf_class.from_pretrained(tmp_path / "merged").eval()
    assert (merged(ids).logits - expected).abs().max() <= 1e-5


@pytest.mark.parametrize("family", LORA_FAMILIES)
def test_an_adapter_trained_by_peft_loads_with_its_fused_parts_stacked(family, tmp_path):
    """PEFT trains separate A's for q, k and v: our fused qkv takes them stacked (rank 3r); Phi-3's
    gate_up_proj gives our gate and up its A and each its rows of B."""
    hf_dir, cls, hf_class = family_hf(family, tmp_path / "hf")
    targets, fused_rank, _ = LORA_FAMILIES[family]
    base = hf_class.from_pretrained(hf_dir).eval()
    trained = peft.get_peft_model(hf_class.from_pretrained(hf_dir),
                                  peft.LoraConfig(r=2, lora_alpha=6, target_modules=targets,
                                                  rank_pattern={targets[0]: 3}, alpha_pattern={targets[0]: 9}))
    _randomised_adapters(trained)
    trained.save_pretrained(tmp_path / "adapter")
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(2))
    expected = trained.eval()(ids).logits
    assert (expected - base(ids).logits).abs().max() > 1e-2  # the adapters matter
    model = cls.from_pretrained(hf_dir)
    layers = apply_lora_config(model, {"adapter": str(tmp_path / "adapter")})
    qkv = next(name for name in layers if name.endswith("attn.qkv"))
    assert layers[qkv][0] == fused_rank
    assert layers[next(name for name in layers if name.endswith("attn.out"))] == (3, 9.0)  # the patterns reach it
    load_peft_adapter(model, tmp_path / "adapter")
    assert (model(ids).logits - expected).abs().max() <= 1e-5


# T5's PEFT names (q, k, v, o of the self- and cross-attentions; wi or wi_0 and wi_1, wo) and Swin's
# (transformers 5 renames its modules on load: attention.q_proj, mlp.fc1, which PEFT adapts; Swin V2
# keeps the checkpoint's); how many Linear layers our default targets adapt
OTHER_LORA_FAMILIES = {
    "t5": (["q", "k", "v", "o", "wi", "wo"], 2 * 4 + 2 * 7),  # encoder: qkv, out, MLP; decoder: and q, kv, out
    "t5_v1_1": (["q", "k", "v", "o", "wi_0", "wi_1", "wo"], 2 * 5 + 2 * 8),
    "swin_cls": (["q_proj", "k_proj", "v_proj", "o_proj", "fc1", "fc2"], 5 * 4),
    "swinv2_cls": (["query", "key", "value", "dense"], 5 * 4),
}


@pytest.mark.parametrize("family", OTHER_LORA_FAMILIES)
def test_adapters_go_both_ways_under_peft_names(family, tmp_path):
    """Our adapters on every Linear load into PEFT, and PEFT's (their first target at another rank and
    alpha, named as PEFT names it) into our fused qkv (and T5's kv)."""
    case = CASES[family]
    make_hf_model(case).save_pretrained(tmp_path / "hf")
    if case.kind == "seq2seq":
        inputs = {"input_ids": torch.randint(3, 96, (2, 12), generator=torch.Generator().manual_seed(2)),
                  "decoder_input_ids": torch.randint(3, 96, (2, 6), generator=torch.Generator().manual_seed(3))}
    else:
        inputs = {"pixel_values": make_inputs(case)[0]["pixel_values"]}
    targets, count = OTHER_LORA_FAMILIES[family]
    model = case.zoo_class.from_pretrained(tmp_path / "hf").eval()
    assert len(apply_lora(model, 4, 8.0)) == count
    _randomised_adapters(model)
    expected = model(**inputs).logits
    save_peft_adapter(model, tmp_path / "ours", base_model_name_or_path=str(tmp_path / "hf"))
    base = case.hf_class.from_pretrained(tmp_path / "hf").eval()
    theirs = peft.PeftModel.from_pretrained(base, tmp_path / "ours").eval()
    assert (theirs(**inputs).logits - expected).abs().max() <= 1e-5

    trained = peft.get_peft_model(case.hf_class.from_pretrained(tmp_path / "hf"),
                                  peft.LoraConfig(r=2, lora_alpha=6, target_modules=targets,
                                                  rank_pattern={targets[0]: 3}, alpha_pattern={targets[0]: 9}))
    _randomised_adapters(trained)
    trained.save_pretrained(tmp_path / "peft")
    expected = trained.eval()(**inputs).logits
    model = case.zoo_class.from_pretrained(tmp_path / "hf").eval()
    apply_lora_config(model, {"adapter": str(tmp_path / "peft")})
    load_peft_adapter(model, tmp_path / "peft")
    assert (model(**inputs).logits - expected).abs().max() <= 1e-5


def test_peft_cannot_hold_a_qwen_moe_dense_mlp_adapter(tmp_path):
    """PEFT 0.21 on transformers 5 takes any target named gate_proj/up_proj/down_proj of a Qwen-MoE
    for its experts' stacked parameters (even model.layers.0.mlp.down_proj, a dense layer): writing
    one is refused, naming why."""
    hf_dir, cls, _ = family_hf("qwen3_moe", tmp_path / "hf")
    model = cls.from_pretrained(hf_dir)
    apply_lora(model, 4, 8.0)  # the default targets: layer 0's dense MLP too
    with pytest.raises(ValueError, match=r"layers.0.mlp.down_proj.*cannot be written for PEFT.*stacked parameters"):
        save_peft_adapter(model, tmp_path / "adapter")


def test_an_adapter_on_per_expert_modules_loads_as_peft_converts_it(tmp_path):
    """An adapter trained on transformers 4's per-expert modules (Mixtral's experts.{e}.w1, w3, w2):
    PEFT converts it onto transformers 5's fused experts, we stack it; both give our outputs. The
    experts' gate without their up has no PEFT form."""
    hf_dir, cls, hf_class = family_hf("mixtral", tmp_path / "hf")
    model = cls.from_pretrained(hf_dir)
    apply_lora(model, 4, 8.0, target_modules=["experts"])
    _randomised_adapters(model)
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(2))
    expected = model(ids).logits
    factors = {}
    for rule in model.hf_weight_map().rules:
        if rule.zoo.endswith("_proj"):
            rule = rule.rule  # the hub's per-expert form (Either's first)
            adapter = model.get_submodule(rule.zoo.replace(".experts.", ".experts.lora."))
            for e in range(rule.count):
                module = "base_model.model." + rule.name.format(e).removesuffix(".weight")
                factors |= {f"{module}.lora_A.weight": adapter.A[e].detach().clone(),
                            f"{module}.lora_B.weight": adapter.B[e].detach().clone()}
    (tmp_path / "adapter").mkdir()
    save_file(factors, str(tmp_path / "adapter" / "adapter_model.safetensors"))
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["w1", "w2", "w3"]}))
    with_adapter = peft.PeftModel.from_pretrained(hf_class.from_pretrained(hf_dir), tmp_path / "adapter").eval()
    assert (with_adapter(ids).logits - expected).abs().max() <= 1e-5
    reloaded = cls.from_pretrained(hf_dir)
    layers = apply_lora_config(reloaded, {"adapter": str(tmp_path / "adapter")})
    assert sorted(layers) == [f"model.layers.{i}.mlp.experts.{p}_proj" for i in (0, 1) for p in ("down", "gate", "up")]
    assert set(layers.values()) == {(4, 8.0)}
    load_peft_adapter(reloaded, tmp_path / "adapter")
    assert (reloaded(ids).logits - expected).abs().max() == 0

    # transformers 5 holds the experts' gate and up as one parameter (gate_up_proj): adapt both or neither
    gate_only = cls.from_pretrained(hf_dir)
    apply_lora(gate_only, 4, 8.0, target_modules=["gate_proj", "down_proj"])
    with pytest.raises(ValueError, match=r"\['model.layers.0.mlp.experts.up_proj', 'model.layers.1.mlp.experts.up_proj'"
                                         r"\] have no adapter.*gate_proj and up_proj both"):
        save_peft_adapter(gate_only, tmp_path / "gate_only")


def test_peft_default_targets_adapt_q_and_v_of_the_fused_qkv(tmp_path):
    """PEFT adapts q_proj and v_proj of a Llama by default: k's rows of the fused update stay zero."""
    hf_dir = tiny_llama_hf(tmp_path / "hf")
    trained = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(hf_dir),
                                  peft.LoraConfig(r=2, lora_alpha=4))
    _randomised_adapters(trained)
    trained.save_pretrained(tmp_path / "adapter")
    model = LlamaForCausalLM.from_pretrained(hf_dir)
    layers = apply_lora_config(model, {"adapter": str(tmp_path / "adapter")})
    assert sorted({name.rpartition(".")[2] for name in layers}) == ["qkv"]
    load_peft_adapter(model, tmp_path / "adapter")
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(2))
    assert (model(ids).logits - trained.eval()(ids).logits).abs().max() <= 1e-5


@pytest.fixture(scope="module")
def config_file(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("lora")
    documents = (ROOT / "data/corpus/python_docs.txt").read_text().split("\n\n")[:100]
    (root / "text.txt").write_text("\n\n".join(documents))
    return saved_recipe(root / "config.yaml", "pretrained_on_text.py", f"model.path={tiny_llama_hf(root / 'hf')}",
                        f"dataloader.train.text_file={root / 'text.txt'}", f"dataloader.train.cache_dir={root / 'cache'}")


def lora_run(config_file: Path, output_dir: Path, *overrides: str, **kwargs):
    cfg = LazyConfig.apply_overrides(LazyConfig.load(str(config_file)), [
        f"train.output_dir={output_dir}", "train.max_iter=6", "train.micro_batch_size=4", "train.global_batch_size=4",
        "train.log_period=1", "train.checkpoint.period=3", "optim.lr=1e-2", "train.lora.rank=4",
        "train.lora.alpha=8", *overrides])
    return run_trainer(cfg, **kwargs)


@pytest.fixture(scope="module")
def trained(config_file, tmp_path_factory):
    return lora_run(config_file, tmp_path_factory.mktemp("run") / "out")


def test_a_lora_run_trains_only_the_adapters(config_file, trained):
    hf = LlamaForCausalLM.from_pretrained(config_file.parent / "hf")
    model = trained.model
    base = {name: p for name, p in model.named_parameters() if not p.requires_grad}
    assert base and all(torch.equal(p, hf.get_parameter(name)) for name, p in base.items())  # frozen: unchanged
    assert all(p.grad is None for p in base.values())
    adapters = [p for p in model.parameters() if p.requires_grad]
    assert all(p.abs().sum() > 0 for p in adapters)  # B left zero
    adapter_bytes = sum(p.numel() * 4 for p in adapters)
    # AdamW: two fp32 moments and a step count per adapter factor, nothing for the base
    assert optimizer_state_bytes(trained.optimizer) == 2 * adapter_bytes + 4 * len(adapters)
    assert gradient_bytes(model) == 0  # the step freed the adapters' gradients; the base never had any
    model(**next(iter(trained.build_train_loader(trained.cfg)))).loss.backward()
    assert gradient_bytes(model) == adapter_bytes
    logged = losses(trained.output_dir)
    assert logged[6] < logged[1]


def test_a_lora_run_resumes_exactly(config_file, trained, tmp_path):
    with pytest.raises(KeyboardInterrupt):
        lora_run(config_file, tmp_path, interrupt_after=3)
    lora_run(config_file, tmp_path, resume=True)
    assert losses(tmp_path) == losses(trained.output_dir)


def test_zoo_to_hf_merges_and_writes_a_peft_adapter_that_a_new_run_starts_from(config_file, trained, tmp_path):
    run_dir = trained.output_dir
    model = load_checkpoint_model(run_dir / "model_0000006")
    ids = torch.randint(0, 8192, (2, 16), generator=torch.Generator().manual_seed(3))
    expected = model(ids).logits
    assert convert(["zoo-to-hf", str(run_dir), str(tmp_path / "merged")]) == 0
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert (merged(ids).logits - expected).abs().max() <= 1e-5
    assert convert(["zoo-to-hf", str(run_dir), str(tmp_path / "adapter"), "--adapter"]) == 0
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(config_file.parent / "hf")
    base = transformers.AutoModelForCausalLM.from_pretrained(config_file.parent / "hf").eval()
    assert (peft.PeftModel.from_pretrained(base, tmp_path / "adapter")(ids).logits - expected).abs().max() <= 1e-5

    # continue training from the adapter: the new run's model starts as the exported one
    continued = lora_run(config_file, tmp_path / "continued", "train.max_iter=0",
                         f"train.lora.adapter={tmp_path / 'adapter'}")
    assert (continued.model.eval()(ids).logits - expected).abs().max() <= 1e-5
    assert len(read_peft_adapter(tmp_path / "adapter", continued.model)) == 10

    # its config.yaml records the adapter's layers: the run resumes and exports without the directory
    lora_run(config_file, tmp_path / "continued", "train.max_iter=1", "train.checkpoint.period=1",
             f"train.lora.adapter={tmp_path / 'adapter'}")
    (tmp_path / "adapter").rename(tmp_path / "moved")
    assert convert(["zoo-to-hf", str(tmp_path / "continued"), str(tmp_path / "exported"), "--adapter"]) == 0
    resumed = lora_run(config_file, tmp_path / "continued", "train.max_iter=2", "train.checkpoint.period=1",
                       f"train.lora.adapter={tmp_path / 'adapter'}", resume=True)
    assert resumed.start_iter == 1 and sorted(losses(tmp_path / "continued")) == [1, 2]


def test_lora_on_a_full_fine_tuning_checkpoint_starts_its_adapters_fresh(config_file, tmp_path):
    """train.load_weight of a checkpoint without adapters: its base loads, the adapters stay as drawn;
    the other way, a checkpoint with adapters is refused by a model without them."""
    tuned = LlamaForCausalLM.from_pretrained(config_file.parent / "hf")
    with torch.no_grad():
        for param in tuned.parameters():
            param.mul_(1.5)  # a base unlike the config's own from_pretrained one
    tuned.save_pretrained(tmp_path / "tuned")
    assert convert(["hf-to-zoo", str(tmp_path / "tuned"), str(tmp_path / "zoo")]) == 0
    weights = f"train.load_weight={tmp_path / 'zoo' / 'model_0000000'}"
    run = lora_run(config_file, tmp_path / "out", "train.max_iter=0", weights)
    fresh = lora_run(config_file, tmp_path / "fresh", "train.max_iter=0")
    for name, param in run.model.named_parameters():
        expected = fresh.model.get_parameter(name) if param.requires_grad else tuned.get_parameter(name)
        assert torch.equal(param, expected), name

    lora_checkpoint = f"train.load_weight={run.output_dir / 'model_0000000'}"
    run.checkpointer.save("model_0000000", 0)
    run.checkpointer.wait()
    with pytest.raises(ConfigError, match=r"LoRA adapter tensors: \d+ in it, 0 in this model: set train.lora"):
        lora_run(config_file, tmp_path / "plain", "train.max_iter=0", "train.lora.rank=0", lora_checkpoint)
