"""Each family's distinguishing features matter in its test: with one switched off in the zoo's
layers, the logits leave transformers' by far more than the parity tolerance. A parity test whose
case did not exercise the feature (a window longer than the sequence, norms left at 1) would pass
either way; this one fails then.

FEATURES: (case in model_cases.CASES, what is dropped, how): `how` patches the zoo's class for the
duration of one forward (monkeypatch) and the model is built after it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from libai_zoo import layers
from libai_zoo.models.decoder import DecoderSpec
from model_cases import CASES, GEMMA3_GLOBAL_BASE, make_hf_model, make_inputs

MIN_EFFECT = 1e-3  # far above the 1e-5 of the parity tests


def _without_kwarg(cls, key: str, value=None):
    """cls.__init__ with keyword `key` forced to `value` (the feature off)."""
    init = cls.__init__

    def patched(self, *args, **kwargs):
        if key in kwargs:
            kwargs[key] = value
        init(self, *args, **kwargs)
    return "__init__", patched


def _norm_qk_per_head(self, q, k):
    """q and k [B, S, groups, heads, d] normalised over each head, with the projection norm's weights."""
    def norm(x, layer):
        return F.rms_norm(x, (x.shape[-1],), eps=layer.eps) * layer.weight.view(x.shape[2:])
    return norm(q, self.q_norm), norm(k, self.k_norm)


FEATURES = {
    ("qwen3", "per-head q/k norms"): (layers.Attention, ("_norm_qk", lambda self, q, k: (q, k))),
    ("qwen3", "sliding window on layer 2"): (layers.Attention, _without_kwarg(layers.Attention, "sliding_window")),
    ("mistral", "sliding window"): (layers.Attention, _without_kwarg(layers.Attention, "sliding_window")),
    ("pythia", "parallel residual"): (layers.TransformerLayer,
                                      _without_kwarg(layers.TransformerLayer, "parallel_block", False)),
    ("olmo2", "norms on the branch outputs"): (layers.TransformerLayer,
                                                ("_residual", lambda self, x, branch, out_norm: x + branch)),
    ("olmo2", "q/k norms over the whole projection"): (layers.Attention, ("_norm_qk", _norm_qk_per_head)),
    ("gemma", "(1 + w) norms"): (layers.RMSNorm, _without_kwarg(layers.RMSNorm, "unit_offset", False)),
    ("gemma", "embedding × sqrt(hidden)"): (DecoderSpec, _without_kwarg(DecoderSpec, "embedding_multiplier", 1.0)),
    ("gemma2", "sandwich norms"): (layers.TransformerLayer,
                                   ("_residual", lambda self, x, branch, out_norm: x + branch)),
    ("gemma2", "attention soft-cap"): (layers.Attention, _without_kwarg(layers.Attention, "softcap")),
    ("gemma2", "final-logit soft-cap"): (layers.LMHead, _without_kwarg(layers.LMHead, "logit_softcap")),
    ("gemma2", "query_pre_attn_scalar"): (layers.Attention, _without_kwarg(layers.Attention, "softmax_scale")),
    ("gemma2", "sliding window on layer 1"): (layers.Attention, _without_kwarg(layers.Attention, "sliding_window")),
    ("gemma3", "per-head (1 + w) q/k norms"): (layers.Attention, ("_norm_qk", lambda self, q, k: (q, k))),
    ("gemma3", "local rope base"): (layers.TransformerLayer,
                                    _without_kwarg(layers.TransformerLayer, "rope_theta", GEMMA3_GLOBAL_BASE)),
    ("gemma3", "global rope scaling"): (layers.TransformerLayer,
                                        _without_kwarg(layers.TransformerLayer, "rope_scaling")),
}


@pytest.mark.parametrize("case,feature", list(FEATURES), ids=[f"{c}-{f}" for c, f in FEATURES])
def test_dropping_the_feature_changes_the_logits(case, feature, tmp_path, monkeypatch):
    hf = make_hf_model(CASES[case])
    hf.save_pretrained(tmp_path)
    inputs, mask = make_inputs(CASES[case])
    cls, (attribute, replacement) = FEATURES[case, feature]
    monkeypatch.setattr(cls, attribute, replacement)
    zoo = CASES[case].zoo_class.from_pretrained(tmp_path)
    with torch.no_grad():
        effect = (zoo(**inputs).logits[mask] - hf(**inputs).logits[mask]).abs().max().item()
    assert effect > MIN_EFFECT, f"{case} without its {feature}: logits within {effect:.2e} of transformers'"
