"""The contract between a model and the engine: what a model offers so that it trains at any layout.

The trainer, the pipeline stages, the train step, evaluation, activation checkpointing, ZeRO and
the FLOPs counter read a model only through these members. Every zoo model that has a loss
implements them; so can a model of your own (subclass `TrainableModel`), and it then trains
under data, tensor and pipeline parallelism like the zoo's. How one step uses them:

    inputs, targets = model.split_batch(batch)          # targets aligned with the head's outputs
    one process or dp/tp:  model(**batch, return_logits=False).loss      (mean over the targets)
    pipeline stages:
      first stage   hidden = model.embed(inputs)
      every stage   hidden = layer(hidden, **model.layer_inputs(inputs, hidden))  for its layers of the stack
      last stage    model.head_loss(model.final_norm(hidden), targets, reduction="sum")
                    (= model.loss(model.head(hidden), ...), summed over the targets)
    two stacks      an encoder-decoder's stacks run in a row (`stacks()`): a stage that holds a later
                    stack's first layer enters it, ``hidden, carried = model.enter_stack(k, hidden,
                    carried, inputs)`` (the decoder's embedding; the encoder's output, carried on to
                    every later stage), and a stack's layers take ``model.stack_layer_inputs(k, inputs,
                    hidden, carried)``
    routed experts  stats = model.router_stats(inputs) (None without MoE layers) travels with the
                    hidden states: ``hidden, stats = layer(hidden, ..., router_stats=stats)``; the
                    last stage adds model.aux_loss(stats) per micro-batch when model.has_aux_loss
    step weighting  model.num_loss_targets(targets): how many targets the batch scores
    data check      model.input_limits(): the vocabulary and position limits the data must fit
    fresh weights   model.init_parameter(name, module, full_tensor, generator): one parameter's
                    initial value; the trainer builds the model on the meta device and draws each
                    parameter whole (then keeps this rank's part), so any layout starts alike

Under tensor parallelism the head's outputs may be split (an LM head leaves this rank's slice of
the vocabulary) and `loss` works on them as they are; `forward` gathers them for its caller.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from torch import nn

from libai_zoo.layers import Attention, LatentAttention, LayerNorm, MoE, RMSNorm

IGNORE_INDEX = -100  # a target the loss skips (transformers' convention)
LOSS_UNITS = ("token", "sample")


@dataclass(frozen=True)
class Stack:
    """One stack of repeated layers, and what a pipeline stage that runs some of its layers also
    holds. A model runs its stacks in a row (an encoder-decoder: the encoder's, then the decoder's);
    the engine reads them only through `TrainableModel.stacks`."""

    #: Dotted path of its `nn.ModuleList`: pipeline stages cut the stacks' layers, in a row, into
    #: ranges; recomputation, ZeRO-3 and compile wrap each layer.
    path: str
    #: What the stage that runs a later stack's first layer holds: what `enter_stack` runs (the
    #: encoder's final norm, the decoder's embedding); the first stack's are `first_stage_modules`.
    entry_modules: tuple[str, ...] = ()
    #: What every stage that runs one of its layers holds (a relative position bias its layers share).
    shared_modules: tuple[str, ...] = ()
    #: Tensors a stage inside it gets besides the hidden states (a decoder's: the encoder's output).
    carries: int = 0


class TrainableModel(ABC):
    """What a model offers the engine; see the module docstring for how a step uses each member.

    Also required: ``forward(**batch, return_logits=True)`` returning an output whose ``.loss``
    is the mean loss over the batch's targets (``return_logits=False``: the caller needs only the
    loss, so split logits are not gathered).
    """

    #: Dotted path of the `nn.ModuleList` of repeated layers: pipeline stages cut it into ranges,
    #: activation checkpointing, ZeRO-3 and torch.compile wrap each of its layers.
    layer_stack: str
    #: Dotted paths of the modules only the first pipeline stage holds (embeddings) ...
    first_stage_modules: tuple[str, ...]
    #: ... and only the last one (final norm, head). A parameter shared between the two (a tied
    #: embedding and LM head) is kept in sync between the end stages.
    last_stage_modules: tuple[str, ...]
    #: The batch key the first stage embeds (transformers' name): "input_ids", "pixel_values".
    main_input_name: str = "input_ids"
    #: What the loss averages over: "token" (language models; evaluation reports perplexity) or
    #: "sample" (classifiers; evaluation reports accuracy).
    loss_unit: str
    #: Whether ``forward``'s loss includes auxiliary terms computed from router statistics (a
    #: Mixture of Experts' load-balancing loss when its config's ``output_router_logits`` is on, as
    #: transformers' switch); False for a model without them.
    has_aux_loss: bool = False

    def split_batch(self, batch: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """(model inputs, targets aligned with the head's outputs): here the batch's "labels" (as
        transformers names them) and everything else; a causal LM shifts its labels here instead,
        the one place the next-token shift is made."""
        return {key: value for key, value in batch.items() if key != "labels"}, batch["labels"]

    @abstractmethod
    def embed(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """First stage: the model inputs -> the hidden states the first layer takes."""

    @abstractmethod
    def layer_inputs(self, inputs: dict[str, torch.Tensor], hidden: torch.Tensor | None = None) -> dict:
        """The keyword arguments every layer of the stack takes besides the hidden states (e.g. the
        attention mask), from the model inputs and `hidden`, the hidden states entering this
        stage's stack (for a model that makes them from their shape and dtype, as a transformers
        body makes its masks); every pipeline stage computes them."""

    @abstractmethod
    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """Last stage: the last layer's output -> what the head takes."""

    @abstractmethod
    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Last stage: the head's outputs (logits; split over the vocabulary under tp)."""

    @abstractmethod
    def loss(self, outputs: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        """The loss of the head's outputs against the targets, in float32: "mean" over the targets,
        or "sum" (the mean times `num_loss_targets`, so micro-batches add up without dividing)."""

    def head_loss(self, hidden: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        """``loss(head(hidden), targets, reduction)``; a model with a large head overrides it to
        never hold all of the head's outputs (a causal LM computes it in chunks of tokens)."""
        return self.loss(self.head(hidden), targets, reduction)

    def pipeline_problems(self) -> list[str]:
        """Why this model cannot be cut into pipeline stages ([] when it can: default)."""
        return []

    def layout_problems(self, *, sequence_parallel: bool, cp: int, ep: int) -> list[str]:
        """Why this model cannot run with sequence parallelism, at this cp or this ep ([] when it
        can: default; the layers' own limits are asked of them, `cp_problems`, `expert_problems`)."""
        return []

    def stacks(self) -> tuple[Stack, ...]:
        """The model's stacks of layers in the order they run: `layer_stack` alone (default); an
        encoder-decoder gives the encoder's (its `layer_stack`) and then the decoder's. A parameter
        that several stages hold (an embedding shared by the encoder, the decoder and the head; a
        stack's position bias) is kept in sync between them."""
        return (Stack(self.layer_stack),)

    def enter_stack(self, index: int, hidden: torch.Tensor, carried: tuple[torch.Tensor, ...],
                    inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """The hidden states and carried tensors stack `index` (> 0) starts from, given the previous
        stack's last hidden states and carried tensors (an encoder-decoder: the decoder's embedded
        inputs, and the encoder's normalised output, which every later stage receives)."""
        raise NotImplementedError(f"{type(self).__name__} runs one stack of layers; a model whose stacks() gives more "
                                  f"implements enter_stack for the later ones")

    def stack_layer_inputs(self, index: int, inputs: dict[str, torch.Tensor], hidden: torch.Tensor,
                           carried: tuple[torch.Tensor, ...]) -> dict:
        """The keyword arguments every layer of stack `index` takes (`layer_inputs` for the first
        stack, by default); `carried` are the tensors `enter_stack` gave the stack."""
        return self.layer_inputs(inputs, hidden)

    def router_stats(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """First stage: the tensor the stack's Mixture-of-Experts layers add their routing statistics
        to (each layer then returns ``(hidden, stats)``), from the model inputs; None for a model
        without such layers (default)."""
        return None

    def aux_loss(self, stats: torch.Tensor) -> torch.Tensor:
        """The auxiliary terms (weighted) of one micro-batch's loss from the router statistics of all
        the stack's layers: what ``forward``'s loss adds to the loss over the targets, whose output
        then carries the statistics as ``router_stats``; the last pipeline stage adds it itself."""
        raise NotImplementedError(f"{type(self).__name__} has no Mixture-of-Experts layers: router_stats is None")

    def init_parameter(self, name: str, module: nn.Module, tensor: torch.Tensor,
                       generator: torch.Generator | None) -> None:
        """Fill `tensor` with the initial value of parameter `name` (dotted, of the whole model),
        held by `module`, drawing from `generator` (None: the global RNG). `tensor` is the whole
        parameter, never a shard. Default: norm weights 1, biases 0, other weights Normal(0, 0.02)."""
        if name.endswith("bias"):
            tensor.zero_()
        elif isinstance(module, LayerNorm | RMSNorm | nn.LayerNorm | nn.RMSNorm):
            tensor.fill_(1.0)
        else:
            tensor.normal_(0.0, 0.02, generator=generator)

    def init_buffers(self) -> None:
        """Give the buffers their values once the trainer has allocated a model built on the meta
        device (where they had none). Default: the layers that hold buffers set them (their own
        ``init_buffers``: an MoE router's selection bias starts at 0, a checkpoint then fills it);
        the model must hold no other buffer (the zoo's compute rotary tables and masks in forward);
        a model that registers buffers computes them here."""
        owners = [m for m in self.modules() if m is not self and callable(getattr(m, "init_buffers", None))]
        for owner in owners:
            owner.init_buffers()
        owned = {id(b) for owner in owners for b in owner.buffers()}
        buffers = [name for name, b in self.named_buffers() if id(b) not in owned]
        if buffers:
            raise TypeError(f"{type(self).__name__} holds buffers {buffers}, which a model built on the meta device "
                            f"has no values for: implement init_buffers() to compute them, or compute them in "
                            f"forward")

    def input_limits(self) -> dict[str, int | None]:
        """The inputs the model's tables can take, for checking the data before the first step
        (`libai_zoo.data.check_dataset(dataset, **model.input_limits())`): "vocab_size", the token ids
        its embedding holds, and "max_positions", the longest sequence its learned position
        embeddings hold; None where there is no such limit. Default: the config's vocab_size and
        max_position_embeddings (GPT-2's n_positions) for a model that embeds input_ids, none for
        others (images); a model whose positions are computed (rotary) returns max_positions None."""
        if self.main_input_name != "input_ids":
            return {"vocab_size": None, "max_positions": None}
        config = getattr(self, "config", None)
        return {"vocab_size": getattr(config, "vocab_size", None),
                "max_positions": getattr(config, "max_position_embeddings", None)}

    def num_loss_targets(self, targets: torch.Tensor) -> torch.Tensor:
        """How many targets a batch scores: its targets that are not IGNORE_INDEX (tokens), or its
        samples."""
        if self.loss_unit == "token":
            return (targets != IGNORE_INDEX).sum()
        return torch.tensor(targets.shape[0])

    def looked_up_parameters(self) -> list[nn.Parameter]:
        """The tables only looked up, which multiply nothing: by default the first stage's embeddings
        that are not also the head's (a tied head multiplies)."""
        last = {id(p) for path in self.last_stage_modules for p in self.get_submodule(path).parameters()}
        return [p for path in self.first_stage_modules for m in self.get_submodule(path).modules()
                if isinstance(m, nn.Embedding) for p in m.parameters(recurse=False) if id(p) not in last]

    def flops_per_token(self, seq_len: int) -> float:
        """FLOPs of one token of a training step (forward + backward = 3 × forward), PaLM's MFU
        convention: 6 × the parameters every token multiplies (all but the embedding tables that
        are only looked up; a head tied to a table multiplies; of a Mixture of Experts' routed
        experts only the top_k a token goes through) + 12 × the attention width of every layer ×
        seq_len (scores and values; causal kernels skip half, MFU counts them all).
        Recomputation by activation checkpointing is not useful work and is not counted."""
        looked_up = {id(p) for p in self.looked_up_parameters()}
        share = {id(p): moe.top_k / moe.num_experts for moe in self.modules() if isinstance(moe, MoE)
                 for p in moe.experts.parameters()}
        multiplied = sum(p.numel() * share.get(id(p), 1.0) for p in self.parameters() if id(p) not in looked_up)
        attention = sum(12 * m.attention_width * seq_len for layer in all_layers(self) for m in layer.modules()
                        if isinstance(m, (Attention, LatentAttention)))
        return 6 * multiplied + attention


def get_layer_stack(model: nn.Module) -> nn.ModuleList:
    """The model's (first) stack of repeated layers (all of them, or a pipeline stage's)."""
    return model.get_submodule(model.layer_stack)


def all_layers(model: nn.Module) -> list[nn.Module]:
    """Every layer of the model's stacks, in the order they run (of a pipeline stage: its layers)."""
    return [layer for stack in model.stacks() for layer in model.get_submodule(stack.path)]


def check_trainable(model: nn.Module) -> None:
    """Raise a TypeError naming every member of the contract `model` lacks (or gets wrong)."""
    name = type(model).__name__
    missing = [member for member in ("layer_stack", "first_stage_modules", "last_stage_modules", "loss_unit",
                                     "main_input_name") if not hasattr(model, member)]
    methods = sorted(TrainableModel.__abstractmethods__) + ["split_batch", "head_loss", "num_loss_targets",
                                                           "flops_per_token", "init_parameter", "input_limits",
                                                           "pipeline_problems", "layout_problems", "stacks",
                                                           "stack_layer_inputs"]
    missing += [member for member in methods if not callable(getattr(model, member, None))]
    if not isinstance(model, nn.Module):
        missing.insert(0, "nn.Module as a base class")
    elif type(model).forward is nn.Module.forward:
        missing.append("forward")
    if missing:
        raise TypeError(f"{name} does not implement the model contract (libai_zoo.models.TrainableModel): it "
                        f"lacks {', '.join(missing)}; subclass TrainableModel and implement them (see "
                        f"docs/design.md, 'The model contract')")
    wrong = []
    if model.loss_unit not in LOSS_UNITS:
        wrong.append(f"loss_unit = {model.loss_unit!r} is not one of {LOSS_UNITS}")
    stacks = model.stacks()
    if stacks[0].path != model.layer_stack:
        wrong.append(f"the first of stacks() is {stacks[0].path!r}, not layer_stack {model.layer_stack!r}")
    if len(stacks) > 1 and getattr(type(model).enter_stack, "__func__", type(model).enter_stack) \
            is TrainableModel.enter_stack:
        wrong.append(f"stacks() gives {len(stacks)} stacks: implement enter_stack(index, hidden, carried, inputs), "
                     f"what the stage starting a later stack runs")
    stack_modules = [path for stack in stacks for path in (*stack.entry_modules, *stack.shared_modules)]
    for path in (*(stack.path for stack in stacks), *model.first_stage_modules, *model.last_stage_modules,
                 *stack_modules):
        try:
            model.get_submodule(path)
        except AttributeError:
            wrong.append(f"{path!r} names no submodule")
    for stack in stacks if not wrong else ():
        if not isinstance(model.get_submodule(stack.path), nn.ModuleList):
            wrong.append(f"layer stack {stack.path!r} is a {type(model.get_submodule(stack.path)).__name__}, not "
                         f"an nn.ModuleList")
    if wrong:
        raise TypeError(f"{name} does not fit the model contract (libai_zoo.models.TrainableModel): "
                        + "; ".join(wrong))
