"""The covering design of the multi-process tests holds: every registered layout trains some
model, and each model or feature's few layouts still cover every axis its parts change."""

from __future__ import annotations

from layouts import (
    CHAT_RUNS_AT,
    CP_LAYOUTS,
    CP_RESUME_AT,
    FAMILY_LAYOUTS,
    GPT2_LAYOUTS,
    INDEXED_LAYOUTS,
    LAYOUTS,
    LLAMA_LAYOUTS,
    LLAMA_SHAPED_LAYOUTS,
    LORA_RUNS_AT,
    MOE_LAYOUTS,
    MOE_RESUME_AT,
    RESUME_AT,
    TRAINED,
    axes,
    covered,
)


def test_every_layout_trains_and_every_name_is_registered():
    base = set(GPT2_LAYOUTS)
    lora = {layout for _, layout, _ in LORA_RUNS_AT}
    chat = {layout for _, layout in CHAT_RUNS_AT.values()}
    trained = {layout for layouts in TRAINED.values() for layout in layouts}
    moe = set(MOE_LAYOUTS)
    used = base | lora | chat | trained | set(RESUME_AT) | set(
        MOE_RESUME_AT) | set(CP_RESUME_AT)
    assert used <= set(LAYOUTS)
    llama = set(LLAMA_LAYOUTS)
    assert base | lora | moe | llama == set(LAYOUTS) - {"one"}


def test_each_model_and_feature_covers_the_axes_it_changes():
    parallel = {"dp", "tp", "sp", "pp", "zero3", "world2", "world4"}
    llama = covered(LLAMA_SHAPED_LAYOUTS)
    assert parallel | {"zero0", "ac", "accumulation", "1f1b", "interleaved_1f1b", "zero_bubble", "virtual"} <= llama
    lora = covered(layout for _, layout, _ in LORA_RUNS_AT) | axes("tp2_sp")  # + test_chat_sft's
    assert parallel | {"zero0", "zero1", "zero2", "1f1b", "zero_bubble", "interleaved_1f1b", "virtual"} <= lora
    assert {"dp", "sp", "pp"} <= covered(layout for _, layout in CHAT_RUNS_AT.values())
    assert {"dp", "pp"} <= covered(INDEXED_LAYOUTS)
    for family, layouts in FAMILY_LAYOUTS.items():
        assert {"pp", "zero3"} <= covered(layouts), family
    assert {"tp", "pp", "zero1", "zero3", "virtual", "world1", "world4", "world8"} <= covered(
        RESUME_AT)
    # context parallelism alone, with tp and SP, ZeRO-3 over dp × cp with accumulation, a pipeline, cp4; chat
    # data and LoRA under it; a checkpoint saved under it resumed at another cp
    assert {"cp", "dp", "tp", "sp", "pp", "zero3", "accumulation", "1f1b", "world2", "world4"} <= covered(
        CP_LAYOUTS)
    assert "cp" in covered(layout for _, layout in CHAT_RUNS_AT.values())
    assert "cp" in covered(CP_RESUME_AT)
    # expert parallelism alone, over dp groups with ZeRO-3, borrowing tp ranks, in a pipeline, on 2 and 4 ranks
    assert {"ep", "dp", "tp", "pp", "zero0", "zero3", "1f1b", "world2", "world4"} <= covered(
        MOE_LAYOUTS)


def test_the_base_model_covers_every_axis():
    """Every axis but expert parallelism, which only a Mixture of Experts has."""
    assert covered(GPT2_LAYOUTS) == covered(name for name in LAYOUTS if name != "one") - {"ep"}
