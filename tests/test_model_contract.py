"""The model contract (libai_zoo.models.TrainableModel): a model that is not one of the zoo's,
written the way a user would (from libai_zoo.layers, implementing the contract), trains with
DefaultTrainer at tp2 and at pp2 (two gloo processes) with the one-process losses; a model that
lacks a part of the contract is refused before training, with the part named."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_outputs import TokenClassifierOutput

from libai_zoo import distributed, layers
from libai_zoo.config import LazyConfig
from libai_zoo.engine import DefaultTrainer
from libai_zoo.models import TrainableModel
from support.forked import run_forked
from support.recipes import config_path
from trainer_runs import losses, run_trainer

VOCAB, TAGS, SEQ, STEPS = 64, 3, 16, 6


class TinyTagger(nn.Module, TrainableModel):
    """Tags every token (here: its id modulo 3): token embeddings, GPT-J-style parallel blocks with
    RMSNorm, a final RMSNorm and a replicated linear tagger; padding positions carry the tag -100."""

    layer_stack = "blocks"
    first_stage_modules = ("embed_tokens",)
    last_stage_modules = ("final", "tagger")
    loss_unit = "token"

    def __init__(self, hidden: int = 32, num_layers: int = 4, heads: int = 4):
        super().__init__()
        self.embed_tokens = layers.VocabEmbedding(VOCAB, hidden)
        self.blocks = nn.ModuleList(
            layers.TransformerLayer(layers.LayerSpec(hidden, layers.AttentionSpec(heads, bias=False),
                                                     layers.MLPSpec(2 * hidden, bias=False), norm="rmsnorm",
                                                     parallel_block=True))
            for _ in range(num_layers))
        self.final = layers.RMSNorm(hidden, 1e-6)
        self.tagger = layers.Linear(hidden, TAGS, parallel="data", sequence_parallel=False)

    def embed(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.embed_tokens(inputs["input_ids"])

    def layer_inputs(self, inputs: dict[str, torch.Tensor], hidden: torch.Tensor | None = None) -> dict:
        return {"attention_mask": inputs.get("attention_mask")}

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.final(hidden)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.tagger(hidden)

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        return F.cross_entropy(outputs.float().flatten(0, 1), targets.flatten(), reduction=reduction)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, return_logits: bool = True) -> TokenClassifierOutput:
        hidden = self.embed({"input_ids": input_ids})
        for block in self.blocks:
            hidden = block(hidden, attention_mask=attention_mask)
        logits = self.head(self.final_norm(hidden))
        return TokenClassifierOutput(loss=None if labels is None else self.loss(logits, labels), logits=logits)


class TaggingData(torch.utils.data.Dataset):
    """Random token sequences, the later ones padded (tag -100 there)."""

    def __init__(self, num_samples: int = 64):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, VOCAB, (num_samples, SEQ), generator=g)
        self.lengths = torch.randint(SEQ // 2, SEQ + 1, (num_samples,), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids, length = self.ids[index], int(self.lengths[index])
        labels = (ids % TAGS).masked_fill(torch.arange(SEQ) >= length, -100)
        return {"input_ids": ids, "labels": labels}


class HeadlessTagger(nn.Module):
    """Duck-typed, not a TrainableModel, and without final_norm and a layer stack."""

    first_stage_modules, last_stage_modules, loss_unit = (), (), "token"

    def embed(self, inputs):
        return inputs["input_ids"].float()

    layer_inputs = head = loss = embed


class MisnamedStack(TinyTagger):
    layer_stack = "layers"


class ScaledTagger(TinyTagger):
    """Scales the tag logits by a buffer: a model built on the meta device must compute it."""

    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.full((TAGS,), 0.5))

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.tagger(hidden) * self.scale

    def init_buffers(self) -> None:
        self.scale.fill_(0.5)


class BufferedTagger(ScaledTagger):
    init_buffers = TrainableModel.init_buffers  # the default: no buffers allowed


CONFIG = str(config_path("tagger.py"))  # trains TinyTagger; `model_is` names another model of this module


def model_is(model: str) -> str:
    """The override that trains another model of this module."""
    return f"model._target_=test_model_contract.{model}"


def train(config: str, output_dir: str, *overrides: str) -> dict[int, float]:
    cfg = LazyConfig.apply_overrides(LazyConfig.load(config), [
        f"train.output_dir={output_dir}", f"train.max_iter={STEPS}", "train.global_batch_size=8",
        "train.log_period=1", "train.checkpoint.period=null", "optim.lr=1e-2", *overrides])
    run_trainer(cfg)
    return losses(Path(output_dir))


def _tp2_and_pp2(config: str, root: str) -> dict:
    return {"tp2": train(config, f"{root}/tp2", "dist.tp=2", "train.micro_batch_size=8"),
            "pp2": train(config, f"{root}/pp2", "dist.pp=2", "train.micro_batch_size=4")}


@pytest.mark.slow
def test_a_user_model_trains_at_tp2_and_pp2_like_one_process(tmp_path):
    one = train(CONFIG, str(tmp_path / "one"), "train.micro_batch_size=8")
    assert sorted(one) == list(range(1, STEPS + 1)) and one[STEPS] < one[1] - 0.05  # it learns
    runs = run_forked(_tp2_and_pp2, 2, CONFIG, str(tmp_path))[0]
    for layout, logged in runs.items():
        assert sorted(logged) == sorted(one), layout
        assert max(abs(logged[i] - one[i]) / one[i] for i in one) <= 1e-5, (layout, logged, one)


@pytest.mark.parametrize("model, message", [
    ("HeadlessTagger", "HeadlessTagger does not implement the model contract (libai_zoo.models.TrainableModel): "
                       "it lacks layer_stack, main_input_name, final_norm, split_batch, head_loss, num_loss_targets, "
                       "flops_per_token, init_parameter, input_limits, pipeline_problems, layout_problems, stacks, "
                       "stack_layer_inputs, forward; "
                       "subclass TrainableModel"),
    ("MisnamedStack", "MisnamedStack does not fit the model contract (libai_zoo.models.TrainableModel): "
                      "'layers' names no submodule")])
def test_a_model_lacking_part_of_the_contract_is_refused_naming_it(tmp_path, model, message):
    cfg = LazyConfig.apply_overrides(LazyConfig.load(CONFIG), [model_is(model), f"train.output_dir={tmp_path}"])
    with pytest.raises(TypeError) as error:
        DefaultTrainer(cfg)
    assert message in str(error.value)


def test_buffers_are_computed_by_init_buffers_or_refused(tmp_path):
    """The trainer builds on the meta device, where a buffer has no value: init_buffers gives it
    one, and a model without it is refused, naming the buffer."""
    cfg = LazyConfig.apply_overrides(LazyConfig.load(CONFIG), [
        model_is("ScaledTagger"), f"train.output_dir={tmp_path / 'scaled'}", "train.micro_batch_size=8",
        "train.global_batch_size=8"])
    trainer = DefaultTrainer(cfg)
    try:
        assert torch.equal(trainer.model.scale, torch.full((TAGS,), 0.5))
    finally:
        distributed.destroy()
    cfg = LazyConfig.apply_overrides(LazyConfig.load(CONFIG), [
        model_is("BufferedTagger"), f"train.output_dir={tmp_path / 'buffered'}"])
    with pytest.raises(TypeError, match=r"BufferedTagger holds buffers \['scale'\].*implement init_buffers"):
        DefaultTrainer(cfg)
    distributed.destroy()


def test_a_subclass_that_leaves_out_a_method_cannot_be_built():
    class NoHead(TrainableModel):
        layer_stack, first_stage_modules, last_stage_modules, loss_unit = "blocks", (), (), "token"
        embed = layer_inputs = final_norm = loss = TinyTagger.embed

    with pytest.raises(TypeError, match="abstract method.*head"):
        NoHead()
