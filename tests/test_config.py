"""LazyConfig: recipes build objects, .py configs import their neighbours, YAML round trips, overrides;
the typed defaults (schema) and the settings the trainer and the planner read (run_settings)."""

from __future__ import annotations

import copy
import glob
import textwrap
import typing
from pathlib import Path

import pytest
import torch
import yaml
from omegaconf import DictConfig, OmegaConf, ReadonlyConfigError

import libai_zoo.config
from libai_zoo.config import (
    FULL,
    AdamWConfig,
    ConfigError,
    DataLoaderConfig,
    DistConfig,
    LazyCall,
    LazyConfig,
    PipelineSettings,
    Recompute,
    Section,
    TrainConfig,
    get_config,
    instantiate,
    run_settings,
)
from libai_zoo.optim import build_optimizer

ROOT = Path(__file__).resolve().parents[1]
COMMON = Path(libai_zoo.config.__file__).parent / "common"
# every recipe: the projects' configs and the layout-planning recipes (published_layouts.py is a script)
RECIPES = sorted(glob.glob(str(ROOT / "projects/*/config.py")) + glob.glob(str(ROOT / "projects/layout_planning/*_*b.py")))


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


# ------------------------------------------------------------------------------------ instantiate
def test_lazycall_records_the_call_without_making_it():
    cfg = LazyCall(torch.nn.Linear)(in_features=4, out_features=2)
    assert isinstance(cfg, DictConfig)
    assert cfg._target_ is torch.nn.Linear and cfg.in_features == 4 and cfg.out_features == 2


def test_instantiate_builds_nested_recipes_in_dicts_and_lists():
    cfg = LazyCall(torch.nn.ModuleDict)(modules=dict(
        proj=LazyCall(torch.nn.Linear)(in_features=4, out_features=3, bias=False),
        stack=LazyCall(torch.nn.ModuleList)(modules=[
            LazyCall("torch.nn.Linear")(in_features=3, out_features=2),   # dotted-string target
            LazyCall(torch.nn.ReLU)(),
        ]),
    ))
    cfg.modules.proj.out_features = 5                     # edit the recipe before building
    cfg.modules.stack.modules[0].in_features = 5
    built = instantiate(cfg)
    assert isinstance(built, torch.nn.ModuleDict)
    assert built["proj"].weight.shape == (5, 4) and built["proj"].bias is None
    assert isinstance(built["stack"][0], torch.nn.Linear) and built["stack"][0].weight.shape == (2, 5)
    assert isinstance(built["stack"][1], torch.nn.ReLU)


def test_instantiate_keeps_namespaces_passes_plain_python_and_objects_by_reference():
    model = torch.nn.Linear(2, 2)
    cfg = DictConfig({"net": {"_target_": "types.SimpleNamespace", "m": None, "betas": (0.9, 0.99), "sub": {"a": [1]}},
                      "plain": [{"_target_": "builtins.str", "object": 7}]}, flags={"allow_objects": True})
    cfg.net.m = model
    built = instantiate(cfg)
    assert isinstance(built, DictConfig)                  # a namespace without _target_ stays one
    assert built.net.m is model                           # objects are not copied
    assert type(built.net.sub) is dict and type(built.net.sub["a"]) is list  # the callee sees plain Python
    assert type(built.net.betas) in (tuple, list) and built.net.betas[1] == 0.99  # omegaconf 2.4 keeps tuples
    assert list(built.plain) == ["7"]
    assert instantiate([{"_target_": "builtins.str", "object": 3}, 4]) == ["3", 4]
    assert instantiate(5) == 5


def test_instantiate_failure_names_the_key_path_and_target():
    cfg = DictConfig({"model": {"head": LazyCall(torch.nn.Linear)(in_features=2)}}, flags={"allow_objects": True})
    with pytest.raises(ConfigError) as info:
        instantiate(cfg)
    message = str(info.value)
    assert message.startswith("while instantiating model.head (torch.nn.modules.linear.Linear): TypeError:")
    assert "out_features" in message
    assert isinstance(info.value.__cause__, TypeError)
    with pytest.raises(ConfigError, match=r"^while instantiating model\.head "):  # a sub-config knows its path
        instantiate(cfg.model)
    with pytest.raises(ConfigError, match=r"torch\.nn\.Lineer.*torch\.nn has no attribute 'Lineer'"):
        instantiate(LazyCall("torch.nn.Lineer")())
    with pytest.raises(ConfigError, match=r"optim\.params\.model is \?\?\? \(missing\)"):
        instantiate(DictConfig({"optim": {"params": {"_target_": "builtins.dict", "model": "???"}}}).optim)


