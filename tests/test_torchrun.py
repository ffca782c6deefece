"""The launch users run: torchrun starts 2 processes, distributed.init makes the process group from its
environment, and a sharded TransformerLayer gives the unsharded numbers."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import copy, os, torch
    from libai_zoo import distributed, layers

    ctx = distributed.init(tp=2, sequence_parallel=True)
    torch.manual_seed(0)
    attention = layers.AttentionSpec(8, num_kv_heads=4, causal=True, rope_theta=10000.0)
    mlp = layers.MLPSpec(64, activation="silu", gated=True)
    layer = layers.TransformerLayer(layers.LayerSpec(32, attention, mlp, norm="rmsnorm"))
    full = copy.deepcopy(layer)
    x = torch.randn(2, 8, 32)
    distributed.shard(layer)
    local = layer(x.chunk(2, dim=1)[ctx.tp_rank])
    diff = (local - full(x).chunk(2, dim=1)[ctx.tp_rank]).abs().max().item()
    with open(os.path.join(os.environ["RESULTS_DIR"], f"rank{ctx.rank}.txt"), "w") as f:
        f.write(f"owns_pg={ctx.owns_process_group} tp_rank={ctx.tp_rank} diff={diff:.3e}")
    distributed.destroy()
""")


@pytest.mark.slow
@pytest.mark.system
def test_torchrun_two_processes(tmp_path):
    script = tmp_path / "tp2.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, TMPDIR=str(tmp_path), OMP_NUM_THREADS="1", RESULTS_DIR=str(tmp_path))
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", str(script)],
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [(tmp_path / f"rank{r}.txt").read_text() for r in range(2)]
    assert [line.split(" diff=")[0] for line in lines] == ["owns_pg=True tp_rank=0", "owns_pg=True tp_rank=1"]
    assert all(float(line.split("diff=")[1]) <= 1e-5 for line in lines)
