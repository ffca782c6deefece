"""Any transformers model, trainable: the model contract (contract.py) implemented from what
transformers declares about a model, with no per-family code.

    model = trainable(transformers.AutoModelForCausalLM.from_config(StableLmConfig(...)))
    model = libai_zoo.models.AutoModelForCausalLM.from_pretrained("falcon_dir")   # the same door

`trainable` keeps transformers' own class, its code and its parameter names (so its
``save_pretrained`` directories and PEFT's module names stay valid): the instance's class becomes a
subclass of it that adds the contract, under the same name. What the engine needs it reads off the
model:

- ``_pp_plan`` (transformers' ``base_model_pp_plan``): the embedding, the layer stack and the
  final norm, in order; without one, the layer stack is found (the ModuleList of the
  ``_no_split_modules`` blocks, else the largest ModuleList) and pipelines are refused;
- ``_tp_plan``: which linear layers split by column or by row (`transformers_tp_plan.py`);
- ``_no_split_modules``: the blocks ZeRO-3 and recomputation wrap are the stack's layers;
- tied weights stay one parameter (and under pp one copy per end stage, kept in sync).

A step in one process or under dp/tp runs transformers' own forward (``use_cache=False`` in
training), the loss computed here over the targets (a causal LM's labels shifted once, by
`split_batch`; under tp the vocabulary-parallel cross entropy on the LM head's slice of the
logits). A pipeline stage calls the model's own layers, each with exactly the arguments the body
passes it: the body's forward runs with recorders in place of its layers (`capture`), so rotary
tables, masks (per layer type), ALiBi and position ids are computed on every stage as the body
computes them; `embed` is what the body hands its first layer, `head` is the task model's
forward on given hidden states (its logit scaling and soft-caps included).
"""

from __future__ import annotations

import inspect
import math
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from torch import nn
from transformers import PretrainedConfig
from transformers.loss.loss_utils import ForSequenceClassificationLoss
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.models.auto import modeling_auto

from libai_zoo.config import ConfigError, instantiate
from libai_zoo.hf.loading import PretrainedSource, checkpoint_tensors, resolve_dtype
from libai_zoo.hf.rules import Either, Joined, Rule, Same, Stacked, WeightMap
from libai_zoo.layers import LMHead
from libai_zoo.utils.transformers_versions import conversion_mapping

from .causal_lm import TARGET_KEYS, CausalLM
from .contract import IGNORE_INDEX, TrainableModel
from .transformers_tp_plan import apply_tp_plan, name_pattern, tp_plan_problems

#: How transformers names a task model's class -> the task (and the contract's loss unit).
TASKS = {"ForCausalLM": "causal_lm", "LMHeadModel": "causal_lm", "ForMaskedLM": "masked_lm",
         "ForSequenceClassification": "sequence_classification",
         "ForImageClassification": "image_classification"}
LOSS_UNITS = {"causal_lm": "token", "masked_lm": "token", "sequence_classification": "sample",
              "image_classification": "sample"}
#: The keyword under which a layer of the stack receives its recorded arguments (`layer_inputs`).
STACK_INPUTS = "stack_inputs"


#: The transformers auto mapping (model type -> class name) of each task.
AUTO_MAPPINGS = {"causal_lm": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "masked_lm": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
                 "sequence_classification": "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
                 "image_classification": "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES"}
#: The transformers Auto class of each task.
TRANSFORMERS_AUTO = {"causal_lm": "AutoModelForCausalLM", "masked_lm": "AutoModelForMaskedLM",
                     "sequence_classification": "AutoModelForSequenceClassification",
                     "image_classification": "AutoModelForImageClassification", "base": "AutoModel"}


def task_of(cls: type) -> str | None:
    """The task of a transformers class: the auto mapping that lists it (a causal LM may be named
    otherwise: BertGenerationDecoder), else what its name says (None: a bare body or a task the
    trainer lacks)."""
    for task, mapping in AUTO_MAPPINGS.items():
        if cls.__name__ in getattr(modeling_auto, mapping).values():
            return task
    return next((task for suffix, task in TASKS.items() if cls.__name__.endswith(suffix)), None)