def test_lazycall_rejects_what_it_cannot_record():
    with pytest.raises(ConfigError, match="dotted"):
        LazyCall("Linear")
    with pytest.raises(ConfigError, match="keyword arguments only"):
        LazyCall(torch.nn.Linear)(2, 3)


# ------------------------------------------------------------------------------------------ load
def test_load_py_resolves_relative_imports_from_disk(tmp_path):
    write(tmp_path / "shared" / "x.py", """
        y = dict(lr=0.5, betas=(0.9, 0.95))
    """)
    write(tmp_path / "configs" / "base.py", """
        import torch
        from libai_zoo.config import LazyCall
        train = dict(max_iter=10, seed=1)
        model = LazyCall(torch.nn.Linear)(in_features=2, out_features=3)
        def helper():
            return 1
    """)
    config = write(tmp_path / "configs" / "exp.py", """
        import math
        from .base import train, model, helper
        from ..shared.x import y
        from . import base
        train.max_iter = 20 * helper()
        _private = 1
        scale = math.sqrt(4)
        assert base.train is train          # one run per file per load, as modules
    """)
    cfg = LazyConfig.load(config)
    assert set(cfg.keys()) == {"train", "model", "y", "scale"}   # no modules, functions or _names
    assert cfg.train.max_iter == 20 and cfg.train.seed == 1
    assert cfg.y.lr == 0.5 and cfg.scale == 2.0
    assert instantiate(cfg.model).weight.shape == (3, 2)
    assert list(LazyConfig.load(config, keys=["train", "y"]).keys()) == ["train", "y"]
    assert LazyConfig.load(config, keys="y").y.betas[1] == 0.95
    with pytest.raises(ConfigError, match="no top-level key nope; its keys are train, model, y, scale"):
        LazyConfig.load(config, keys=["nope"])
    assert LazyConfig.load(config).train.max_iter == 20          # every load runs the files afresh


def test_load_py_relative_import_errors_name_the_file(tmp_path):
    missing = write(tmp_path / "a.py", "from .nowhere import x\n")
    with pytest.raises(ImportError, match=r"from \.nowhere import x.*nowhere\.py"):
        LazyConfig.load(missing)
    write(tmp_path / "b.py", "z = 1\n")
    wrong_name = write(tmp_path / "c.py", "from .b import x\n")
    with pytest.raises(ImportError, match=r"defines no 'x' \(it defines z\)"):
        LazyConfig.load(wrong_name)
    write(tmp_path / "d.py", "from .e import v\n")
    circle = write(tmp_path / "e.py", "from .d import w\nv = 1\n")
    with pytest.raises(ImportError, match="import each other in a circle"):
        LazyConfig.load(circle)


def test_load_yaml(tmp_path):
    config = write(tmp_path / "c.yaml", """
        solver:
          max_iter: 5
          lr: 1.0e-3
        tag: ${solver.max_iter}
    """)
    cfg = LazyConfig.load(config)
    assert cfg.solver.max_iter == 5 and cfg.solver.lr == 1e-3 and cfg.tag == 5
    assert list(LazyConfig.load(config, keys=["solver"]).keys()) == ["solver"]
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LazyConfig.load(tmp_path / "none.yaml")


