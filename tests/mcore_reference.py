"""Megatron-Core itself, for the conversion tests (run as a script, so its global parallel state
and CUDA stand-ins never touch the pytest process).

    python tests/mcore_reference.py build OUT --tp 2 --pp 2 --ep 2   # every family of FAMILIES
    python tests/mcore_reference.py forward CKPT... --ids IDS.pt --out LOGITS.pt   # load each, logits of IDS

`build` runs tp × pp forked gloo ranks that build Megatron-Core GPTModels (CPU initialisation,
every weight then moved off its initial value so biases and norms count), and save each as
Megatron-LM does: `dist_checkpointing.save` (torch_dist) and, for the dense families, per-rank
`model_optim_rng.pt` files, with Megatron-LM-style args. The MoE families (Mixtral, Qwen3-MoE:
`SequentialMLP` experts, the alltoall dispatcher) are split over `--ep` expert-parallel ranks
carved from the tp ranks. `forward` rebuilds a GPTModel from a torch_dist checkpoint's args as
Megatron-LM's model provider would (tp = pp = ep = 1), loads it with `dist_checkpointing.load`
and writes its logits.

megatron-core 0.16.1 runs here on CPU under gloo with a few stand-ins (`_stand_ins`): CUDA
synchronisation and streams, the sliding-window mask it builds on "cuda", and the router's
`te_general_gemm`, which 0.16.1 reads without Transformer Engine. Its saver spawns a worker: this
file runs only as a script (`__main__`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import zlib
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

LLAMA = dict(num_layers=4, hidden_size=32, ffn_hidden_size=48, num_attention_heads=4, kv_channels=8,
             group_query_attention=True, num_query_groups=2, max_position_embeddings=16384, seq_length=64,
             position_embedding_type="rope", normalization="RMSNorm", norm_epsilon=1e-5, swiglu=True,
             bias_gelu_fusion=False, bias_swiglu_fusion=False, add_bias_linear=False, add_qkv_bias=False,
             untie_embeddings_and_output_weights=True, vocab_size=100, make_vocab_size_divisible_by=64,
             rotary_base=500000, rotary_percent=1.0, use_rope_scaling=True, rope_scaling_factor=8.0,
             rotary_seq_len_interpolation_factor=None)
FAMILIES = {
    "gpt": dict(num_layers=4, hidden_size=32, ffn_hidden_size=96, num_attention_heads=4, kv_channels=8,
                group_query_attention=False, num_query_groups=4, max_position_embeddings=64, seq_length=64,
                position_embedding_type="learned_absolute", normalization="LayerNorm", norm_epsilon=1e-5, swiglu=False,
                bias_gelu_fusion=False, bias_swiglu_fusion=False, add_bias_linear=True, add_qkv_bias=True,
                untie_embeddings_and_output_weights=False, vocab_size=100, make_vocab_size_divisible_by=64,
                rotary_base=10000, rotary_percent=1.0, use_rope_scaling=False, rope_scaling_factor=8.0,
                rotary_seq_len_interpolation_factor=None),
    "gpt_rope": dict(num_layers=4, hidden_size=32, ffn_hidden_size=96, num_attention_heads=4, kv_channels=8,
                     group_query_attention=False, num_query_groups=4, max_position_embeddings=64, seq_length=64,
                     position_embedding_type="rope", normalization="LayerNorm", norm_epsilon=1e-5, swiglu=False,
                     bias_gelu_fusion=True, bias_swiglu_fusion=False, add_bias_linear=True, add_qkv_bias=True,
                     untie_embeddings_and_output_weights=True, vocab_size=100, make_vocab_size_divisible_by=64,
                     rotary_base=20000, rotary_percent=0.5, use_rope_scaling=False, rope_scaling_factor=8.0,
                     rotary_seq_len_interpolation_factor=None),
    "llama": LLAMA,
    # per-head q/k norms, kv_channels apart from hidden / heads, a window on odd layers (every 2nd skips it)
    "qwen3": dict(LLAMA, kv_channels=16, max_position_embeddings=64, norm_epsilon=1e-6, rotary_base=1000000,
                  use_rope_scaling=False, qk_layernorm=True, window_size=(3, 0), window_attn_skip_freq=2),
    # a window on every layer, kv_channels apart from hidden / heads, tied head
    "mistral": dict(LLAMA, kv_channels=16, max_position_embeddings=64, rotary_base=10000, use_rope_scaling=False,
                    untie_embeddings_and_output_weights=False, window_size=(4, 0)),
    # Mixtral: 4 experts, top 2 renormalised (top-k of the logits, then their softmax), every layer
    # MoE (its tensors stacked over the layers), a window on every layer
    "mixtral": dict(LLAMA, max_position_embeddings=64, rotary_base=1000000, use_rope_scaling=False, num_experts=4,
                    moe_router_topk=2, moe_ffn_hidden_size=48, window_size=(4, 0)),
    # Qwen3-MoE: q/k norms, 8 experts of their own width, top-2 probabilities not renormalised
    # (softmax before the top-k), layer 0 dense (--moe-layer-freq as a list)
    "qwen3_moe": dict(LLAMA, kv_channels=16, max_position_embeddings=64, norm_epsilon=1e-6, rotary_base=1000000,
                      use_rope_scaling=False, qk_layernorm=True, num_experts=8, moe_router_topk=2,
                      moe_ffn_hidden_size=24, moe_router_pre_softmax=True, moe_layer_freq=[0, 1, 1, 1]),
    # Qwen2-MoE: q/k/v biases, a shared expert scaled by its sigmoid gate, top-2 not renormalised
    "qwen2_moe": dict(LLAMA, max_position_embeddings=64, rotary_base=1000000, use_rope_scaling=False,
                      add_qkv_bias=True, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=24,
                      moe_router_pre_softmax=True, moe_shared_expert_intermediate_size=40, moe_shared_expert_gate=True),
}
MOE = dict(num_experts=None, moe_router_topk=2, moe_ffn_hidden_size=None, moe_router_pre_softmax=False,
           moe_layer_freq=1, moe_router_score_function="softmax", moe_router_topk_scaling_factor=None,
           moe_shared_expert_intermediate_size=None, moe_shared_expert_gate=False, moe_grouped_gemm=False,
           moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.01, moe_router_dtype="fp32",
           moe_token_dispatcher_type="alltoall", moe_router_enable_expert_bias=False)


class Stream:
    """A CUDA stream on CPU: work is done when asked for, so waiting is a no-op."""

    only: Stream

    def __new__(cls, *args, **kwargs):
        return cls.only

    def wait_stream(self, other) -> None:
        pass

    def record_event(self) -> Stream:
        return self

    def synchronize(self) -> None:
        pass


Stream.only = object.__new__(Stream)


def _stand_ins() -> None:
    """What Megatron-Core's saver and attention ask of CUDA, answered on CPU."""
    from megatron.core.fusions import fused_softmax
    from megatron.core.tensor_parallel import random
    from megatron.core.transformer.moe import moe_utils

    def window_mask(sq: int, skv: int, size: tuple[int, int]) -> torch.Tensor:  # True: masked, as Megatron-Core's
        query = torch.arange(sq)[:, None] + skv - sq
        key = torch.arange(skv)[None]
        return (key < query - size[0]) | (key > query + size[1])

    fused_softmax.get_sliding_window_causal_mask = window_mask  # Megatron-Core's builds it on "cuda"
    moe_utils.te_general_gemm = None  # 0.16.1's router reads it even when Transformer Engine is absent
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.Stream = Stream  # the alltoall dispatcher's device-to-host copies: one stream on CPU
    torch.cuda.current_stream = lambda *args, **kwargs: Stream.only
    torch.cuda.stream = lambda stream: contextlib.nullcontext()
    torch.cuda.current_device = lambda: "cpu"
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # the tied head's first all-reduce between end stages
    random.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()


