"""The end-of-run sample (`GenerateSample`) follows the run's layout: at dp4 ZeRO-3 every rank
holds its shard plus one layer as FSDP gathers it, never the whole model, the root's tables or two
layers, and rank 0 no more than the others (at ZeRO-1 too); the text is the one-process text.

Counted by tensor accounting (`TensorMemoryPeak`, as tests/test_startup_memory.py) on 4 gloo
processes, for a GPT-2 (tied head, learned positions) and a Llama (untied head, rotary) whose
8192-token tables are 4-10 times a layer: gathering one of them, or the next layer ahead (FSDP's
prefetch), breaks the bound.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from distributed_runner import run_distributed
from libai_zoo import distributed
from libai_zoo.config import LazyConfig
from libai_zoo.engine import DefaultTrainer, GenerateSample
from libai_zoo.models import get_layer_stack
from libai_zoo.utils import TensorMemoryPeak

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
#: One layer as FSDP gathers it is twice its bytes for a moment (the flat all-gather buffer and the
#: layer's parameters); the allowance holds the KV cache, one token's activations and logits.
LAYER_COPIES, ALLOWANCE = 2, 256 * 1024

CONFIG = '''
from libai_zoo.config import LazyCall, get_config
from libai_zoo.models import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
from recorded_data import RecordedTokens

train = get_config("common/train.py").train
dist = get_config("common/train.py").dist
optim = get_config("common/optim.py").optim
gpt2 = LazyCall(GPT2LMHeadModel)(config=LazyCall(GPT2Config)(
    vocab_size=8192, n_positions=64, n_embd=64, n_layer=4, n_head=4, bos_token_id=0, eos_token_id=0))
llama = LazyCall(LlamaForCausalLM)(config=LazyCall(LlamaConfig)(
    vocab_size=8192, hidden_size=128, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
    num_key_value_heads=4, max_position_embeddings=64, bos_token_id=0, eos_token_id=0))
model = gpt2
dataloader = dict(train=LazyCall(RecordedTokens)(num_samples=16, seq_len=16, vocab_size=8192,
                                                 record_dir="${train.output_dir}/samples"))
'''


def sample(config_file: str, output_dir: str, name: str, overrides: list[str]) -> dict:
    """The sample hook after 0 steps under tensor accounting: its peak, this rank's shard, the
    largest layer's and table's full bytes, the text."""
    cfg = LazyConfig.load(config_file)
    cfg.model = cfg[name]
    cfg = LazyConfig.apply_overrides(cfg, [f"train.output_dir={output_dir}", "train.max_iter=0", *overrides])
    try:
        trainer = DefaultTrainer(cfg)
        hook = GenerateSample(tokenizer=str(ROOT / "data/tokenizer"), prompt="Return the", max_new_tokens=4)
        hook.trainer, trainer.iter = trainer, 0
        with TensorMemoryPeak() as peak:
            hook.after_train()
        full = {n: p.full_tensor() if hasattr(p, "full_tensor") else p for n, p in trainer.model.named_parameters()}
        layers = [{id(p) for p in layer.parameters()} for layer in get_layer_stack(trainer.model)]
        in_layers = set().union(*layers)
        by_id = {id(p): full[n] for n, p in trainer.model.named_parameters()}
        return {"peak": peak.bytes, "text": hook.text,
                "layer": max(sum(by_id[i].nbytes for i in layer) for layer in layers),
                "table": max(t.nbytes for i, t in by_id.items() if i not in in_layers)}
    finally:
        distributed.destroy()


#: (model, ZeRO stage) at dp4: ZeRO 1 keeps a layer gathered after its training forward, the sample does not.
CASES = [("gpt2", 3), ("llama", 3), ("gpt2", 1)]


def _dp4(config_file: str, out: str) -> dict:
    return {(name, zero): sample(config_file, f"{out}/{name}_{zero}", name, [
        "dist.dp=4", f"train.zero_stage={zero}", "train.micro_batch_size=1", "train.global_batch_size=4"])
        for name, zero in CASES}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("sample")
    config_file = root / "config.py"
    config_file.write_text(CONFIG)
    one = {name: sample(str(config_file), str(root / f"one_{name}"), name,
                        ["train.micro_batch_size=4", "train.global_batch_size=4"]) for name in ("gpt2", "llama")}
    return one, run_distributed(_dp4, 4, str(config_file), str(root))


@pytest.mark.parametrize("case", CASES, ids=[f"{name}_zero{zero}" for name, zero in CASES])
def test_the_sample_holds_one_layer_at_a_time_on_every_rank(runs, case):
    one, ranks = runs
    name = case[0]
    layer, table = ranks[0][case]["layer"], ranks[0][case]["table"]
    bound = LAYER_COPIES * layer + ALLOWANCE  # new bytes on top of the shard each rank already holds
    peaks = [rank[case]["peak"] for rank in ranks]
    assert max(peaks) <= bound, (case, peaks, layer)
    assert max(peaks) - min(peaks) <= 16 * 1024, peaks  # rank 0 holds what the others hold
    assert table > bound and 2 * layer > ALLOWANCE  # a gathered table, or a second layer, breaks the bound
    assert all(rank[case]["text"] == one[name]["text"] for rank in ranks), (one[name]["text"], ranks[0][case]["text"])