# ------------------------------------------------------------------------------------------- save
def test_save_then_load_round_trips(tmp_path):
    cfg = DictConfig(dict(
        model=LazyCall(torch.nn.Linear)(in_features=2, out_features=3),
        optim=LazyCall("torch.optim.SGD")(lr=1e-3, momentum=0.9),
        solver=dict(max_iter=10, amp=dict(enabled=True, dtype="bf16"), betas=(0.9, 0.99), note="1e-3",
                    missing="???", nothing=None, steps=[1, 2], alias="${solver.max_iter}"),
    ), flags={"allow_objects": True})
    LazyConfig.save(cfg, tmp_path / "out" / "config.yaml")
    loaded = LazyConfig.load(tmp_path / "out" / "config.yaml")
    assert LazyConfig.to_container(loaded) == LazyConfig.to_container(cfg)
    assert loaded.model._target_ == "torch.nn.modules.linear.Linear"
    assert loaded.solver.note == "1e-3" and loaded.solver.alias == 10
    assert instantiate(loaded.model).weight.shape == (3, 2)       # the dotted name builds again


def test_save_refuses_values_yaml_cannot_hold(tmp_path):
    cfg = DictConfig({"model": {"act": torch.nn.GELU, "w": None}}, flags={"allow_objects": True})
    with pytest.raises(ConfigError, match=r"^model\.act holds a class or function"):
        LazyConfig.save(cfg, tmp_path / "a.yaml")
    cfg.model.act = "gelu"
    cfg.model.w = torch.zeros(2)
    with pytest.raises(ConfigError, match=r"^model\.w holds a torch\.Tensor"):
        LazyConfig.save(cfg, tmp_path / "a.yaml")
    lam = DictConfig({"f": {"_target_": lambda: 1}}, flags={"allow_objects": True})
    with pytest.raises(ConfigError, match=r"^f\._target_ cannot be saved: .*lambda"):
        LazyConfig.save(lam, tmp_path / "a.yaml")
    assert not (tmp_path / "a.yaml").exists()


# -------------------------------------------------------------------------------------- overrides
def defaults() -> DictConfig:
    """The packaged train and dist, loaded as a recipe's are."""
    return LazyConfig.load(COMMON / "train.py")


def test_apply_overrides_parses_values_as_yaml():
    cfg = defaults()
    out = LazyConfig.apply_overrides(cfg, [
        "train.max_iter=100", "train.scheduler.min_lr_ratio=1e-3", "train.amp.enabled=true",
        "train.lora.target_modules=[q,v]", "train.clip_grad_norm=null", "train.output_dir='100'",
        "train.amp.dtype=fp16", "dist.tp=2", "train.best_metric=", "train.eval.max_batches=${train.max_iter}",
    ])
    assert out is cfg
    t = cfg.train
    assert t.max_iter == 100 and type(t.max_iter) is int
    assert t.scheduler.min_lr_ratio == 1e-3 and type(t.scheduler.min_lr_ratio) is float
    assert t.amp.enabled is True and t.amp.dtype == "fp16"
    assert list(t.lora.target_modules) == ["q", "v"]
    assert t.clip_grad_norm is None
    assert t.output_dir == "100"
    assert t.best_metric == ""
    assert t.eval.max_batches == 100
    assert cfg.dist.tp == 2


def test_apply_overrides_unknown_key_suggests_the_closest():
    cfg = defaults()
    with pytest.raises(ConfigError,
                       match=r"^train\.max_itr is not a key of this config; did you mean train\.max_iter\?$"):
        LazyConfig.apply_overrides(cfg, ["train.max_itr=5"])
    with pytest.raises(ConfigError, match=r"did you mean train\.checkpoint\.async_save\?"):
        LazyConfig.apply_overrides(cfg, ["train.checkpoint.asyncsave=true"])
    with pytest.raises(ConfigError, match=r"did you mean dist\.tp\?"):
        LazyConfig.apply_overrides(cfg, ["tp=2"])
    with pytest.raises(ConfigError, match="not key=value"):
        LazyConfig.apply_overrides(cfg, ["train.max_iter"])
    with pytest.raises(ConfigError, match="already exists"):
        LazyConfig.apply_overrides(cfg, ["+train.max_iter=5"])
    # a typed key refuses a value of another type, naming the key
    with pytest.raises(ConfigError, match=r"^override 'train\.max_iter=ten': train\.max_iter: .*Integer"):
        LazyConfig.apply_overrides(cfg, ["train.max_iter=ten"])
    assert cfg.train.max_iter == 1000


