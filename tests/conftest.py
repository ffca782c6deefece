import os
import tempfile

# The suite is CPU + gloo by design (CI has no GPU): on a GPU host, hide the GPU before torch
# looks for it, so distributed.init picks gloo and the forked workers never touch CUDA.
os.environ["CUDA_VISIBLE_DEVICES"] = ""

import torch  # noqa: E402

# Multi-process tests fork this process (tests/distributed_runner.py): a parent that has used an
# OpenMP pool can hang its forked children, and on 2 cores one thread per process is fastest.
torch.set_num_threads(1)
# torch.distributed and DTensor may write compile caches; keep them out of the user's /tmp.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="libai_zoo_inductor_"))
