"""Autoregressive generation with a KV cache, for the causal language models of the zoo and its
encoder-decoders (T5: the encoder runs once, its keys and values are projected once per
cross-attention, and the decoder runs one new token per step).

Greedy decoding picks the most likely token; sampling applies temperature, then top-k, then
top-p (nucleus) filtering, in the order transformers applies them. Under tensor parallelism
every rank runs the loop on the same gathered logits; the LM head makes the ranks agree on a
sampled token (`LMHead.agree`), so all continue with the same sequence. A LongRoPE model
(Phi-3) drops its cache once the sequence passes the original context and runs the whole
sequence again with the long factors, as transformers' Phi-3 does.
"""

from __future__ import annotations

import torch

from libai_zoo.layers import EncoderDecoderCache, KVCache, ParallelLayer, RotaryEmbedding


class GenerationMixin:
    """Adds `generate` to a model whose forward takes ``cache`` (one `KVCache` per layer),
    ``position_ids`` and ``logits_to_keep`` and returns ``.logits``, and whose head is
    ``lm_head`` (a `layers.LMHead`)."""

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                 max_new_tokens: int = 20, do_sample: bool = False, temperature: float = 1.0,
                 top_k: int | None = None, top_p: float | None = None, eos_token_id: int | None = None,
                 pad_token_id: int | None = None) -> torch.Tensor:
        """input_ids [B, S] (left-padded if their lengths differ, with attention_mask 0 on the
        padding) -> [B, S + new] ids. Stops early once every sequence has produced
        ``eos_token_id`` (default: the config's); finished sequences continue with
        ``pad_token_id`` (default: the config's, else eos)."""
        _refuse_sequence_parallel(self)
        eos_token_id, pad_token_id = _special_tokens(self.config, eos_token_id, pad_token_id)
        batch, length = input_ids.shape
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.to(input_ids.dtype)
        caches = [KVCache(length + max_new_tokens) for _ in range(self.config.num_hidden_layers)]
        switch = min((m.switch_length for m in self.modules() if isinstance(m, RotaryEmbedding)
                      and m.switch_length), default=None)  # LongRoPE's original context
        positions = _positions(mask)
        tokens, step_ids = input_ids, input_ids
        unfinished = torch.ones(batch, dtype=torch.bool, device=input_ids.device)
        for _ in range(max_new_tokens):
            if switch is not None and 0 < caches[0].length <= switch < tokens.shape[1]:
                # LongRoPE's frequencies change past `switch`: as transformers, the cache made with the
                # short ones is dropped once and the whole sequence run again (with the long ones)
                caches = [KVCache(length + max_new_tokens) for _ in caches]
                step_ids, positions = tokens, _positions(mask)
            logits = self(step_ids, attention_mask=mask, position_ids=positions, cache=caches,
                          logits_to_keep=1).logits[:, -1].float()
            next_ids = _next_tokens(self, logits, unfinished, do_sample, temperature, top_k, top_p, eos_token_id,
                                    pad_token_id)
            tokens = torch.cat([tokens, next_ids[:, None]], dim=1)
            mask = torch.cat([mask, mask.new_ones(batch, 1)], dim=1)
            step_ids, positions = next_ids[:, None], positions[:, -1:] + 1
            if not unfinished.any():
                break
        return tokens


