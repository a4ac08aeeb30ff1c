"""Device mapping: which GPUs a stage may use, from `devices.<stage>` and what is visible."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator

import torch

from dflashpipe.errors import ConfigError
from dflashpipe.leases import lease_device


def visible_gpus() -> list[int]:
    """Indices of the GPUs this process may use, without initializing CUDA.

    CUDA_VISIBLE_DEVICES (set by SLURM or the user) wins; otherwise nvidia-smi is asked.
    """
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return list(range(len([d for d in env.split(",") if d.strip()])))
    if shutil.which("nvidia-smi") is None:
        return []
    done = subprocess.run(
        ["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"], capture_output=True, text=True
    )
    if done.returncode != 0:
        return []
    return [int(x) for x in done.stdout.split()]


def resolve_devices(spec: str | list[int], available: list[int], key: str) -> list[int]:
    """The GPU indices for one stage: `auto` = every available GPU ([] means CPU); an explicit
    list must name available GPUs only."""
    if spec == "auto":
        return list(available)
    missing = [d for d in spec if d not in available]
    if missing:
        raise ConfigError(
            f"{key} lists GPU(s) {missing}, but the visible GPUs are {available or 'none'}"
        )
    return list(spec)


def scheduler_assigned() -> bool:
    """On SLURM (or any scheduler that sets CUDA_VISIBLE_DEVICES per job) its choice wins."""
    return "SLURM_JOB_ID" in os.environ and "CUDA_VISIBLE_DEVICES" in os.environ


@contextlib.contextmanager
def stage_device(spec: str | list[int], shard: int, key: str) -> Iterator[torch.device]:
    """The device one shard job runs on, held exclusively for the job's lifetime (CPU if none).

    Shards map round-robin onto the stage's devices; a job whose device is busy takes another
    free one of the same list rather than waiting (see leases.py for why leases, not resources).
    """
    if scheduler_assigned():
        yield torch.device("cuda", 0)
        return
    devices = resolve_devices(spec, visible_gpus(), key)
    if not devices:
        yield torch.device("cpu")
        return
    with lease_device(devices, devices[shard % len(devices)]) as index:
        yield torch.device("cuda", index)