def _transformers_base() -> type | None:
    """transformers' PreTrainedModel, if any transformers model can exist yet (importing it loads
    PyTorch's distributed checkpointing, which `import libai_zoo.models` does not)."""
    modeling = sys.modules.get("transformers.modeling_utils")
    return None if modeling is None else modeling.PreTrainedModel


def is_transformers_model(model: object) -> bool:
    """A transformers model not yet made trainable."""
    base = _transformers_base()
    return base is not None and isinstance(model, base) and not isinstance(model, TransformersModel)


def trainable(model: nn.Module, task: str | None = None) -> nn.Module:
    """`model` implementing the model contract: a transformers task model made trainable in place
    (its class swapped for a subclass with the contract); a model that implements it already is
    returned as it is. ``task``: what the model is trained for (default: `task_of` its class; a
    class listed for two tasks, such as XLM's LM head, is the Auto class's). Refused with the reason:
    a bare body or a task the trainer has no loss for, a model whose layer stack cannot be found, a
    child module named as a member of the contract."""
    if not is_transformers_model(model):
        return model
    task = task or task_of(type(model))
    if task is None:
        raise ConfigError(f"{type(model).__name__} is not a task model the trainer trains (one of "
                          f"{', '.join('*' + s for s in TASKS)}): load it with the Auto class of its task, e.g. "
                          f"transformers.AutoModelForCausalLM")
    taken = sorted((set(model._modules) | set(model._parameters) | set(model._buffers)) & CONTRACT_NAMES)
    if taken:
        raise ConfigError(f"{type(model).__name__} holds {', '.join(taken)}, which the model contract names otherwise "
                          f"({', '.join(f'{name}()' for name in taken)}): it cannot be made trainable as it is")
    model.__class__ = _trainable_class(type(model))
    model._adapt(task)
    return model


def transformers_from_config(task: str, config: PretrainedConfig, *, trust_remote_code: bool = False) -> nn.Module:
    """transformers' own model of `config` for `task`, made trainable (a bare body as it is)."""
    auto = getattr(transformers, TRANSFORMERS_AUTO[task])
    model = auto.from_config(config, trust_remote_code=trust_remote_code)
    return model if task == "base" else trainable(model, task)


def transformers_from_pretrained(task: str, path: str | Path, *, dtype: torch.dtype | str | None = None,
                                 strict: bool = True, trust_remote_code: bool = False, **config_overrides) -> nn.Module:
    """transformers' own model of the directory `path` for `task`, made trainable. Under
    ``torch.device("meta")`` (the trainer) only config.json is read: the model remembers the
    directory, and each rank reads its part once the model is split (`parallel.materialize`).
    ``trust_remote_code``: a model whose code is not in transformers loads only when asked, as in
    transformers."""
    config = transformers.AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code, **config_overrides)
    if torch.get_default_device().type == "meta":
        model = transformers_from_config(task, config, trust_remote_code=trust_remote_code)
        for param in model.parameters():  # the buffers keep their own dtype (float32 rotary frequencies)
            param.data = param.data.to(resolve_dtype(dtype, config))
        model.pretrained_source = PretrainedSource(Path(path), strict)
        return model.eval()
    auto = getattr(transformers, TRANSFORMERS_AUTO[task])
    model = auto.from_pretrained(path, config=config, dtype=dtype or "auto", trust_remote_code=trust_remote_code)
    return model if task == "base" else trainable(model, task)


def instantiate_model(model_cfg) -> nn.Module:
    """A config's ``model`` built (under the caller's device: the meta device to plan or train) and
    made trainable: what every builder of a run's model calls."""
    return trainable(instantiate(model_cfg))