def test_apply_overrides_plus_adds_keys_and_lists_take_indices():
    cfg = DictConfig({"a": {"steps": [1, 2]}})
    LazyConfig.apply_overrides(cfg, ["+b.new_key=1", "+a.extra=x", "a.steps.1=5"])
    assert cfg.b.new_key == 1 and cfg.a.extra == "x" and list(cfg.a.steps) == [1, 5]


def test_plus_adds_free_form_keys_but_no_key_the_schema_lacks(tmp_path):
    cfg = LazyConfig.load(ROOT / "projects/gpt2_pretrain/config.py")
    LazyConfig.apply_overrides(cfg, ["+note=smoke", "+model.config.n_inner=64", "+dataloader.train.seed=3",
                                     "+train.scheduler.warmup_ratio=0.1", "+optim.fused=false"])  # free-form parts
    assert (cfg.note, cfg.model.config.n_inner, cfg.dataloader.train.seed, cfg.train.scheduler.warmup_ratio,
            cfg.optim.fused) == ("smoke", 64, 3, 0.1, False)
    LazyConfig.save(cfg, tmp_path / "config.yaml")                   # and the result loads back equal
    assert LazyConfig.to_container(LazyConfig.load(tmp_path / "config.yaml")) == LazyConfig.to_container(cfg)
    for key, section, hint in [("train.note", "train", "its keys are output_dir"),
                               ("train.checkpoint.perod", r"train\.checkpoint", "did you mean period"),
                               ("dist.tpp", "dist", "did you mean tp"),
                               ("dataloader.workers", "dataloader", "did you mean num_workers")]:
        with pytest.raises(ConfigError, match=rf"^\+{key}: {section} is typed by the schema \(\w+\) and has no "
                                              rf"setting \w+ \({hint}"):
            LazyConfig.apply_overrides(cfg, [f"+{key}=1"])
    with pytest.raises(ConfigError, match=r"^\+train\.note: "):   # a config built by hand: the schema all the same
        LazyConfig.apply_overrides(DictConfig({}), ["+train.note=smoke"])
    with pytest.raises(ConfigError, match=r"^train\.note is not a key of this config; did you mean [^(]*$"):
        LazyConfig.apply_overrides(cfg, ["train.note=smoke"])          # no "+train.note" advice


# ----------------------------------------------------------------------------- packaged defaults
def test_get_config_train_has_the_contract_keys():
    common = get_config("common/train.py")
    assert set(vars(common)) == {"train", "dist"}
    assert isinstance(common.train, TrainConfig) and isinstance(common.dist, DistConfig)
    cfg = defaults()
    assert OmegaConf.get_type(cfg.train) is TrainConfig  # typed once loaded
    assert LazyConfig.to_container(cfg.train) == dict(
        output_dir="output", max_iter=1000, seed=42, micro_batch_size=8, global_batch_size=8,
        amp=dict(enabled=False, dtype="bf16", fp32_residual=False),
        fp8=dict(enabled=False, recipe="tensorwise", skip=[]),
        activation_checkpoint=dict(enabled=False, granularity="full", modules=["core_attn"], num_layers=None),
        elementwise_recompute="auto", zero_stage=0, zero_offload=False, compile=False, log_period=10,
        checkpoint=dict(period=500, max_to_keep=None, async_save=False),
        eval=dict(period=0, max_batches=None), clip_grad_norm=1.0, max_bad_steps=5, on_divergence="stop",
        load_weight=None,
        lora=dict(rank=0, alpha=16.0, dropout=0.0, target_modules=None, adapter=None, layers=None),
        scheduler={"_target_": "libai_zoo.optim.WarmupCosineLR", "warmup_iters": 0, "min_lr_ratio": 0.0},
        tensorboard=False, best_metric=None, best_mode="max", expert_bias_update_rate=0.0,
        pipeline=dict(schedule="1f1b", virtual_stages=1, boundaries=None))
    assert LazyConfig.to_container(cfg.dist) == dict(dp=1, tp=1, pp=1, ep=1, cp=1, sequence_parallel=False,
                                                     init_timeout=600, timeout=300, auto=False)
    common.train.max_iter = 1
    assert get_config("common/train.py").train.max_iter == 1000      # a fresh config every call


