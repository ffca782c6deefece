"""The store a process group is made from: a fresh one for every torchrun attempt.

torchrun (static, standalone and c10d rendezvous alike) hands its workers one TCPStore that the
agent keeps for the whole job (``TORCHELASTIC_USE_AGENT_STORE=True``). After a restart the new
workers find the old attempt's keys in it: gloo reads the dead workers' addresses and fails with
"Connection refused", or the new group waits forever for keys it will never get. Nor is the restart
count a safe prefix: under c10d with several nodes, only the failed node's agent counts the restart.

So rank 0 of each attempt opens a store of its own on a free port and publishes the port, with a
random token, in the agent's store; the others connect to the port they read there and check the
token in the store they reached. A port left by an earlier attempt belongs to a dead process and
refuses the connection (or, reused by another store, holds no such token), so a worker retries
until it reads the new one. The process group then starts from a store that only this attempt's
workers have seen, and the token names the attempt's heartbeats.
"""

from __future__ import annotations

import datetime
import os
import secrets
import time

import torch.distributed as dist

PORT_KEY = "libai_zoo/process_group_store"  # "port token" of this attempt's store
TOKEN_KEY = "libai_zoo/attempt_token"
PROGRESS_PREFIX = "libai_zoo/progress"
CONNECT_TIMEOUT = datetime.timedelta(seconds=2)  # a stale port refuses at once; a live one answers in ms


def shares_agent_store() -> bool:
    """True in a torchrun worker whose agent keeps the job's store across restarts."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


_progress: dist.Store | None = None  # where this attempt's workers leave their heartbeats


def attempt_store(rank: int, world_size: int, timeout: datetime.timedelta) -> dist.Store:
    """A store only this attempt's workers use (every worker calls it; rank 0 hosts it)."""
    global _progress
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    agent = dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    if rank == 0:
        store = dist.TCPStore(host, 0, world_size, is_master=True, timeout=timeout, wait_for_workers=False)
        token = secrets.token_hex(8)
        store.set(TOKEN_KEY, token)
        agent.set(PORT_KEY, f"{store.port} {token}")
        _progress = dist.PrefixStore(f"{PROGRESS_PREFIX}/{token}", agent)
        return store
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        port, token = agent.get(PORT_KEY).decode().split()  # waits until an attempt's rank 0 has published one
        published = int(port)
        try:
            store = dist.TCPStore(host, published, world_size, is_master=False, timeout=CONNECT_TIMEOUT)
            if store.get(TOKEN_KEY).decode() != token:
                raise RuntimeError(f"port {published} is another store")
        except (RuntimeError, TimeoutError) as error:  # an earlier attempt's port: its process is gone
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {rank} found no process-group store of this attempt at {host} within "
                                   f"{timeout.total_seconds():.0f} s (last port tried {published}: {error}); "
                                   f"is rank 0 running? raise dist.init_timeout if start-up is slow") from error
            time.sleep(0.2)
            continue
        store.set_timeout(timeout)
        _progress = dist.PrefixStore(f"{PROGRESS_PREFIX}/{token}", agent)
        return store


def progress_store() -> dist.Store | None:
    """Where ranks leave their heartbeats: torchrun's agent store when there is one (it outlives a
    stopped or dead worker, rank 0 included), under this attempt's prefix; else the process
    group's store; None without a process group."""
    if _progress is not None:
        return _progress
    if dist.is_initialized():
        return dist.PrefixStore(PROGRESS_PREFIX, dist.distributed_c10d._get_default_store())
    return None


def forget() -> None:
    """Drop this attempt's heartbeat store (the process group is being torn down)."""
    global _progress
    _progress = None