def gpt_model(args: argparse.Namespace, pre_process: bool = True, post_process: bool = True):
    """A GPTModel as Megatron-LM's model provider builds it from its args (local layer spec)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    activation = F.silu if args.swiglu else F.gelu  # Megatron-LM's core_transformer_config_from_args
    moe = {f"moe_{name}": getattr(args, f"moe_{name}") for name in (
        "router_topk", "ffn_hidden_size", "router_pre_softmax", "layer_freq", "router_score_function",
        "router_topk_scaling_factor", "shared_expert_intermediate_size", "shared_expert_gate", "grouped_gemm",
        "router_load_balancing_type", "aux_loss_coeff", "router_dtype", "token_dispatcher_type",
        "router_enable_expert_bias")} if args.num_experts else {}
    config = TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads, kv_channels=args.kv_channels,
        num_query_groups=args.num_query_groups if args.group_query_attention else None,
        normalization=args.normalization, layernorm_epsilon=args.norm_epsilon, gated_linear_unit=args.swiglu,
        activation_func=activation, add_bias_linear=args.add_bias_linear, add_qkv_bias=args.add_qkv_bias,
        bias_activation_fusion=args.bias_swiglu_fusion if args.swiglu else args.bias_gelu_fusion,
        qk_layernorm=args.qk_layernorm, window_size=args.window_size, window_attn_skip_freq=args.window_attn_skip_freq,
        hidden_dropout=0.0, attention_dropout=0.0,
        use_cpu_initialization=True, params_dtype=torch.float32, pipeline_dtype=torch.float32,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        num_moe_experts=args.num_experts, expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size, **moe)
    if args.num_experts:  # Megatron-LM's model provider: MoE (and dense) layers by --moe-layer-freq
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=args.normalization)
        if args.transformer_impl == "transformer_engine":  # its checkpoint names, with local modules
            spec.layer_specs = [_te_names(layer) for layer in spec.layer_specs]
    else:
        spec = get_gpt_layer_local_spec(normalization=args.normalization, qk_layernorm=args.qk_layernorm)
    return GPTModel(config, spec,
                    vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
                    pre_process=pre_process, post_process=post_process,
                    share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                    position_embedding_type=args.position_embedding_type, rotary_percent=args.rotary_percent,
                    rotary_base=args.rotary_base, rope_scaling=args.use_rope_scaling,
                    rope_scaling_factor=args.rope_scaling_factor,
                    seq_len_interpolation_factor=args.rotary_seq_len_interpolation_factor)


def _te_names(layer):
    """A local layer spec that names its tensors as Transformer Engine's does: an MoE layer keeps
    its pre-MLP norm as `pre_mlp_layernorm` (the local spec files it under `mlp.linear_fc1`)."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    if layer.submodules.mlp.module is not MoELayer:
        return layer
    names = {k: v for k, v in layer.submodules.sharded_state_dict_keys_map.items() if k != "pre_mlp_layernorm."}
    return dataclasses.replace(layer, submodules=dataclasses.replace(layer.submodules,
                                                                     sharded_state_dict_keys_map=names))