def test_get_config_optim_builds_adamw():
    optim = get_config("common/optim.py").optim
    assert isinstance(optim, AdamWConfig)
    assert optim.params._target_ == "libai_zoo.optim.param_groups" and optim.params.weight_decay == 0.01
    cfg = LazyConfig.load(COMMON / "optim.py")
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.LayerNorm(2))
    built = build_optimizer(cfg.optim, [model])
    assert isinstance(built, torch.optim.AdamW)
    decayed, exempt = built.param_groups
    assert (decayed["lr"], tuple(decayed["betas"]), decayed["eps"]) == (1e-4, (0.9, 0.999), 1e-8)
    assert (decayed["weight_decay"], exempt["weight_decay"]) == (0.01, 0.0)
    assert [p.shape for p in decayed["params"]] == [(2, 2)]                # biases and norms are exempt


def test_get_config_unknown_name_lists_the_available_files():
    with pytest.raises(FileNotFoundError, match=r"no packaged config 'common/nope.py'; available: .*common/optim\.py, "
                                                r"common/train\.py"):
        get_config("common/nope.py")


# --------------------------------------------------------------------------------- the schema
def test_a_recipe_that_updates_one_nested_key_keeps_the_others(tmp_path):
    write(tmp_path / "base.py", """
        from libai_zoo.config import get_config
        train = get_config("common/train.py").train
        optim = get_config("common/optim.py").optim
        train.checkpoint.max_to_keep = 3
        train.scheduler.warmup_iters = 7
    """)
    config = write(tmp_path / "exp.py", """
        from libai_zoo.config import LazyCall
        from .base import train, optim
        train.update(max_iter=20, checkpoint=dict(period=200), amp=dict(enabled=True), scheduler=dict(min_lr_ratio=0.1))
        optim.update(params=dict(weight_decay=0.1), lr=1e-3)
        train.eval = dict(period=5)                      # assignment replaces the section: the rest are defaults
    """)
    cfg = LazyConfig.load(config)
    t = cfg.train
    assert (t.max_iter, t.checkpoint.period, t.checkpoint.max_to_keep, t.checkpoint.async_save) == (20, 200, 3, False)
    assert (t.amp.enabled, t.amp.dtype) == (True, "bf16")
    assert LazyConfig.to_container(t.scheduler) == {"_target_": "libai_zoo.optim.WarmupCosineLR", "warmup_iters": 7,
                                                    "min_lr_ratio": 0.1}
    assert (t.eval.period, t.eval.max_batches) == (5, None)
    assert LazyConfig.to_container(cfg.optim.params) == {"_target_": "libai_zoo.optim.param_groups", "weight_decay": 0.1}
    assert cfg.optim.lr == 1e-3 and LazyConfig.to_container(t.pipeline) == {"schedule": "1f1b", "virtual_stages": 1,
                                                                             "boundaries": None}
    # a LazyCall replaces the callable whole; the optimizer can be swapped
    write(tmp_path / "swap.py", """
        import torch
        from libai_zoo.config import LazyCall
        from .base import train
        train.update(scheduler=LazyCall("libai_zoo.optim.ConstantLR")())
        optim = LazyCall(torch.optim.SGD)(params=LazyCall("libai_zoo.optim.param_groups")(weight_decay=0.0), lr=0.5)
    """)
    swapped = LazyConfig.load(tmp_path / "swap.py")
    assert LazyConfig.to_container(swapped.train.scheduler) == {"_target_": "libai_zoo.optim.ConstantLR"}
    assert isinstance(build_optimizer(swapped.optim, [torch.nn.Linear(2, 2)]), torch.optim.SGD)


