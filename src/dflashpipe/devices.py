"""Device mapping: which GPUs a stage may use, from `devices.<stage>` and what is visible."""

from __future__ import annotations

import os
import shutil
import subprocess

from dflashpipe.errors import ConfigError


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
