import os
import tempfile

import torch

# Multi-process tests fork this process (tests/distributed_runner.py): a parent that has used an
# OpenMP pool can hang its forked children, and on 2 cores one thread per process is fastest.
torch.set_num_threads(1)
# torch.distributed and DTensor may write compile caches; keep them out of the user's /tmp.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="libai_zoo_inductor_"))
