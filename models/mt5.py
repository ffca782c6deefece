"""mT5 (Xue et al., 2021, "mT5: A Massively Multilingual Pre-trained Text-to-Text Transformer"):
T5 1.1's architecture (gated GELU, its own head) with a 250k vocabulary, so T5's classes (t5.py)
with mT5's config; its decoder's output reaches the head unscaled whatever the config says, as
transformers' MT5ForConditionalGeneration does."""

from __future__ import annotations

import transformers

from .t5 import KeepsTiedHead, T5EncoderModel, T5ForConditionalGeneration, T5Model


class MT5Config(KeepsTiedHead, transformers.MT5Config):
    """Hugging Face's MT5Config, its head tied or not as config.json says (false in the hub's)."""


class MT5Model(T5Model):
    """The bare mT5 encoder-decoder."""

    config_class = MT5Config


class MT5EncoderModel(T5EncoderModel):
    """mT5's encoder alone."""

    config_class = MT5Config


class MT5ForConditionalGeneration(T5ForConditionalGeneration):
    """mT5 with its language-model head, never scaling the decoder's output."""

    config_class = MT5Config
    scales_decoder_output = False