class Seq2SeqGenerationMixin:
    """Adds `generate` to an encoder-decoder whose ``encode(input_ids, attention_mask)`` gives the
    encoder's output, whose forward takes ``decoder_input_ids``, ``encoder_outputs``,
    ``attention_mask`` and ``cache`` (an `EncoderDecoderCache` for ``config.num_decoder_layers``
    layers) and returns ``.logits``, and whose head is ``lm_head`` (a `layers.LMHead`)."""

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                 max_new_tokens: int = 20, do_sample: bool = False, temperature: float = 1.0,
                 top_k: int | None = None, top_p: float | None = None, eos_token_id: int | None = None,
                 pad_token_id: int | None = None, decoder_start_token_id: int | None = None) -> torch.Tensor:
        """input_ids [B, S] (padded on either side, attention_mask 0 there) -> the decoder's ids
        [B, 1 + new]: ``decoder_start_token_id`` (default: the config's), then the new tokens, as
        transformers returns them. The encoder runs once; each step runs the decoder on the newest
        token, its self-attentions reading their caches and its cross-attentions the encoder's keys
        and values, projected at the first step. Stops and pads as `GenerationMixin.generate`."""
        _refuse_sequence_parallel(self)
        eos_token_id, pad_token_id = _special_tokens(self.config, eos_token_id, pad_token_id)
        if decoder_start_token_id is None:
            decoder_start_token_id = getattr(self.config, "decoder_start_token_id", None)
        if decoder_start_token_id is None:
            raise ValueError("generation needs the decoder's first token: pass decoder_start_token_id or set it in "
                             "the config (T5's is its pad token, 0)")
        batch, length = input_ids.shape
        encoder_outputs = (self.encode(input_ids, attention_mask),)
        cache = EncoderDecoderCache.empty(self.config.num_decoder_layers, 1 + max_new_tokens, length)
        tokens = input_ids.new_full((batch, 1), decoder_start_token_id)
        unfinished = torch.ones(batch, dtype=torch.bool, device=input_ids.device)
        for _ in range(max_new_tokens):
            logits = self(attention_mask=attention_mask, decoder_input_ids=tokens[:, -1:],
                          encoder_outputs=encoder_outputs, cache=cache).logits[:, -1].float()
            next_ids = _next_tokens(self, logits, unfinished, do_sample, temperature, top_k, top_p, eos_token_id,
                                    pad_token_id)
            tokens = torch.cat([tokens, next_ids[:, None]], dim=1)
            if not unfinished.any():
                break
        return tokens


def _refuse_sequence_parallel(model: torch.nn.Module) -> None:
    """A ValueError naming the fix when `model` runs under sequence parallelism."""
    if any(isinstance(m, ParallelLayer) and m.sp for m in model.modules()):
        raise ValueError("generate does not run under sequence parallelism (new tokens come one at a "
                         "time): generate inside `with distributed.whole_sequences(model):`, which lifts it, or "
                         "shard the model with distributed.shard(model, sequence_parallel=False)")


def _special_tokens(config, eos_token_id: int | None, pad_token_id: int | None) -> tuple[int | None, int | None]:
    """(eos, pad): the given ones, else the config's; pad defaults to eos."""
    if eos_token_id is None:
        eos_token_id = getattr(config, "eos_token_id", None)
    if isinstance(eos_token_id, list):
        eos_token_id = eos_token_id[0]
    if pad_token_id is None:
        pad_token_id = getattr(config, "pad_token_id", None)
        pad_token_id = eos_token_id if pad_token_id is None else pad_token_id
    if eos_token_id is not None and pad_token_id is None:
        raise ValueError("generation that stops at eos_token_id needs a pad_token_id for finished sequences")
    return eos_token_id, pad_token_id


def _next_tokens(model, logits: torch.Tensor, unfinished: torch.Tensor, do_sample: bool, temperature: float,
                 top_k: int | None, top_p: float | None, eos_token_id: int | None,
                 pad_token_id: int | None) -> torch.Tensor:
    """Each sequence's next token from its last logits [B, V] (greedy, or sampled and agreed on
    over tp); a finished sequence's is the pad token. Marks the sequences that produced eos
    finished in `unfinished` (in place)."""
    if do_sample:
        next_ids = torch.multinomial(_filter(logits, temperature, top_k, top_p).softmax(-1), 1).squeeze(-1)
        next_ids = model.lm_head.agree(next_ids)
    else:
        next_ids = logits.argmax(-1)
    if eos_token_id is not None:
        next_ids = torch.where(unfinished, next_ids, pad_token_id)
        unfinished &= next_ids != eos_token_id
    return next_ids


def _positions(mask: torch.Tensor) -> torch.Tensor:
    """Positions that count real tokens only, so a left-padded prompt starts at position 0 (as
    transformers does)."""
    return (mask.cumsum(-1) - 1).masked_fill_(mask == 0, 1)


def _filter(logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """Scale by temperature, keep the top_k most likely tokens, then the smallest set whose
    probability reaches top_p; the others get -inf."""
    if temperature <= 0:
        raise ValueError(f"temperature = {temperature} must be positive (use do_sample=False for greedy)")
    logits = logits / temperature
    if top_k:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        before = sorted_logits.softmax(-1).cumsum(-1) - sorted_logits.softmax(-1)  # mass of the more likely ones
        drop_sorted = before >= top_p  # the most likely token always stays
        logits = logits.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
    return logits
