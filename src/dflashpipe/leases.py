"""Exclusive GPU leases for local runs: two jobs never share a device.

Why a lock-file lease held by the job process, rather than per-device Snakemake resources:
Snakemake resources only count (`gpu=5` lets five jobs start) and cannot say *which* device a job
gets, and they do not span separate `snakemake` invocations (a user rerunning one stage while
another runs). An `flock` on `results/.locks/gpu-<index>.lock` names the device, is released by
the kernel when the process dies (no stale locks after a kill), and holds across invocations.
On a cluster the scheduler assigns GPUs (CUDA_VISIBLE_DEVICES) and no lease is taken.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)

LOCK_DIR = Path("results/.locks")


def _try_lock(path: Path) -> int | None:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


@contextlib.contextmanager
def lease_device(
    pool: list[int], preferred: int, lock_dir: Path = LOCK_DIR, poll_s: float = 0.5
) -> Iterator[int]:
    """Hold one device of `pool` exclusively (the preferred one when free) until the block ends;
    waits while every device is held by another process."""
    lock_dir.mkdir(parents=True, exist_ok=True)
    order = [preferred] + [d for d in pool if d != preferred]
    waited = False
    while True:
        for device in order:
            fd = _try_lock(lock_dir / f"gpu-{device}.lock")
            if fd is not None:
                if waited:
                    log.info("got GPU %d", device)
                try:
                    yield device
                finally:
                    fcntl.flock(fd, fcntl.LOCK_UN)
                    os.close(fd)
                return
        if not waited:
            log.info("every GPU of %s is leased by another job; waiting", pool)
            waited = True
        time.sleep(poll_s)
