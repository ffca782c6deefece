"""The Auto classes: each model type's directory loads as the zoo class of its task, with the
outputs of that class; unknown model types and tasks are refused naming the supported ones; the
LazyConfig form builds (on the meta device too, as the trainer does) and saves."""

from __future__ import annotations

import pytest
import torch

from libai_zoo import models
from libai_zoo.config import LazyCall, LazyConfig, instantiate
from libai_zoo.models import auto
from model_cases import CASES, main_output, make_hf_model, make_inputs, unscored

AUTO_OF_KIND = {"causal": models.AutoModelForCausalLM, "mlm": models.AutoModelForMaskedLM,
                "seq_cls": models.AutoModelForSequenceClassification, "encoder": models.AutoModel,
                "image": models.AutoModel, "image_cls": models.AutoModelForImageClassification,
                "seq2seq": models.AutoModelForSeq2SeqLM, "seq2seq_body": models.AutoModel,
                "text_encoder": models.AutoModelForTextEncoding}

def _first_case_of_each_model_type_and_task() -> list[str]:
    seen = {}
    for name, case in CASES.items():
        seen.setdefault((case.make_config().model_type, AUTO_OF_KIND[case.kind].task), name)
    return list(seen.values())


NAMES = _first_case_of_each_model_type_and_task()


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    dirs = {}
    for name in NAMES:
        dirs[name] = tmp_path_factory.mktemp(name)
        make_hf_model(CASES[name]).save_pretrained(dirs[name])
    return dirs


def test_every_model_type_of_the_table_has_a_case():
    """A case, or a container whose model a case's class loads (Gemma 3's multimodal checkpoints:
    test_models.py loads them through AutoModelForCausalLM), or a model type a case's class reads
    with its own config class (Kimi K2, DeepSeek-V3's: test_models.py loads one through it)."""
    covered = {CASES[name].make_config().model_type for name in NAMES}
    containers = {model_type for name in NAMES for model_type in CASES[name].zoo_class.containers}
    read_as = {model_type for name in NAMES for model_type in CASES[name].zoo_class.other_configs}
    assert covered | containers | read_as == set(auto.MODELS)


@pytest.mark.parametrize("name", NAMES)
def test_auto_class_loads_the_zoo_class_with_its_outputs(hf_dirs, name):
    case, path = CASES[name], hf_dirs[name]
    model = AUTO_OF_KIND[case.kind].from_pretrained(path, dtype="float32")
    assert type(model) is case.zoo_class
    inputs = unscored(case, make_inputs(case)[0])
    assert torch.equal(main_output(model(**inputs)), main_output(case.zoo_class.from_pretrained(path)(**inputs)))
    config = models.AutoConfig.from_pretrained(path)
    assert type(config) is type(model.config) and config.to_dict() == model.config.to_dict()
    torch.manual_seed(0)
    built = AUTO_OF_KIND[case.kind].from_config(config)
    torch.manual_seed(0)
    # compared in eval: a model built at random trains, and stochastic depth (Swin) draws in training
    assert type(built) is case.zoo_class and torch.equal(main_output(built.eval()(**inputs)),
                                                         main_output(case.zoo_class(config).eval()(**inputs)))
    assert auto.class_for(config.to_dict()) is case.zoo_class  # config.json's architectures pick the task


def test_unknown_model_type_and_missing_task_name_the_supported_ones(hf_dirs, tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "no_such_model"}')
    with pytest.raises(ValueError, match="no_such_model"):  # neither the zoo's nor transformers'
        models.AutoModelForCausalLM.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "bart"}')
    with pytest.raises(ValueError, match="model_type 'bart' has no libai_zoo model"):  # no door for encoder-decoders
        models.AutoModelForSeq2SeqLM.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "mamba"}')
    with pytest.raises(ValueError, match="model_type 'mamba'.*supported: bert"):
        models.AutoConfig.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"no causal_lm model for model_type 'bert' \(it has base, masked_lm, "
                                         r"sequence_classification\); the causal_lm model types are (\w+, )*gpt2, gpt_neox"):
        models.AutoModelForCausalLM.from_pretrained(hf_dirs["bert_mlm"])
    with pytest.raises(ValueError, match="no sequence_classification model for model_type 'llama'"):
        models.AutoModelForSequenceClassification.from_config(CASES["llama"].make_config())
    with pytest.raises(TypeError, match="use AutoModelForCausalLM.from_pretrained"):
        models.AutoModelForCausalLM()


def test_lazy_call_builds_saves_and_defers_on_the_meta_device(hf_dirs, tmp_path):
    cfg = {"model": LazyCall(models.AutoModelForCausalLM.from_pretrained)(path=str(hf_dirs["qwen2"]))}
    LazyConfig.save(cfg, tmp_path / "config.yaml")
    saved = LazyConfig.load(str(tmp_path / "config.yaml")).model
    assert saved._target_ == "libai_zoo.models.auto.AutoModelForCausalLM.from_pretrained"
    assert isinstance(instantiate(saved), models.LlamaForCausalLM)
    with torch.device("meta"):  # as the trainer builds models: nothing read, the directory remembered
        model = instantiate(cfg["model"])
    assert model.lm_head.weight.is_meta and model.pretrained_source.path == hf_dirs["qwen2"]