_CLASSES: dict[type, type] = {}
#: What `TransformersModel` adds to a model's class: a child module of one of these names would be hidden.
CONTRACT_NAMES = {"embed", "head", "loss", "final_norm", "layer_inputs", "head_loss", "split_batch", "capture",
                  "layer_stack", "first_stage_modules", "last_stage_modules", "final_modules", "task", "loss_unit"}


def _trainable_class(cls: type) -> type:
    """The subclass of transformers' `cls` that adds the contract (one per class, same name):
    `TransformersModel`'s members override transformers' (its forward), the contract's defaults
    come after them (an instance's class can only become a subclass that keeps its layout first)."""
    if cls not in _CLASSES:
        members = {key: value for key, value in vars(TransformersModel).items() if not key.startswith("__")}
        _CLASSES[cls] = type(cls.__name__, (cls, TransformersModel),
                             {**members, "__module__": cls.__module__, "__qualname__": cls.__qualname__,
                              "transformers_class": cls})
    return _CLASSES[cls]


class _Stop(Exception):
    """Raised by a recorder to end the body's forward once what was asked is recorded."""

    def __init__(self, hidden: torch.Tensor):
        super().__init__("stack capture")
        self.hidden = hidden


class StackCall:
    """The arguments the body passed each layer of its stack (by index in the whole model), besides
    the hidden states: what `layer_inputs` hands every layer of a stage."""

    def __init__(self, calls: dict[int, tuple[tuple, dict]]):
        self.calls = calls

    def of(self, index: int) -> tuple[tuple, dict]:
        return self.calls[index]


class _Recorder(nn.Module):
    """Stands in for layer `index` while the body runs: records its arguments and returns the
    hidden states it got (the layer's own plain attributes, such as an attention type, are read
    from a snapshot, so a stage can record the layers it does not hold)."""

    def __init__(self, index: int, attributes: dict, calls: dict, stop: int):
        super().__init__()
        self.__dict__.update(attributes)
        self.index, self.calls, self.stop = index, calls, stop

    def forward(self, *args, **kwargs):
        if args:
            hidden, args = args[0], args[1:]
        else:
            hidden = kwargs.pop("hidden_states")
        self.calls[self.index] = (args, kwargs)
        if self.index == self.stop:
            raise _Stop(hidden)
        return hidden


class _BodyOutput(BaseModelOutputWithPast):
    """A body's output holding only its last hidden states: any other field a task model reads
    (an MoE's router logits, a cache) is None."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return None


class _GivenOutput(nn.Module):
    """Stands in for the body while the task model's forward runs on hidden states already made
    (`head`): returns them as the body's output."""

    def __init__(self, hidden: torch.Tensor):
        super().__init__()
        self.hidden = hidden

    def forward(self, *args, **kwargs) -> BaseModelOutputWithPast:
        return _BodyOutput(last_hidden_state=self.hidden)


def _shell(module: nn.Module, keep: dict[int, torch.Tensor]) -> nn.Module:
    """A copy of `module`'s tree for transformers' `_init_weights` to write into: each parameter
    and buffer is its replacement in `keep` (by the original's id) or an empty meta tensor of its
    shape, so nothing else is written (a shard, an FSDP-managed tensor) and no memory is taken."""
    shell = object.__new__(type(module))  # not copy.copy: FSDP's module classes construct anew in __new__
    shell.__dict__.update(module.__dict__)
    for table in ("_parameters", "_buffers"):
        setattr(shell, table, {key: None if t is None else keep.get(id(t), torch.empty(t.shape, dtype=t.dtype,
                                                                                     device="meta"))
                               for key, t in getattr(module, table).items()})
    shell._modules = {key: None if child is None else _shell(child, keep) for key, child in module._modules.items()}
    return shell


def _plain_attributes(module: nn.Module) -> dict:
    """A layer's own plain attributes (an attention type, a layer index) a body may read off it."""
    return {key: value for key, value in vars(module).items()
            if not key.startswith("_") and isinstance(value, (bool, int, float, str, type(None), tuple))}


