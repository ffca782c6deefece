"""Chat supervised fine-tuning: `build_chat_dataset` labels exactly the assistant's tokens, packs
whole conversations with restarting positions and per-conversation targets, and warns about
truncation; a packed batch trains the zoo's causal LMs exactly as the same conversations padded
one per row (loss and gradients), and the zoo's Llama on a packed batch equals transformers'.
Slow: packed SFT under DefaultTrainer at dp2, tp2 with sequence parallelism and pp2 (the Llama
with LoRA adapters) logs the one-process losses."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
import transformers

from layouts import CHAT_RUNS_AT, LAYOUTS
from layouts import overrides as layout_overrides
from libai_zoo.config import LazyConfig
from libai_zoo.data import build_chat_dataset, check_dataset, load_tokenizer
from libai_zoo.data.chat_dataset import pack_greedily
from libai_zoo.layers import packed_causal_mask
from libai_zoo.models import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, get_layer_stack
from support.cases import Case, Cases
from support.recipes import config_path
from trainer_runs import losses, run_trainer

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = str(ROOT / "data/tokenizer")
SHIPPED = ROOT / "data/chat/python_docs_chat.jsonl"
EOS = "<|endoftext|>"
TEMPLATE = LazyConfig.load(str(ROOT / "projects/llama_sft/config.py")).dataloader.train.chat_template  # marked
UNMARKED = TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
CONVERSATIONS = [
    [{"role": "user", "content": "What does len do?"},
     {"role": "assistant", "content": "Return the number of items in a container."}],
    [{"role": "system", "content": "Answer briefly."},
     {"role": "user", "content": "Summarise: Return the absolute value of the argument."},
     {"role": "assistant", "content": "The absolute value."},
     {"role": "user", "content": "And abs(-3)?"},
     {"role": "assistant", "content": "3, an int."}],
    [{"role": "user", "content": "Say nothing else but yes."},
     {"role": "assistant", "content": "yes"}],
    [{"role": "user", "content": "A long question " + "about many things " * 40 + "?"},
     {"role": "assistant", "content": "A short answer."}],
    [{"role": "user", "content": "Two words?"},
     {"role": "assistant", "content": "Two words " * 30}],
]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture(scope="module")
def chats(tmp_path_factory) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("chats") / "chats.jsonl", [{"messages": c} for c in CONVERSATIONS])


@pytest.fixture(scope="module")
def shipped_sample(tmp_path_factory) -> Path:
    """The first 24 conversations of the shipped chat data."""
    path = tmp_path_factory.mktemp("shipped") / "sample.jsonl"
    path.write_text("".join(SHIPPED.read_text().splitlines(keepends=True)[:24]))
    return path


def build(path: Path, max_length: int, **kwargs):
    return build_chat_dataset(str(path), TOKENIZER, max_length, chat_template=kwargs.pop("chat_template", TEMPLATE),
                              cache_dir=str(path.parent / "cache"), **kwargs)


@pytest.fixture
def logs(caplog):
    """The libai_zoo loggers' records (setup_logging may have turned propagation off)."""
    logger = logging.getLogger("libai_zoo")
    level, propagate = logger.level, logger.propagate
    logger.addHandler(caplog.handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    yield caplog
    logger.removeHandler(caplog.handler)
    logger.setLevel(level)
    logger.propagate = propagate


def runs(mask: torch.Tensor) -> list[tuple[int, int]]:
    """(start, end) of each run of True in a 1-D mask."""
    edges = torch.diff(mask.int(), prepend=torch.zeros(1, dtype=torch.int), append=torch.zeros(1, dtype=torch.int))
    return list(zip(torch.nonzero(edges == 1).flatten().tolist(), torch.nonzero(edges == -1).flatten().tolist()))


# ------------------------------------------------------------------------------------------ data
@pytest.mark.parametrize("template", [TEMPLATE, UNMARKED], ids=["generation_markers", "prefix_rendering"])
def test_labels_are_exactly_the_assistant_tokens(chats, template):
    """Each labelled run decodes to one assistant message and its end-of-turn token, in order; the
    rest decodes to everything else the template rendered."""
    tokenizer = load_tokenizer(TOKENIZER)
    samples = build(chats, 1024, pack=False, chat_template=template)
    assert len(samples) == len(CONVERSATIONS)
    for sample, messages in zip(samples, CONVERSATIONS):
        ids = sample["input_ids"][sample["attention_mask"].bool()]
        labels = sample["labels"][: len(ids)]
        assert (labels[labels != -100] == ids[labels != -100]).all()
        assert (sample["labels"][len(ids):] == -100).all()
        spoken = [tokenizer.decode(ids[a:b]) for a, b in runs(labels != -100)]
        assert spoken == [m["content"] + EOS for m in messages if m["role"] == "assistant"]
        assert tokenizer.decode(ids) == tokenizer.apply_chat_template(messages, chat_template=TEMPLATE,
                                                                      tokenize=False)


def test_prefix_rendering_equals_generation_markers(chats):
    marked, unmarked = build(chats, 1024, pack=False), build(chats, 1024, pack=False, chat_template=UNMARKED)
    for a, b in zip(marked, unmarked):
        assert all(torch.equal(a[key], b[key]) for key in a)


def test_template_that_rewrites_earlier_turns_is_refused(chats):
    """A template that renders the last message differently cannot be labelled by prefixes."""
    rewriting = UNMARKED.replace("message['content'] + eos_token }}\n{%- else %}",
                                 "message['content'] + (eos_token if loop.last else '') }}\n{%- else %}")
    with pytest.raises(ValueError, match="generation %}"):
        build(chats, 1024, chat_template=rewriting)


def test_truncation_is_counted_in_one_warning(chats, logs):
    """Conversations 2, 4 and 5 (75, 149 and 82 tokens) pass 64 tokens; number 4 keeps no assistant
    token and is dropped, the others keep the start of their answers."""
    samples = build(chats, 64, pack=False)[:]
    warnings = [r.getMessage() for r in logs.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "3 of 5 conversations are longer than max_length = 64 tokens and were truncated" in warnings[0]
    assert "1 were dropped" in warnings[0]
    assert samples["input_ids"].shape == (4, 64)
    assert ((samples["labels"] != -100).sum(1) > 0).all()


def test_packing_keeps_conversations_whole_with_restarting_positions(shipped_sample):
    padded, packed = build(shipped_sample, 256, pack=False)[:], build(shipped_sample, 256)
    pad_id = load_tokenizer(TOKENIZER).pad_token_id
    lengths = padded["attention_mask"].sum(1).tolist()
    groups = pack_greedily(lengths, 256)
    assert [i for group in groups for i in group] == list(range(24)) and len(groups) == len(packed) < 24
    assert all(sum(lengths[i] for i in group) <= 256 < sum(lengths[i] for i in group) + lengths[group[-1] + 1]
               for group in groups[:-1])  # greedy: the next conversation did not fit
    for group, sample in zip(groups, packed):
        start = 0
        for i in group:
            n = lengths[i]
            assert torch.equal(sample["input_ids"][start:start + n], padded["input_ids"][i, :n])
            assert torch.equal(sample["position_ids"][start:start + n], torch.arange(n))
            # targets shifted inside the conversation: its last token predicts nothing
            assert torch.equal(sample["shift_labels"][start:start + n - 1], padded["labels"][i, 1:n])
            assert sample["shift_labels"][start + n - 1] == -100
            start += n
        assert (sample["input_ids"][start:] == pad_id).all() and (sample["shift_labels"][start:] == -100).all()
        assert torch.equal(sample["position_ids"][start:], torch.arange(256 - start))
    assert set(packed[0]) == {"input_ids", "position_ids", "shift_labels"}  # no attention_mask: packed
    check_dataset(packed, vocab_size=8192, max_positions=256)
    with pytest.raises(ValueError, match=r"sample\.jsonl \(chat, tokenized with .*max_length = 256"):
        check_dataset(packed, vocab_size=8192, max_positions=128)


def test_tokenized_once_then_read_from_the_cache(shipped_sample):
    """A second build reads datasets' cache files (writes none); num_proc processes tokenize alike."""
    def arrow_files() -> dict[Path, int]:
        return {f: f.stat().st_mtime_ns for f in (shipped_sample.parent / "cache").rglob("*.arrow")}

    build(shipped_sample, 256)
    written = arrow_files()
    again = build(shipped_sample, 256)
    assert {Path(f["filename"]) for f in again.cache_files} <= set(written) and arrow_files() == written
    one, two = build(shipped_sample, 256, pack=False)[:], build(shipped_sample, 256, pack=False, num_proc=2)[:]
    assert all(torch.equal(one[key], two[key]) for key in one)


def test_pack_greedily_never_splits_and_keeps_order():
    assert pack_greedily([3, 4, 2, 5, 1, 5], 7) == [[0, 1], [2, 3], [4, 5]]
    assert pack_greedily([7, 7], 7) == [[0], [1]]


def test_missing_messages_column_names_the_columns(tmp_path):
    path = write_jsonl(tmp_path / "chats.jsonl", [{"conversation": CONVERSATIONS[0], "id": 1}])
    with pytest.raises(ValueError, match=r"no column 'messages'.*\['conversation', 'id'\]"):
        build(path, 64)
    assert len(build(path, 64, messages_column="conversation")) == 1


def test_bad_arguments_name_the_fix(chats):
    with pytest.raises(ValueError, match="has no chat template: pass chat_template="):
        build_chat_dataset(str(chats), TOKENIZER, 64)
    with pytest.raises(ValueError, match="not a stream: leave streaming out"):
        build(chats, 64, streaming=True)


# --------------------------------------------------------------------------------------- models
def test_packed_mask_follows_transformers_segments():
    """The sequences transformers finds in position ids are the blocks of the mask; one sequence
    per row gives None (SDPA's is_causal path); an attention_mask is kept as given."""
    from transformers.masking_utils import find_packed_sequence_indices

    positions = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 1]])
    segments = find_packed_sequence_indices(positions)
    expected = (segments[:, :, None] == segments[:, None, :]) & torch.ones(6, 6, dtype=torch.bool).tril()
    assert torch.equal(packed_causal_mask(None, positions), expected[:, None])
    assert packed_causal_mask(None, torch.arange(6)[None].expand(2, -1)) is None
    padding = torch.ones(2, 6, dtype=torch.long)
    assert packed_causal_mask(padding, positions) is padding


