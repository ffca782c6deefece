"""parallel_models.py on the same documents in Megatron's indexed format: their path prefix is the
override dataloader.train.prefixes=[...] (and the cache dataloader.train.cache_dir=...)."""

from libai_zoo.config import LazyCall
from libai_zoo.data import build_indexed_gpt_dataset

from .parallel_models import dataloaders, dist, hf_dir, model, models, optim, train  # noqa: F401 (the config's keys)

dataloader = dict(train=LazyCall(build_indexed_gpt_dataset)(prefixes="???", seq_len=16, cache_dir="???"),
                  test=LazyCall(build_indexed_gpt_dataset)(prefixes="${dataloader.train.prefixes}", seq_len=16,
                                                           cache_dir="${dataloader.train.cache_dir}"))