def _stack_call(module: nn.Module, args: tuple, kwargs: dict):
    """Forward pre-hook of a stack layer: a layer called with ``stack_inputs`` (`layer_inputs`)
    gets the arguments the body gave it, after the hidden states."""
    if STACK_INPUTS not in kwargs:
        return None
    recorded_args, recorded_kwargs = kwargs[STACK_INPUTS].of(module.stack_index)
    module._returns_hidden = True
    return (args[0], *recorded_args), dict(recorded_kwargs)


def _stack_return(module: nn.Module, args: tuple, kwargs: dict, output):
    """Forward hook of a stack layer: under `layer_inputs` a layer returns its hidden states only
    (older layers return a tuple)."""
    if module.__dict__.pop("_returns_hidden", False) and isinstance(output, tuple):
        return output[0]
    return None


class TransformersModel(TrainableModel):
    """The contract on a transformers task model (mixed into its class by `trainable`)."""

    #: The transformers class this model's class was made from (set on each made class).
    transformers_class: type

    # ------------------------------------------------------------------ structure, from the plans
    def _adapt(self, task: str) -> None:
        self.task, self.loss_unit = task, LOSS_UNITS[task]
        body_prefix = self.base_model_prefix
        body = self.base_model
        plan = [key for key in getattr(body, "_pp_plan", None) or {} if _has_submodule(body, key)]
        stack = next((key for key in plan if isinstance(body.get_submodule(key), nn.ModuleList)), None)
        self.has_pp_plan = stack is not None  # a plan naming no ModuleList cuts nothing
        if stack is None:
            stack = _find_stack(body, set(getattr(self, "_no_split_modules", None) or ()))
        if stack is None:
            raise ConfigError(f"{type(self).__name__} has no layer stack libai_zoo can find: it declares no "
                              f"base_model_pp_plan and holds no nn.ModuleList of repeated blocks")
        prefix = f"{body_prefix}." if body is not self else ""
        self.layer_stack = prefix + stack
        heads = [name for name, child in self.named_children() if child is not body]
        if self.has_pp_plan:  # the plan's order: what comes before the stack, the stack, what comes after
            self.first_stage_modules = tuple(prefix + key for key in plan[:plan.index(stack)])
            self.final_modules = tuple(prefix + key for key in plan[plan.index(stack) + 1:])
        else:  # no pipeline: the tables only the embedding looks up (flops_per_token leaves them out)
            inside = {id(m) for m in body.get_submodule(stack).modules()}
            self.first_stage_modules = tuple(prefix + name for name, module in body.named_modules()
                                             if isinstance(module, nn.Embedding) and id(module) not in inside)
            self.final_modules = ()
        self.last_stage_modules = (*self.final_modules, *heads)
        layers = self.get_submodule(self.layer_stack)
        self.num_stack_layers = len(layers)
        self.layer_attributes = [_plain_attributes(layer) for layer in layers]
        for index, layer in enumerate(layers):
            layer.stack_index = index
            layer.register_forward_pre_hook(_stack_call, with_kwargs=True)
            layer.register_forward_hook(_stack_return, with_kwargs=True)
        self.body_takes_cache = "use_cache" in inspect.signature(body.forward).parameters
        self.tp_split = apply_tp_plan(self)

    def describe(self) -> str:
        """What this model's declarations allow, in one line."""
        split = f"from its tp plan ({len(self.tp_split)} modules split)" if self.tp_split else "no (no tp plan)"
        return (f"layer stack {self.layer_stack} ({self.num_stack_layers} layers); data parallelism and ZeRO 0-3; "
                f"tensor parallelism {split}; "
                f"pipeline parallelism {'from its pp plan' if self.has_pp_plan else 'no (no pp plan)'}")

    # ------------------------------------------------------------------ refusals, before any step
    def tp_problems(self, tp_size: int) -> list[str]:
        """Why this model cannot be split over `tp_size` ranks ([] when it can)."""
        return tp_plan_problems(self, tp_size)

    def layout_problems(self, *, sequence_parallel: bool, cp: int, ep: int) -> list[str]:
        """Only the zoo's own layers split over sequence, context and experts (transformers'
        attention and MoE layers know no such split): each asked for is refused with the way out."""
        name = type(self).__name__
        problems = []
        if sequence_parallel:
            problems.append(f"sequence parallelism splits the zoo's own layers' activations; {name}'s norms and "
                            f"attention run on whole sequences: set dist.sequence_parallel=false")
        if cp > 1:
            problems.append(f"context parallelism exchanges keys and values in the zoo's attention layers, not "
                            f"{name}'s: set dist.cp=1")
        if ep > 1:
            problems.append(f"expert parallelism splits the zoo's MoE layers, not {name}'s experts (kept whole on "
                            f"every rank, trained with data parallelism and ZeRO): set dist.ep=1")
        return problems

    def pipeline_problems(self) -> list[str]:
        """Why this model cannot be cut into pipeline stages ([] when it can)."""
        problems = []
        if not self.has_pp_plan:
            problems.append(f"{type(self).__name__} declares no pipeline plan (base_model_pp_plan) naming its "
                            f"embedding, layer stack and final norm: train it with dist.pp=1")
        if self.task != "causal_lm":
            problems.append(f"a pipeline of a transformers {self.task} model is not supported: train it with "
                            f"dist.pp=1")
        if getattr(self.config, "output_router_logits", False):
            problems.append(f"{type(self).__name__}'s router loss is computed by its forward from every layer's "
                            f"router logits, which a pipeline's stages do not pass on: train it with dist.pp=1 "
                            f"(or set output_router_logits=False)")
        return problems

    # ------------------------------------------------------------------ a step without pipeline
    def split_batch(self, batch: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        inputs = {key: value for key, value in batch.items() if key not in TARGET_KEYS}
        return inputs, self._targets(batch.get("labels"), batch.get("shift_labels"))

    def _targets(self, labels: torch.Tensor | None, shift_labels: torch.Tensor | None) -> torch.Tensor | None:
        """A causal LM's next-token targets (`CausalLM.targets`), another task's labels as they are."""
        return CausalLM.targets(labels, shift_labels) if self.task == "causal_lm" else labels

    def forward(self, *args, labels: torch.Tensor | None = None, shift_labels: torch.Tensor | None = None,
                return_logits: bool = True, **kwargs):
        """transformers' forward (no KV cache in training), the loss over the targets computed here
        (`loss`) plus, in training, the auxiliary loss the model's forward returns (a MoE's router
        loss, times its coefficient); ``return_logits=False`` leaves split logits ungathered."""
        if self.training:
            kwargs.setdefault("use_cache", False)
        output = self.transformers_class.forward(self, *args, **kwargs)
        targets = self._targets(labels, shift_labels)
        logits = output.logits
        if targets is not None:
            loss = self.loss(logits, targets)
            aux = getattr(output, "aux_loss", None)
            if aux is not None and self.training:  # evaluation reports the loss over the targets alone
                loss = loss + self._aux_coefficient() * aux.to(loss.device)
            output.loss = loss
        head = self._lm_head()
        output.logits = (head.gather(logits) if head is not None else logits) if return_logits else None
        return output

    def _aux_coefficient(self) -> float:
        """The weight transformers' forward gives the router loss it returns: the model's own
        attribute, as its forward reads it (DBRX sets it from its ffn config), else the config's
        (JetMoe names it aux_loss_coef)."""
        for owner in (self, self.config):
            for name in ("router_aux_loss_coef", "aux_loss_coef"):
                value = owner.__dict__.get(name) if owner is self else getattr(owner, name, None)
                if value is not None:
                    return float(value)
        return 0.0

    def _lm_head(self) -> LMHead | None:
        head = self.get_output_embeddings() if self.task in ("causal_lm", "masked_lm") else None
        return head if isinstance(head, LMHead) else None

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        head = self._lm_head()
        if head is not None:
            return head.loss(outputs, targets, reduction)
        if self.loss_unit == "token":
            return F.cross_entropy(outputs.float().flatten(0, -2), targets.flatten().to(outputs.device),
                                   ignore_index=IGNORE_INDEX, reduction=reduction)
        loss = ForSequenceClassificationLoss(targets.to(outputs.device), outputs.float(), self.config)
        return loss * targets.shape[0] if reduction == "sum" else loss

    # ------------------------------------------------------------------ pipeline stages: the body's calls
    def _body_owner(self) -> tuple[nn.Module, str]:
        owner, _, name = self.layer_stack.rpartition(".")
        return self.get_submodule(owner), name

    @contextmanager
    def _recording(self, calls: dict, stop: int) -> Iterator[None]:
        """Recorders in place of the stack's layers; on a stage without the first modules, identities
        in their place (the body still runs what the pp plan puts before the stack, such as an
        embedding dropout, on the embeddings it is given)."""
        owner, name = self._body_owner()
        swapped = [(owner, name, nn.ModuleList(_Recorder(i, self.layer_attributes[i], calls, stop)
                                               for i in range(self.num_stack_layers)))]
        for path in self.first_stage_modules:
            parent, _, attribute = path.rpartition(".")
            parent = self.get_submodule(parent)
            if parent._modules.get(attribute, False) is None:
                swapped.append((parent, attribute, nn.Identity()))
        held = [module._modules[key] for module, key, _ in swapped]
        for module, key, stand_in in swapped:
            module._modules[key] = stand_in
        try:
            yield
        finally:
            for (module, key, _), original in zip(swapped, held):
                module._modules[key] = original

    def capture(self, inputs: dict[str, torch.Tensor], *, hidden: torch.Tensor | None = None,
                stop: int | None = None) -> tuple[torch.Tensor, StackCall]:
        """Run the body's forward with recorders for its layers, on the model inputs (from the main
        input, or from `hidden` as the embeddings), until layer `stop` (default: the last) is
        called: (the hidden states handed to it, every layer's recorded arguments)."""
        kwargs = {key: value for key, value in inputs.items() if key != self.main_input_name}
        if hidden is not None:
            kwargs["inputs_embeds"] = hidden
        else:
            kwargs[self.main_input_name] = inputs[self.main_input_name]
        if self.body_takes_cache:
            kwargs["use_cache"] = False
        calls: dict[int, tuple[tuple, dict]] = {}
        stop = self.num_stack_layers - 1 if stop is None else stop
        with self._recording(calls, stop):
            try:
                self.base_model(**kwargs)
            except _Stop as stopped:
                return stopped.hidden, StackCall(calls)
        raise RuntimeError(f"{type(self).__name__}'s body returned without calling layer {stop} of "
                           f"{self.layer_stack}: its layer stack is not what its forward runs")

    def embed(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """What the body hands its first layer (embeddings, their scaling, positions, norm)."""
        return self.capture(inputs, stop=0)[0]

    def layer_inputs(self, inputs: dict[str, torch.Tensor], hidden: torch.Tensor | None = None) -> dict:
        """Every layer's arguments as the body makes them from the inputs and `hidden` (the
        hidden states entering the stack: their shape and dtype)."""
        if hidden is None:
            raise ValueError(f"{type(self).__name__}.layer_inputs needs the hidden states entering the stack")
        return {STACK_INPUTS: self.capture(inputs, hidden=hidden.detach())[1]}

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        if not self.has_pp_plan:
            raise ConfigError(self.pipeline_problems()[0])
        for path in self.final_modules:
            hidden = self.get_submodule(path)(hidden)
        return hidden

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The task model's forward on hidden states the body already made: its head, logit
        scaling and soft-caps (this rank's vocabulary slice under tp)."""
        prefix = self.base_model_prefix
        body = self._modules[prefix]
        self._modules[prefix] = _GivenOutput(hidden)
        try:
            return self.transformers_class.forward(self, inputs_embeds=hidden, use_cache=False).logits
        finally:
            self._modules[prefix] = body

    # ------------------------------------------------------------------ weights
    def _initialised_by(self, path: str) -> tuple[nn.Module, list[nn.Module]]:
        """(the transformers model whose `_init_weights` initialises the module at `path`, that
        module and its ancestors below the model, children first as transformers applies it;
        containers such as the layer stack's ModuleList, which no `_init_weights` knows, left out)."""
        chain = []
        while not isinstance(module := self.get_submodule(path), _transformers_base()):
            if not isinstance(module, (nn.ModuleList, nn.ModuleDict)):
                chain.append(module)
            path = path.rpartition(".")[0]
        return module, chain or [module]

    def init_parameter(self, name: str, module: nn.Module, tensor: torch.Tensor,
                       generator: torch.Generator | None) -> None:
        """The model's own initialisation, drawn from `generator`'s seed into `tensor` (the whole
        parameter, on the CPU): transformers' `_init_weights` applied, as transformers applies it
        (children first), to the parameter's module and each of its ancestors below the model, each
        on a `_shell` where this parameter is `tensor` and every other one a meta placeholder (an
        ancestor may set a child's parameter: a Mamba mixer its dt_proj's bias). The contract's
        default where none of them sets it."""
        path, _, attribute = name.rpartition(".")
        value = nn.Parameter(tensor.fill_(math.nan), requires_grad=False) if tensor.is_floating_point() else tensor
        param = module._parameters[attribute]
        owner, chain = self._initialised_by(path)
        with torch.random.fork_rng(devices=[]):
            if generator is not None:
                torch.default_generator.manual_seed(generator.initial_seed())  # the CPU's: the tensor is there
            for ancestor in chain:
                owner._init_weights(_shell(ancestor, {id(param): value}))
        if tensor.is_floating_point() and torch.isnan(tensor).any():
            super().init_parameter(name, module, tensor, generator)

    @torch.no_grad()
    def init_buffers(self) -> None:
        """Buffers a meta build leaves empty (rotary inv_freq, masks, position ids, an xIELU
        activation's beta), as the model's own ``__init__`` computes them: the model built again
        with its parameters on the meta device and its buffers real (accelerate's
        `init_empty_weights`, buffers included), then, as transformers fills them after its own meta
        build, each holder's `_init_weights` on a `_shell` holding its real buffers (the parameters
        are drawn or loaded afterwards). A checkpoint then loads the persistent ones it holds."""
        from accelerate import init_empty_weights  # seconds to import: paid by a model being trained only

        with init_empty_weights(include_buffers=False):
            fresh = dict(self.transformers_class(self.config).named_buffers())
        for name, buffer in list(self.named_buffers()):
            if name in fresh and fresh[name].shape == buffer.shape:
                owner, _, attribute = name.rpartition(".")
                self.get_submodule(owner)._buffers[attribute] = fresh[name].to(buffer.device)
        for path, module in self.named_modules():
            buffers = {id(b): b for b in module._buffers.values() if b is not None}
            if buffers:
                self._initialised_by(path)[0]._init_weights(_shell(module, buffers))

    def hf_weight_map(self) -> WeightMap:
        """transformers' names are the model's own: every tensor maps to itself, except the
        tensors transformers fuses on load (`stacked_experts`), read from either form."""
        tied = tuple((getattr(self, "all_tied_weights_keys", None) or {}).keys())
        ignored = tuple(getattr(self, "_keys_to_ignore_on_load_unexpected", None) or ())
        tensors = checkpoint_tensors(self)
        fused = stacked_experts(self.config.model_type, {name: t.shape for name, t in tensors.items()})
        return WeightMap([Either(fused[name], Same(name, name)) if name in fused else Same(name, name)
                          for name in tensors],
                         ignore=tuple(name.replace(".", r"\.") for name in tied) + ignored)

    def input_limits(self) -> dict[str, int | None]:
        limits = super().input_limits()
        if limits["max_positions"] is not None and not any(
                isinstance(m, nn.Embedding) and m.num_embeddings == limits["max_positions"]
                for path in self.first_stage_modules for m in self.get_submodule(path).modules()):
            limits["max_positions"] = None  # computed positions (rotary, ALiBi): no table to overrun
        return limits

    def flops_per_token(self, seq_len: int) -> float:
        """PaLM's count (contract.py): 6 × the multiplied parameters (the looked-up tables aside)
        + 12 × attention width × seq_len per layer that holds an attention module. A transformers
        MoE's routing is not read: all its experts count, so its MFU is an upper bound."""
        last = {id(p) for path in self.last_stage_modules for p in self.get_submodule(path).parameters()}
        looked_up = {id(p) for m in self.modules() if isinstance(m, nn.Embedding)
                     for p in m.parameters(recurse=False)} - last
        multiplied = sum(p.numel() for p in self.parameters() if id(p) not in looked_up)
        config = self.config.get_text_config() if hasattr(self.config, "get_text_config") else self.config
        heads = getattr(config, "num_attention_heads", 0) or 0
        head_dim = getattr(config, "head_dim", None) or (getattr(config, "hidden_size", 0) // heads if heads else 0)
        width = heads * head_dim
        attention_layers = sum(any(type(m).__name__.endswith("Attention") for m in layer.modules())
                               for layer in self.get_submodule(self.layer_stack))
        return 6 * multiplied + 12 * width * seq_len * attention_layers


def stacked_experts(model_type: str, shapes: dict[str, torch.Size]) -> dict[str, Rule]:
    """The rules reading the parameters transformers 5 stacks on load from one tensor per expert
    (its checkpoint conversion mapping: merged along a new dim 0, and joined along dim 1 where
    several projections make one, as gate and up make ``experts.gate_up_proj``), by name."""
    rules: dict[str, Rule] = {}
    mapping = conversion_mapping()  # transformers 4 holds the experts' tensors as saved
    if mapping is None:
        return rules
    for converter in mapping.get_checkpoint_conversion_mapping(model_type) or ():
        operations = [type(op) for op in getattr(converter, "operations", ())]
        targets = getattr(converter, "target_patterns", [])
        merged = [mapping.MergeModulelist]
        if len(targets) != 1 or operations not in (merged, [*merged, mapping.Concatenate]):
            continue
        target = name_pattern(targets[0])
        for name, shape in shapes.items():
            found = target.search(name)
            if found is None or found.end() != len(name):
                continue
            prefix = name[:found.start()]
            stacked = [Stacked(name, prefix + source.replace("*", "{}"), shape[0])
                       for source in converter.source_patterns]
            rules[name] = stacked[0] if len(stacked) == 1 else Joined(name, tuple(stacked), 1)
    return rules


def _has_submodule(module: nn.Module, path: str) -> bool:
    """Whether `path` names a module of `module` (a config's plan may name what a variant lacks)."""
    try:
        return isinstance(module.get_submodule(path), nn.Module)
    except AttributeError:
        return False


def _find_stack(body: nn.Module, blocks: set[str]) -> str | None:
    """The body's ModuleList of its repeated blocks: the one holding the most `_no_split_modules`
    blocks, else the one holding the most parameters."""
    lists = [(name, module) for name, module in body.named_modules() if isinstance(module, nn.ModuleList) and name]
    if not lists:
        return None

    def score(item):
        name, module = item
        return (sum(type(layer).__name__ in blocks for layer in module),
                sum(p.numel() for p in module.parameters()))

    return max(lists, key=score)[0]
