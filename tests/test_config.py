"""LazyConfig: recipes build objects, .py configs import their neighbours, YAML round trips, overrides."""

from __future__ import annotations

import textwrap

import pytest
import torch
from omegaconf import DictConfig

from libai_zoo.config import ConfigError, LazyCall, LazyConfig, get_config, instantiate


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
        train:
          max_iter: 5
          lr: 1.0e-3
        tag: ${train.max_iter}
    """)
    cfg = LazyConfig.load(config)
    assert cfg.train.max_iter == 5 and cfg.train.lr == 1e-3 and cfg.tag == 5
    assert list(LazyConfig.load(config, keys=["train"]).keys()) == ["train"]
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LazyConfig.load(tmp_path / "none.yaml")


# ------------------------------------------------------------------------------------------- save
def test_save_then_load_round_trips(tmp_path):
    cfg = DictConfig(dict(
        model=LazyCall(torch.nn.Linear)(in_features=2, out_features=3),
        optim=LazyCall("torch.optim.SGD")(lr=1e-3, momentum=0.9),
        train=dict(max_iter=10, amp=dict(enabled=True, dtype="bf16"), betas=(0.9, 0.99), note="1e-3",
                   missing="???", nothing=None, steps=[1, 2], alias="${train.max_iter}"),
    ), flags={"allow_objects": True})
    LazyConfig.save(cfg, tmp_path / "out" / "config.yaml")
    loaded = LazyConfig.load(tmp_path / "out" / "config.yaml")
    assert LazyConfig.to_container(loaded) == LazyConfig.to_container(cfg)
    assert loaded.model._target_ == "torch.nn.modules.linear.Linear"
    assert loaded.train.note == "1e-3" and loaded.train.alias == 10
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
def test_apply_overrides_parses_values_as_yaml():
    cfg = get_config("common/train.py")
    out = LazyConfig.apply_overrides(cfg, [
        "train.max_iter=100", "train.scheduler.min_lr_ratio=1e-3", "train.amp.enabled=true",
        "train.checkpoint.max_to_keep=[1,2]", "train.clip_grad_norm=null", "train.output_dir='100'",
        "train.amp.dtype=fp16", "dist.tp=2", "train.seed=", "train.eval.max_batches=${train.max_iter}",
    ])
    assert out is cfg
    t = cfg.train
    assert t.max_iter == 100 and type(t.max_iter) is int
    assert t.scheduler.min_lr_ratio == 1e-3 and type(t.scheduler.min_lr_ratio) is float
    assert t.amp.enabled is True and t.amp.dtype == "fp16"
    assert list(t.checkpoint.max_to_keep) == [1, 2]
    assert t.clip_grad_norm is None
    assert t.output_dir == "100"
    assert t.seed == ""
    assert t.eval.max_batches == 100
    assert cfg.dist.tp == 2


def test_apply_overrides_unknown_key_suggests_the_closest():
    cfg = get_config("common/train.py")
    with pytest.raises(ConfigError,
                       match=r"^train\.max_itr is not a key of this config; did you mean train\.max_iter\? "):
        LazyConfig.apply_overrides(cfg, ["train.max_itr=5"])
    with pytest.raises(ConfigError, match=r"did you mean dist\.tp\?"):
        LazyConfig.apply_overrides(cfg, ["tp=2"])
    with pytest.raises(ConfigError, match="not key=value"):
        LazyConfig.apply_overrides(cfg, ["train.max_iter"])
    with pytest.raises(ConfigError, match="already exists"):
        LazyConfig.apply_overrides(cfg, ["+train.max_iter=5"])


def test_apply_overrides_plus_adds_keys_and_lists_take_indices():
    cfg = DictConfig({"a": {"steps": [1, 2]}})
    LazyConfig.apply_overrides(cfg, ["+train.new_key=1", "+a.extra=x", "a.steps.1=5"])
    assert cfg.train.new_key == 1 and cfg.a.extra == "x" and list(cfg.a.steps) == [1, 5]


# ----------------------------------------------------------------------------- packaged defaults
def test_get_config_train_has_the_contract_keys():
    cfg = get_config("common/train.py")
    assert set(cfg.keys()) == {"train", "dist"}
    assert LazyConfig.to_container(cfg.train) == dict(
        output_dir="output", max_iter=1000, seed=42, micro_batch_size=8, global_batch_size=8,
        amp=dict(enabled=False, dtype="bf16"), activation_checkpoint=dict(enabled=False), zero_stage=0,
        zero_offload=False, compile=False, log_period=10,
        checkpoint=dict(period=500, max_to_keep=None, async_save=False),
        eval=dict(period=0, max_batches=None), clip_grad_norm=1.0, max_bad_steps=5, on_divergence="stop",
        load_weight=None,
        lora=dict(rank=0, alpha=16.0, dropout=0.0, target_modules=None, adapter=None, layers=None),
        scheduler={"_target_": "libai_zoo.optim.WarmupCosineLR", "warmup_iters": 0, "min_lr_ratio": 0.0},
        tensorboard=False, best_metric=None, best_mode="max",
        pipeline=dict(schedule="1f1b", virtual_stages=1, boundaries=None))
    assert LazyConfig.to_container(cfg.dist) == dict(dp=1, tp=1, pp=1, sequence_parallel=False, init_timeout=600,
                                                     timeout=300, auto=False)
    cfg.train.max_iter = 1
    assert get_config("common/train.py").train.max_iter == 1000      # a fresh config every call


def test_get_config_optim_builds_adamw():
    cfg = get_config("common/optim.py")
    assert cfg.optim.params._target_ == "libai_zoo.optim.param_groups" and cfg.optim.params.weight_decay == 0.01
    cfg.optim.params = list(torch.nn.Linear(2, 2).parameters())      # stand-in for param_groups(model)
    optim = instantiate(cfg.optim)
    assert isinstance(optim, torch.optim.AdamW)
    group = optim.param_groups[0]
    assert (group["lr"], tuple(group["betas"]), group["eps"], group["weight_decay"]) == (1e-4, (0.9, 0.999), 1e-8, 0.01)


def test_get_config_unknown_name_lists_the_available_files():
    with pytest.raises(FileNotFoundError, match=r"no packaged config 'common/nope.py'; available: .*common/optim\.py, "
                                                r"common/train\.py"):
        get_config("common/nope.py")
