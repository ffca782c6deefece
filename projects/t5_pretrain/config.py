"""Pretrain a tiny T5 (1.1: gated GELU, untied head) by span corruption on the shipped corpus, on CPU.

    python tools/train.py projects/t5_pretrain/config.py
    torchrun --nproc_per_node=4 tools/train.py projects/t5_pretrain/config.py dist.dp=2 dist.pp=2 \
        train.zero_stage=3 train.micro_batch_size=4 train.output_dir=output/t5_pretrain_pp   # encoder, then decoder stage

Each 141-token window of the Python docstrings loses 15% of its tokens in spans of mean length 3: the
encoder reads the rest (128 tokens, a sentinel `<extra_id_N>` in place of each span), the decoder
writes the spans after their sentinels (29 tokens). After training it fills in a held-out sentence.
"""

from libai_zoo.config import LazyCall
from libai_zoo.data import build_span_corruption_dataset, sentinel_tokenizer
from libai_zoo.engine import GenerateSample
from libai_zoo.models import T5Config, T5ForConditionalGeneration

from ..gpt2_pretrain.config import dist, optim, train  # noqa: F401  (config keys: its training, 400 steps)

model = LazyCall(T5ForConditionalGeneration)(
    config=LazyCall(T5Config)(
        vocab_size=8292,            # data/tokenizer's 8192 and its 100 sentinels
        d_model=128,
        d_kv=32,
        num_heads=4,
        d_ff=512,
        num_layers=3,
        num_decoder_layers=3,
        feed_forward_proj="gated-gelu",
        tie_word_embeddings=False,
        dropout_rate=0.0,
        initializer_factor=0.1,     # T5 draws its untied head at std 1: logits of std ~sqrt(d_model) at step 0
        pad_token_id=1,             # [PAD]; the decoder starts from it, as T5's does
        eos_token_id=0,             # <|endoftext|>
        decoder_start_token_id=1,
    )
)

span_corruption = dict(tokenizer_dir="data/tokenizer", input_length=128, cache_dir="output/cache")
dataloader = dict(
    train=LazyCall(build_span_corruption_dataset)(path="data/corpus/python_docs.txt", **span_corruption),
    test=LazyCall(build_span_corruption_dataset)(path="data/corpus/python_docs_valid.txt", **span_corruption),
    num_workers=0,
)

optim.lr = 3e-3
train.output_dir = "output/t5_pretrain"

# After training, the model fills in the spans of a held-out sentence.
hooks = [LazyCall(GenerateSample)(tokenizer=LazyCall(sentinel_tokenizer)(tokenizer_dir="data/tokenizer"),
                                  prompt="Return the <extra_id_0> of the <extra_id_1> as a string.",
                                  max_new_tokens=20)]
