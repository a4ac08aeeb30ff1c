"""Device mapping: which GPUs a stage may use, from `devices.<stage>` and what is visible.

A GPU stage's command gets one DeviceLease, made in one place (cli.device_lease): regenerate,
extract and evaluate hold one device of it for the job (`hold`), train's launcher every device
(`hold_all`). The stage enters it where it first needs the device, after the checks that need
none (a shard already written, a refused config), so those never wait on a busy GPU."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass

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


@dataclass(frozen=True)
class DeviceLease:
    """The devices a GPU stage's job may take: `fixed` (evaluate --device) as named, without a
    lease; else `spec` (a `devices.<stage>` value, named `key` in errors), shard `shard`
    preferring its round-robin device. The default takes any free visible GPU, else the CPU."""

    spec: str | list[int] = "auto"
    shard: int = 0
    key: str = "devices.extract"
    fixed: str | None = None

    @contextlib.contextmanager
    def hold(self) -> Iterator[torch.device]:
        """One device, held until the block ends (stage_device)."""
        if self.fixed:
            yield torch.device(self.fixed)
            return
        with stage_device(self.spec, self.shard, self.key) as device:
            yield device

    @contextlib.contextmanager
    def hold_all(self) -> Iterator[list[int] | None]:
        """Every GPU of `spec`, each held until the block ends ([]: none, the CPU); None where
        a scheduler assigned them (CUDA_VISIBLE_DEVICES names them, no lease)."""
        if scheduler_assigned():
            yield None
            return
        devices = resolve_devices(self.spec, visible_gpus(), self.key)
        with ExitStack() as leases:
            for d in devices:
                leases.enter_context(lease_device([d], d))
            yield devices


ANY_DEVICE = DeviceLease()  # a stage called in-process without one: any free GPU, else the CPU
