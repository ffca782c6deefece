"""Write a small, randomly initialised Hugging Face model directory with `transformers` itself.

The Hugging Face hub is out of reach on the machines this project is built on, so the fine-tuning
recipes start from one of these; with a real checkpoint, point the recipe at it instead. A text
model's directory holds its tokenizer too, as a hub directory does: the shipped one (data/tokenizer,
whose 8192 ids the model's vocabulary is), with Qwen's ChatML chat template for the Qwen kinds, so
that the recipes' "your own model" commands (model.path and tokenizer_dir the same directory) run
on the stand-in as written.

    python tools/make_tiny_hf_model.py bert output/tiny_bert       # or roberta, and fine-tune it with
                                                                   # projects/bert_finetune model.path=...
    python tools/make_tiny_hf_model.py llama output/tiny_llama --hidden 256 --layers 4
    python tools/make_tiny_hf_model.py qwen3 output/tiny_qwen3
    python tools/make_tiny_hf_model.py qwen3_moe output/tiny_qwen3_moe --experts 8
    python tools/make_tiny_hf_model.py gemma3 output/tiny_gemma3 --layers 6
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import transformers

TOKENIZER = Path(__file__).resolve().parents[1] / "data" / "tokenizer"
VOCAB = 8192  # data/tokenizer
#: Qwen's chat template (ChatML), as the Qwen tokenizers on the hub carry it
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def make_config(kind: str, hidden: int, layers: int, heads: int, experts: int = 8) -> transformers.PretrainedConfig:
    common = dict(num_hidden_layers=layers, num_attention_heads=heads, hidden_size=hidden,
                  intermediate_size=4 * hidden)
    if kind == "bert":
        return transformers.BertConfig(vocab_size=VOCAB, pad_token_id=1, max_position_embeddings=512, **common)
    if kind == "roberta":  # positions from padding_idx + 1: 512 of them, as roberta-base
        return transformers.RobertaConfig(vocab_size=VOCAB, pad_token_id=1, max_position_embeddings=514,
                                          type_vocab_size=1, **common)
    if kind == "llama":
        return transformers.LlamaConfig(vocab_size=VOCAB, num_key_value_heads=max(1, heads // 2), bos_token_id=0,
                                        eos_token_id=0, max_position_embeddings=2048, **common)
    if kind == "qwen3":  # as Qwen3-0.6B: head_dim twice hidden / heads, a tied head (q/k norms are its own)
        return transformers.Qwen3Config(vocab_size=VOCAB, num_key_value_heads=max(1, heads // 2),
                                        head_dim=2 * hidden // heads, tie_word_embeddings=True, bos_token_id=0,
                                        eos_token_id=0, max_position_embeddings=2048, **common)
    if kind == "qwen3_moe":  # as Qwen3-30B-A3B: experts of 3/8 hidden, top 1/16 of them (at least 2), renormalised
        return transformers.Qwen3MoeConfig(vocab_size=VOCAB, num_key_value_heads=max(1, heads // 8),
                                           head_dim=2 * hidden // heads, num_experts=experts,
                                           num_experts_per_tok=max(2, experts // 16),
                                           moe_intermediate_size=3 * hidden // 8, norm_topk_prob=True,
                                           output_router_logits=True, bos_token_id=0, eos_token_id=0,
                                           max_position_embeddings=2048, **common)
    if kind == "gemma3":  # as Gemma 3 270M: one KV head, head_dim twice hidden / heads, 5 sliding layers to 1 full
        return transformers.Gemma3TextConfig(vocab_size=VOCAB, num_key_value_heads=1, head_dim=2 * hidden // heads,
                                             query_pre_attn_scalar=2 * hidden // heads, sliding_window=64,
                                             bos_token_id=0, eos_token_id=0, pad_token_id=0,
                                             max_position_embeddings=2048, **common)
    if kind == "gpt2":
        return transformers.GPT2Config(vocab_size=VOCAB, n_embd=hidden, n_layer=layers, n_head=heads,
                                       bos_token_id=0, eos_token_id=0)
    return transformers.ViTConfig(image_size=8, patch_size=2, num_channels=1, num_labels=10, **common)


MODELS = {"bert": "BertForMaskedLM", "roberta": "RobertaForMaskedLM", "llama": "LlamaForCausalLM",
          "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "gemma3": "Gemma3ForCausalLM", "gpt2": "GPT2LMHeadModel", "vit": "ViTForImageClassification"}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kind", choices=sorted(MODELS), help="which model family")
    parser.add_argument("output_dir", help="where to write config.json and model.safetensors")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--experts", type=int, default=8, help="experts per MoE layer (qwen3_moe)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.manual_seed(args.seed)
    config = make_config(args.kind, args.hidden, args.layers, args.heads, args.experts)
    getattr(transformers, MODELS[args.kind])(config).save_pretrained(args.output_dir)
    if args.kind != "vit":
        tokenizer = transformers.AutoTokenizer.from_pretrained(TOKENIZER)
        if args.kind.startswith("qwen"):
            tokenizer.chat_template = CHATML
        tokenizer.save_pretrained(args.output_dir)
    print(f"wrote a random {MODELS[args.kind]} to {args.output_dir}")


if __name__ == "__main__":
    main()
