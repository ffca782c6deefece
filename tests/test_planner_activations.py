"""The planner's activation model (libai_zoo/plan/activations.py) against what autograd really keeps.

Each case runs a micro-batch's training forward of real layers (built through the models, sharded
under a fake process group of tp ranks in this one process: collectives return right-shaped
garbage, which is all the count needs) and adds up the tensors saved for backward
(`saved_tensors_hooks`: each storage once, the model's parameters left out). The prediction must be
within 10% of it, per layer and for a whole model (embedding + L × layer + head).
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

import pytest
import torch
import torch.distributed as dist
import transformers
from torch.distributed.tensor import DTensor

from libai_zoo import distributed, layers, models
from libai_zoo.parallel import apply_activation_checkpointing
from libai_zoo.plan.activations import (LayerShape, embedding_activation_bytes, head_activation_bytes,
                                        layer_activation_bytes)
from libai_zoo.plan.fake_world import fake_world

TOLERANCE = 0.10
VOCAB = 512


def gpt2(hidden: int = 64, layers_: int = 1, dropout: float = 0.1) -> models.GPT2LMHeadModel:
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=hidden, n_layer=layers_, n_head=4, n_inner=4 * hidden,
                                     n_positions=512, bos_token_id=1, eos_token_id=2, resid_pdrop=dropout,
                                     embd_pdrop=dropout, attn_pdrop=dropout)
    return models.GPT2LMHeadModel(config)


def llama(hidden: int = 64, layers_: int = 1, attention_dropout: float = 0.0) -> models.LlamaForCausalLM:
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=layers_,
                                      num_attention_heads=8, num_key_value_heads=4, intermediate_size=3 * hidden,
                                      max_position_embeddings=512, attention_dropout=attention_dropout,
                                      bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    return models.LlamaForCausalLM(config)


MODELS = {
    "gpt2": gpt2,
    "gpt2_nodrop": lambda **kw: gpt2(dropout=0.0, **kw),
    "llama": llama,
    "llama_attn_dropout": lambda **kw: llama(attention_dropout=0.1, **kw),
}

# The other arrangements of `TransformerLayer`, built directly: GPT-J's parallel block, BERT's post-norm.
LAYERS = {
    "parallel_block": lambda: layers.TransformerLayer(64, 4, 256, parallel_block=True, hidden_dropout=0.1,
                                                      causal=True),
    "post_norm": lambda: layers.TransformerLayer(64, 4, 256, norm_position="post", hidden_dropout=0.1, causal=True),
}


def parameter_storages(model: torch.nn.Module) -> set[int]:
    """data_ptr of every parameter's (local) storage: saved too, but not activations."""
    storages = set()
    for param in model.parameters():
        local = param.to_local() if isinstance(param, DTensor) else param
        storages.add(local.untyped_storage().data_ptr())
    return storages