def test_a_mistyped_key_in_a_recipe_is_refused_with_the_closest_name(tmp_path):
    train = get_config("common/train.py").train
    with pytest.raises(ConfigError, match=r"^checkpoint is a section of TrainConfig, not a value: None cannot replace"):
        train.update(checkpoint=None)
    with pytest.raises(ConfigError, match=r"assign AmpConfig\(\) for its defaults"):
        train.amp = None
    assert train.checkpoint.period == 500 and train.amp.dtype == "bf16"
    train.update(lora=dict(layers={"h.0.attn": [4, 8.0]}))
    train.update(lora=dict(layers={"h.1.mlp": [2, 4.0]}))                # a plain dict field is replaced, not merged
    assert train.lora.layers == {"h.1.mlp": [2, 4.0]}
    with pytest.raises(ConfigError, match=r"^max_itr is not a key of TrainConfig; did you mean max_iter\?"):
        train.max_itr = 5
    with pytest.raises(ConfigError, match=r"asyncsave is not a key of CheckpointConfig; did you mean async_save\?"):
        train.update(checkpoint=dict(asyncsave=True))
    with pytest.raises(ConfigError, match=r"^chekpoint is not a key of TrainConfig; did you mean checkpoint\?"):
        train.update(chekpoint=dict(period=1))
    config = write(tmp_path / "bad_type.py", """
        from libai_zoo.config import get_config
        train = get_config("common/train.py").train
        train.checkpoint.period = "often"
    """)
    with pytest.raises(ConfigError, match=r"bad_type\.py: train\.checkpoint\.period: .*'often'.*Integer"):
        LazyConfig.load(config)


def _leaves(node, prefix):
    """(dotted key, value) of every leaf under a loaded config node (a tuple or list is one leaf)."""
    if isinstance(node, DictConfig):
        for key in node.keys():
            yield from _leaves(node[key], f"{prefix}.{key}")
    else:
        yield prefix, node


def _hint(key: str):
    """The schema's type of a dotted key (train.checkpoint.period -> Optional[int]); None under Any."""
    cls = {"train": TrainConfig, "dist": DistConfig, "dataloader": DataLoaderConfig,
           "optim": AdamWConfig}[key.split(".")[0]]
    for part in key.split(".")[1:]:
        if not (isinstance(cls, type) and issubclass(cls, Section)):
            return None
        cls = typing.get_type_hints(cls)[part]
    return cls


def _another(value, hint):
    """A value of the key's type that differs from `value`."""
    if value is None:
        inner = [a for a in typing.get_args(hint) if a is not type(None)][0]
        return {int: 3, float: 0.5, str: "x", list[str]: ["q"], list[int]: [1], dict[str, typing.Any]: {"q": [2, 4.0]}}[inner]
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1
    if isinstance(value, str):
        return value + "x"
    return [v + "x" if isinstance(v, str) else v + 0.01 for v in value]


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: str(Path(p).relative_to(ROOT)))
def test_every_key_of_the_packaged_defaults_overrides_on_every_recipe(recipe):
    keys = [key for section in ("train", "dist") for key, _ in _leaves(defaults()[section], section)]
    keys += [key for key, _ in _leaves(LazyConfig.load(COMMON / "optim.py").optim, "optim")]
    keys += [f"dataloader.{name}" for name in ("num_workers", "shuffle", "prefetch")]
    base = LazyConfig.load(recipe)
    # every recipe trains with the packaged AdamW, so all of its keys are required below, none dropped
    assert OmegaConf.get_type(base.optim) is AdamWConfig and OmegaConf.get_type(base.dataloader) is DataLoaderConfig
    assert [key for key in keys if OmegaConf.select(base, key, default="absent") == "absent"
            and not key.startswith("train.scheduler.")] == []      # the schema's keys are all there
    # the LazyCall parts (scheduler, optimizer) are the recipe's own: every argument it gives
    keys = sorted({*keys, *(k for k, _ in _leaves(base.train.scheduler, "train.scheduler")),
                   *(k for k, _ in _leaves(base.optim, "optim"))})
    keys = [key for key in keys if OmegaConf.select(base, key, default="absent") != "absent"]
    for key in keys:
        current = OmegaConf.select(base, key)
        if key.endswith("_target_"):
            value = current if isinstance(current, str) else f"{current.__module__}.{current.__qualname__}"
        else:
            value = _another(OmegaConf.to_container(current) if OmegaConf.is_config(current) else current, _hint(key))
        text = yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("\n...")
        cfg = LazyConfig.apply_overrides(copy.deepcopy(base), [f"{key}={text}"])
        got = OmegaConf.select(cfg, key)
        got = OmegaConf.to_container(got) if OmegaConf.is_config(got) else got
        assert (list(got) if isinstance(got, tuple) else got) == value, key
    assert len(keys) > 40