def megatron_args(family: str, tp: int, pp: int, ep: int = 1) -> argparse.Namespace:
    from megatron.core.transformer.enums import AttnBackend

    values = {"qk_layernorm": False, "window_size": None, "window_attn_skip_freq": None, **MOE, **FAMILIES[family]}
    multiple = values["make_vocab_size_divisible_by"] * tp
    return argparse.Namespace(**values, padded_vocab_size=-(-values["vocab_size"] // multiple) * multiple,
                              tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                              expert_model_parallel_size=ep if values["num_experts"] else 1,
                              expert_tensor_parallel_size=1,
                              params_dtype=torch.float32,
                              hidden_dropout=0.0, attention_dropout=0.0, attention_backend=AttnBackend.auto,
                              ckpt_format="torch_dist", use_mcore_models=True, transformer_impl="local")


def _move_off_init(model, tied: bool, tp_rank: int, pp_rank: int, ep_rank: int) -> None:
    """Every weight away from its initial value (biases are 0 and norms 1 at first); a tensor
    every tp rank holds whole gets the same values on all of them, and each expert its own."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if tied and name == "output_layer.weight":
                continue  # the last stage's copy of the tied embedding: never saved
            split = getattr(param, "tensor_model_parallel", False)
            expert = ".local_experts." in name  # numbered within this expert-parallel rank
            seed = zlib.crc32(f"{name}/{pp_rank}/{tp_rank if split else 0}/{ep_rank if expert else 0}".encode())
            param.add_(torch.randn(param.shape, generator=torch.Generator().manual_seed(seed)) * 0.05)


def _build_rank(rank: int, out: str, tp: int, pp: int, ep: int, port: int) -> None:
    from megatron.core import dist_checkpointing, parallel_state

    _stand_ins()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=tp * pp)
    # the expert-parallel group is carved from tp × dp (here the tp ranks), experts not tp-split
    parallel_state.initialize_model_parallel(tp, pp, expert_model_parallel_size=ep, expert_tensor_parallel_size=1)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    for family in FAMILIES:
        torch.manual_seed(1234 + pp_rank)
        args = megatron_args(family, tp, pp, ep)
        model = gpt_model(args, pre_process=pp_rank == 0, post_process=pp_rank == pp - 1)
        _move_off_init(model, not args.untie_embeddings_and_output_weights, tp_rank, pp_rank, ep_rank)
        root = Path(out) / family
        dist_dir = root / "torch_dist" / "iter_0000010"
        if rank == 0:
            dist_dir.mkdir(parents=True)
            (root / "torch_dist" / "latest_checkpointed_iteration.txt").write_text("10")
        dist.barrier()
        dist_checkpointing.save({"model": model.sharded_state_dict(), "args": args, "iteration": 10,
                                 "checkpoint_version": 3.0}, str(dist_dir))
        if not args.num_experts:  # torch_dist only: per-rank torch files of an MoE are not read
            shard = root / "torch" / "iter_0000010" / (f"mp_rank_{tp_rank:02d}" if pp == 1
                                                       else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}")
            shard.mkdir(parents=True)
            torch.save({"args": args, "iteration": 10, "checkpoint_version": 3.0, "model": model.state_dict()},
                       shard / "model_optim_rng.pt")
            if rank == 0:
                (root / "torch" / "latest_checkpointed_iteration.txt").write_text("10")
        dist.barrier()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def build(out: str, tp: int, pp: int, ep: int) -> None:
    import torch.multiprocessing as mp

    port = 29000 + os.getpid() % 2000
    mp.start_processes(_build_rank, args=(out, tp, pp, ep, port), nprocs=tp * pp, start_method="fork")


def forward(checkpoints: list[str], ids_file: str, out_file: str) -> None:
    """Load each torch_dist checkpoint into a one-process GPTModel; save {checkpoint: logits}."""
    from megatron.core import dist_checkpointing, parallel_state

    _stand_ins()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{31000 + os.getpid() % 2000}", rank=0,
                            world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    ids = torch.load(ids_file)
    logits = {}
    for checkpoint in checkpoints:
        directory = Path(checkpoint)
        tracker = directory / "latest_checkpointed_iteration.txt"
        if tracker.is_file():
            text = tracker.read_text().strip()
            directory = directory / (text if text == "release" else f"iter_{int(text):07d}")
        common = dist_checkpointing.load_common_state_dict(str(directory))
        args = argparse.Namespace(**{**MOE, **vars(common["args"]), "tensor_model_parallel_size": 1,
                                     "pipeline_model_parallel_size": 1, "expert_model_parallel_size": 1,
                                     "expert_tensor_parallel_size": 1})
        model = gpt_model(args).eval()
        state = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(directory))
        model.load_state_dict(state["model"])
        positions = torch.arange(ids.shape[1]).expand_as(ids)
        causal = torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool).triu(1)[None, None]  # True: masked
        with torch.no_grad():
            logits[checkpoint] = model(ids, positions, attention_mask=causal)
    torch.save(logits, out_file)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("build")
    p.add_argument("out")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1, help="expert parallelism of the MoE families (divides tp)")
    p = commands.add_parser("forward")
    p.add_argument("checkpoints", nargs="+")
    p.add_argument("--ids", required=True)
    p.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.command == "build":
        build(args.out, args.tp, args.pp, args.ep)
    else:
        forward(args.checkpoints, args.ids, args.out)


if __name__ == "__main__":
    sys.exit(main())