def saved_bytes(run, model: torch.nn.Module):
    """(bytes of the distinct storages saved for backward while `run()` runs, parameters excluded, run's result)."""
    exclude, seen = parameter_storages(model), {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in exclude:
            seen.setdefault(storage.data_ptr(), storage.nbytes())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        result = run()
    return sum(seen.values()), result


@contextmanager
def parallel(model: torch.nn.Module, tp: int, sp: bool):
    """``with parallel(model, tp, sp):`` the model sharded over a fake tp group, torn down on exit (nothing at tp=1)."""
    if tp == 1:
        yield
        return
    with fake_world(tp, 0, tp=tp, sequence_parallel=sp) as ctx:
        distributed.shard(model, ctx)
        yield


def autocast(amp):
    return torch.autocast("cpu", dtype=amp) if amp is not None else nullcontext()


def check(measured: int, predicted: int, what: str) -> None:
    error = abs(predicted - measured) / measured
    print(f"{what}: measured {measured}, predicted {predicted}, error {error:.3f}")
    assert error <= TOLERANCE, f"{what}: measured {measured} B, predicted {predicted} B, relative error {error:.3f}"


@pytest.fixture(autouse=True)
def no_process_group_left():
    assert not dist.is_initialized()
    yield
    assert not dist.is_initialized(), "a fake world was left initialized"


LAYOUTS = [(1, False), (2, False), (2, True), (4, False), (4, True)]
SIZES = [(1, 64), (2, 128), (4, 64), (1, 256)]  # (micro-batch, sequence), cycled over the cases
LAYER_CASES = [(kind, tp, sp, ckpt, amp)
               for kind in [*MODELS, *LAYERS] for tp, sp in LAYOUTS for ckpt in (False, True)
               for amp in (None, torch.bfloat16)]


@pytest.mark.parametrize("case", range(len(LAYER_CASES)),
                         ids=[f"{k}-tp{tp}{'-sp' if sp else ''}{'-ckpt' if c else ''}-{'bf16' if a else 'fp32'}"
                              for k, tp, sp, c, a in LAYER_CASES])
def test_layer(case):
    kind, tp, sp, ckpt, amp = LAYER_CASES[case]
    batch, seq = SIZES[case % len(SIZES)]
    torch.manual_seed(0)
    if kind in MODELS:
        model = MODELS[kind]()
        layer = models.get_layer_stack(model)[0]
    else:
        model = layer = LAYERS[kind]()
    shape = LayerShape.of(layer)
    hidden = shape.hidden_size
    model.train()
    with parallel(model, tp, sp):
        if ckpt:
            apply_activation_checkpointing([layer])
        x = torch.randn(batch, seq // tp if sp else seq, hidden, requires_grad=True)
        with autocast(amp):
            measured, out = saved_bytes(lambda: layer(x), model)
        out.float().sum().backward()  # the graph is whole: backward runs (on garbage values)
    predicted = layer_activation_bytes(shape, batch, seq, tp=tp, sequence_parallel=sp, checkpointed=ckpt,
                                       amp_dtype=amp, device="cpu")
    check(measured, predicted, f"{kind} layer B={batch} S={seq} tp={tp} sp={sp} ckpt={ckpt} amp={amp}")


MODEL_CASES = [  # (kind, layers, hidden, batch, seq, tp, sp, ckpt, amp, chunk_bytes)
    ("gpt2", 2, 128, 2, 128, 1, False, False, None, None),
    ("gpt2", 2, 128, 2, 128, 1, False, False, torch.bfloat16, None),
    ("gpt2", 2, 64, 4, 64, 2, True, False, torch.bfloat16, None),
    ("gpt2", 3, 64, 2, 128, 4, True, True, None, None),
    ("gpt2", 2, 64, 2, 128, 2, False, False, None, 64 * 1024),  # the loss in chunks
    ("gpt2", 2, 64, 1, 256, 2, True, False, None, None),
    ("gpt2_nodrop", 2, 128, 2, 128, 1, False, False, None, None),
    ("gpt2_nodrop", 2, 128, 1, 256, 4, True, False, torch.bfloat16, None),
    ("llama", 2, 128, 2, 128, 1, False, False, None, None),
    ("llama", 2, 128, 2, 128, 1, False, False, torch.bfloat16, None),
    ("llama", 2, 128, 2, 128, 2, True, False, torch.bfloat16, None),
    ("llama", 3, 64, 4, 64, 4, True, True, torch.bfloat16, None),
    ("llama", 2, 128, 1, 256, 2, True, False, torch.bfloat16, None),
    ("llama_attn_dropout", 2, 64, 1, 128, 1, False, False, torch.bfloat16, None),
    ("llama", 2, 128, 1, 256, 4, False, False, None, 32 * 1024),  # the loss in chunks
]


@pytest.mark.parametrize("case", MODEL_CASES,
                         ids=[f"{c[0]}-L{c[1]}-h{c[2]}-B{c[3]}-S{c[4]}-tp{c[5]}{'-sp' if c[6] else ''}"
                              f"{'-ckpt' if c[7] else ''}-{'bf16' if c[8] else 'fp32'}{'-chunked' if c[9] else ''}"
                              for c in MODEL_CASES])
def test_whole_model(case):
    kind, num_layers, hidden, batch, seq, tp, sp, ckpt, amp, chunk_bytes = case
    torch.manual_seed(0)
    model = MODELS[kind](hidden=hidden, layers_=num_layers).train()
    if chunk_bytes is not None:
        model.lm_head.chunk_bytes = chunk_bytes
    shape = LayerShape.of(models.get_layer_stack(model)[0])
    ids = torch.randint(3, VOCAB, (batch, seq))
    with parallel(model, tp, sp):
        if ckpt:
            apply_activation_checkpointing(models.get_layer_stack(model))
        with autocast(amp):
            measured, out = saved_bytes(lambda: model(input_ids=ids, labels=ids, return_logits=False).loss, model)
        out.backward()
    common = dict(tp=tp, sequence_parallel=sp, amp_dtype=amp, device="cpu")
    gpt = kind.startswith("gpt2")
    dropout = model.config.embd_pdrop if gpt else 0.0
    predicted = (embedding_activation_bytes(hidden, batch, seq, dropout=dropout, position_embedding=gpt, **common)
                 + num_layers * layer_activation_bytes(shape, batch, seq, checkpointed=ckpt, **common)
                 + head_activation_bytes(hidden, VOCAB, batch, seq, norm=shape.norm, chunk_bytes=chunk_bytes,
                                         **common))
    check(measured, predicted, f"{kind} model L={num_layers} h={hidden} B={batch} S={seq} tp={tp} sp={sp} "
                               f"ckpt={ckpt} amp={amp} chunk_bytes={chunk_bytes}")


def test_shape_of_meta_layer():
    """LayerShape reads an unsharded layer built on the meta device (what the planner has)."""
    with torch.device("meta"):
        gpt, lla = gpt2(), llama()
    assert LayerShape.of(models.get_layer_stack(gpt)[0]) == LayerShape(
        hidden_size=64, num_heads=4, num_kv_heads=4, head_dim=16, ffn_hidden_size=256, gated_mlp=False,
        norm="layernorm", attention_dropout=0.1, hidden_dropout=0.1, parallel_block=False, pre_norm=True,
        rotary=False, row_bias=True)
    assert LayerShape.of(models.get_layer_stack(lla)[0]) == LayerShape(
        hidden_size=64, num_heads=8, num_kv_heads=4, head_dim=8, ffn_hidden_size=192, gated_mlp=True,
        norm="rmsnorm", attention_dropout=0.0, hidden_dropout=0.0, parallel_block=False, pre_norm=True,
        rotary=True, row_bias=False)


def test_attention_memory_on_cuda_is_linear_in_sequence():
    """Predicted for CUDA (no GPU needed), attention dropout runs inside the fused kernels: the
    bytes depend on the tokens B·S only, where CPU's math path keeps S×S probabilities."""
    shape = LayerShape.of(models.get_layer_stack(gpt2())[0])
    for device, linear in (("cuda", True), ("cpu", False)):
        short, long = (layer_activation_bytes(shape, batch, seq, amp_dtype=torch.bfloat16, device=device)
                       for batch, seq in ((4, 128), (1, 512)))
        assert (short == long) == linear, (device, short, long)