def test_the_gpt2_recipe_takes_async_save_from_the_command_line():
    cfg = LazyConfig.apply_overrides(LazyConfig.load(ROOT / "projects/gpt2_pretrain/config.py"),
                                     ["train.checkpoint.async_save=True"])
    assert (cfg.train.checkpoint.period, cfg.train.checkpoint.async_save, cfg.train.checkpoint.max_to_keep) == \
        (200, True, None)


# An earlier run's config.yaml (as LazyConfig.save wrote it before the schema): its checkpoint lost
# max_to_keep and async_save to the recipe's update, and it predates train.pipeline and train.lora.layers.
OLD_YAML = """
train:
  output_dir: output/gpt2_pretrain
  max_iter: 400
  seed: 42
  micro_batch_size: 16
  global_batch_size: 16
  amp: {enabled: false, dtype: bf16}
  activation_checkpoint: {enabled: false}
  zero_stage: 0
  zero_offload: false
  compile: false
  log_period: 25
  checkpoint: {period: 200}
  eval: {period: 200, max_batches: null}
  clip_grad_norm: 1.0
  load_weight: null
  lora: {rank: 0, alpha: 16.0, dropout: 0.0, target_modules: null, adapter: null}
  scheduler: {_target_: libai_zoo.optim.WarmupCosineLR, warmup_iters: 40, min_lr_ratio: 0.1}
dist: {dp: 1, tp: 1, pp: 1, sequence_parallel: false, init_timeout: 600, timeout: 300}
optim:
  _target_: torch.optim.adamw.AdamW
  params: {_target_: libai_zoo.optim.param_groups, weight_decay: 0.01}
  lr: 0.002
  betas: [0.9, 0.95]
  eps: 1.0e-08
  weight_decay: 0.01
model:
  _target_: libai_zoo.models.gpt2.GPT2LMHeadModel
  config: {_target_: libai_zoo.models.gpt2.GPT2Config, n_layer: 2}
"""


def test_an_earlier_runs_config_yaml_loads(tmp_path):
    config = write(tmp_path / "config.yaml", OLD_YAML)
    cfg = LazyConfig.load(config)
    c = cfg.train.checkpoint
    assert (c.period, c.max_to_keep, c.async_save) == (200, None, False)      # missing keys: their defaults
    assert cfg.train.pipeline.schedule == "1f1b" and cfg.train.lora.layers is None and cfg.dist.auto is False
    assert cfg.train.max_iter == 400 and cfg.train.scheduler.warmup_iters == 40
    LazyConfig.apply_overrides(cfg, ["train.checkpoint.async_save=true", "train.max_iter=3"])
    assert cfg.train.checkpoint.async_save is True
    assert isinstance(build_optimizer(cfg.optim, [torch.nn.Linear(2, 2)]), torch.optim.AdamW)
    # a saved optim is the optimizer's LazyCall, free-form: its arguments are checked when it is built
    wrong = LazyConfig.apply_overrides(copy.deepcopy(cfg), ["optim.lr=abc"])
    with pytest.raises(ConfigError, match=r"^while instantiating .*AdamW\): TypeError: "):
        build_optimizer(wrong.optim, [torch.nn.Linear(2, 2)])
    # and it saves and loads back equal
    LazyConfig.save(cfg, tmp_path / "again.yaml")
    assert LazyConfig.to_container(LazyConfig.load(tmp_path / "again.yaml")) == LazyConfig.to_container(cfg)
    # a key this libai_zoo does not know is named, with what it may have become
    write(tmp_path / "renamed.yaml", OLD_YAML.replace("  log_period: 25", "  log_every: 25"))
    with pytest.raises(ConfigError, match=r"renamed\.yaml: train\.log_every is not a key of train .*"
                                          r"did you mean log_period\?\): remove it, or rename it"):
        LazyConfig.load(tmp_path / "renamed.yaml")
    write(tmp_path / "wrong_type.yaml", OLD_YAML.replace("  max_iter: 400", "  max_iter: many"))
    with pytest.raises(ConfigError, match=r"wrong_type\.yaml: train: max_iter: .*'many'"):
        LazyConfig.load(tmp_path / "wrong_type.yaml")