def tiny(kind: str):
    torch.manual_seed(0)
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(vocab_size=8192, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, bos_token_id=0,
                                            eos_token_id=0))
    return GPT2LMHeadModel(GPT2Config(vocab_size=8192, n_positions=256, n_embd=32, n_layer=2, n_head=4,
                                      bos_token_id=0, eos_token_id=0, embd_pdrop=0.0, attn_pdrop=0.0,
                                      resid_pdrop=0.0))


def sharpened(model):
    """`model` with weights drawn N(0, 0.3): attention far from uniform, so a token that saw another
    conversation would change the loss and the gradients."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.normal_(0.0, 0.3, generator=generator)
    return model


def loss_and_grads(model, batch: dict) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad()
    loss = model(**batch).loss
    loss.backward()
    return loss.item(), {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_packed_batch_trains_as_the_padded_batch(shipped_sample, kind):
    """Same conversations, packed (several per row, block-diagonal attention) or one per padded
    row: the same mean loss over the same targets and the same gradients, in float32 (without the
    block mask they differ by 3e-4 and 0.04-0.09); the pipeline's path (embed, layers with
    layer_inputs, head_loss) gives the packed loss too."""
    model = sharpened(tiny(kind))
    padded, packed = build(shipped_sample, 256, pack=False)[:], build(shipped_sample, 256)[:]
    assert (padded["labels"][:, 1:] != -100).sum() == (packed["shift_labels"] != -100).sum()
    loss_padded, grads_padded = loss_and_grads(model, padded)
    loss_packed, grads_packed = loss_and_grads(model, packed)
    assert abs(loss_packed - loss_padded) <= 1e-6 * loss_padded
    worst = max((grads_packed[n] - grads_padded[n]).abs().max().item() for n in grads_padded)
    assert worst <= 1e-6, worst
    inputs, targets = model.split_batch(packed)
    with torch.no_grad():
        hidden = model.embed(inputs)
        for layer in get_layer_stack(model):
            hidden = layer(hidden, **model.layer_inputs(inputs))
        summed = model.head_loss(model.final_norm(hidden), targets, reduction="sum")
    assert abs(summed.item() / model.num_loss_targets(targets).item() - loss_packed) <= 1e-6 * loss_packed


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_packed_batch_equals_transformers(shipped_sample, tmp_path, kind):
    """transformers' own model (no cache, no attention_mask: its packed-sequence path) on the same
    packed batch: equal logits."""
    torch.manual_seed(0)
    if kind == "llama":
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=8192, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, rope_theta=10000.0, tie_word_embeddings=False)).eval()
    else:
        hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=8192, n_positions=256, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0)).eval()
    hf.save_pretrained(tmp_path)
    zoo = type(tiny(kind)).from_pretrained(tmp_path, dtype="float32").eval()
    packed = build(shipped_sample, 256)[:4]
    assert (packed["position_ids"][:, 1:] == 0).any(axis=1).all()  # several conversations per row
    with torch.no_grad():
        theirs = hf(input_ids=packed["input_ids"], position_ids=packed["position_ids"], use_cache=False).logits
        ours = zoo(input_ids=packed["input_ids"], position_ids=packed["position_ids"]).logits
        # an attention_mask turns packing off (transformers' rule): rows attend across conversations
        unpacked = zoo(input_ids=packed["input_ids"], position_ids=packed["position_ids"],
                       attention_mask=torch.ones_like(packed["input_ids"])).logits
    assert (ours - theirs).abs().max().item() <= 1e-5
    assert (unpacked - theirs).abs().max().item() > 1e-2


# ----------------------------------------------------------------------- trainer, multi-process
STEPS, GLOBAL_BATCH, TOL = 4, 8, 1e-5
CONFIG = str(config_path("chat_models.py"))  # its llama and gpt2: `train` picks one
# The covering design (tests/layouts.py): packed data differs where positions restart and
# conversations are masked apart, under sequence parallelism (split sequences), context parallelism
# (conversations cut over ranks, each attending within itself by global position; a rank's part may
# hold no assistant token), a pipeline and dp; the Llama runs train LoRA adapters too (LoRA and
# packing are independent: one run covers both).
LORA = ["train.lora.rank=4", "train.lora.alpha=8"]


def train(config_file: str, output_dir: str, model: str, overrides: list[str]) -> dict[int, float]:
    cfg = LazyConfig.load(config_file)
    cfg.model = cfg.models[model]
    cfg = LazyConfig.apply_overrides(cfg, [
        f"train.output_dir={output_dir}", f"train.max_iter={STEPS}", f"train.global_batch_size={GLOBAL_BATCH}",
        "train.log_period=1", "train.checkpoint.period=null", "optim.lr=3e-3", *overrides,
        *(LORA if model == "llama" else [])])
    run_trainer(cfg)
    return losses(Path(output_dir))


def _run(root: str, model: str, layout: str) -> dict[int, float]:
    return train(CONFIG, f"{root}/{model}_{layout}", model, [
        f"dataloader.train.path={root}/chats.jsonl", f"dataloader.train.cache_dir={root}/cache",
        *layout_overrides(layout)])


def setup(root: Path) -> None:
    data = root / "chats.jsonl"
    data.write_text("".join(SHIPPED.read_text().splitlines(keepends=True)[:96]))


CASES = {  # the references run first: they also fill the data cache the workers read
    **{f"one_{model}": Case(1, _run, (model, "one")) for model in ("llama", "gpt2")},
    **{name: Case(LAYOUTS[layout].world_size, _run, (model, layout), needs=(f"one_{model}",))
       for name, (model, layout) in CHAT_RUNS_AT.items()},
}
RUNS = Cases(__file__, CASES, setup)
sft_runs = RUNS.fixture("sft_runs")


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CHAT_RUNS_AT))
def test_packed_sft_trains_alike_at_every_layout(sft_runs, case):
    expected, logged = sft_runs(f"one_{CHAT_RUNS_AT[case][0]}"), sft_runs(case)
    assert sorted(logged) == list(range(1, STEPS + 1))
    worst = max(abs(logged[i] - expected[i]) / abs(expected[i]) for i in logged)
    assert worst <= TOL, (worst, logged, expected)