# ------------------------------------------------------------------------------- run_settings
def test_run_settings_parse_what_the_trainer_and_the_planner_read():
    cfg = LazyConfig.apply_overrides(LazyConfig.load(ROOT / "projects/gpt2_pretrain/config.py"), [
        "train.amp.enabled=true", "train.amp.dtype=fp16", "train.pipeline.schedule=interleaved_1f1b",
        "train.pipeline.virtual_stages=2", "train.pipeline.boundaries=[1,2,3]", "dist.sequence_parallel=true"])
    run = run_settings(cfg)
    assert (run.seq_len, run.amp_dtype, run.train.micro_batch_size, run.train.global_batch_size) == \
        (128, torch.float16, 16, 16)
    assert run.pipeline == PipelineSettings("interleaved_1f1b", 2, (1, 2, 3)) and run.dist.sequence_parallel
    with pytest.raises(ReadonlyConfigError):  # one view: what a run changes goes into cfg
        run.train.max_iter = 1
    assert run.lora["rank"] == 0 and set(run.lora) == {"rank", "alpha", "dropout", "target_modules", "adapter", "layers"}
    assert run_settings(LazyConfig.load(ROOT / "projects/llama_sft/config.py")).seq_len == 512   # max_length
    assert run_settings(LazyConfig.load(ROOT / "projects/vit_classification/config.py")).seq_len is None  # images
    # a config built by hand reads the defaults for what it leaves out
    hand = OmegaConf.create({"train": {"global_batch_size": 4, "lora": None}})
    run = run_settings(hand)
    assert (run.train.global_batch_size, run.train.micro_batch_size, run.amp_dtype, run.pipeline) == \
        (4, 8, None, PipelineSettings("1f1b", 1, None))
    with pytest.raises(ConfigError, match=r"train\.amp\.dtype = 'fp8' must be one of \['bf16', 'fp16'\]"):
        run_settings(LazyConfig.apply_overrides(defaults(), ["train.amp.enabled=true", "train.amp.dtype=fp8"]))
    with pytest.raises(ConfigError, match=r"dataloader\.train\.seq_len = 0 must be a positive number of tokens"):
        run_settings(OmegaConf.create({"dataloader": {"train": {"seq_len": 0}}}))


def test_run_settings_parse_the_recomputation_choice():
    """``enabled`` alone is today's full recomputation of every layer; selective takes Megatron's module
    names (core_attn by default) and an unknown one is refused with the list."""
    def parsed(*overrides):
        return run_settings(LazyConfig.apply_overrides(defaults(), list(overrides))).activation_checkpoint
    assert parsed() is None
    assert parsed("train.activation_checkpoint.enabled=true") == FULL == Recompute("full", (), None)
    assert parsed("train.activation_checkpoint.enabled=true", "train.activation_checkpoint.granularity=selective") \
        == Recompute("selective", ("core_attn",), None)
    assert parsed("train.activation_checkpoint.enabled=true", "train.activation_checkpoint.granularity=selective",
                  "train.activation_checkpoint.modules=[layernorm,mlp_act]",
                  "train.activation_checkpoint.num_layers=2") == Recompute("selective", ("layernorm", "mlp_act"), 2)
    with pytest.raises(ConfigError, match=r"modules = \['attn'\] must name at least one of \['core_attn', "
                                          r"'layernorm', 'mlp', 'mlp_act', 'moe'\]"):
        parsed("train.activation_checkpoint.enabled=true", "train.activation_checkpoint.granularity=selective",
               "train.activation_checkpoint.modules=[attn]")
    with pytest.raises(ConfigError, match=r"granularity = 'block' must be 'full' or 'selective'"):
        parsed("train.activation_checkpoint.enabled=true", "train.activation_checkpoint.granularity=block")
    with pytest.raises(ConfigError, match=r"num_layers = 0 must be a positive number of layers"):
        parsed("train.activation_checkpoint.enabled=true", "train.activation_checkpoint.num_layers=0")
