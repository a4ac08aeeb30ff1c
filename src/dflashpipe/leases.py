"""Exclusive leases held by a job's process: a GPU (two jobs never share a device) and an
output (two jobs never write the same run directory or shard).

Why a lock-file lease held by the job process, rather than per-device Snakemake resources:
Snakemake resources only count (`gpu=5` lets five jobs start) and cannot say *which* device a job
gets, and they do not span separate `snakemake` invocations (a user rerunning one stage while
another runs). An `flock` on `results/.locks/gpu-<index>.lock` names the device, is released by
the kernel when the process dies (no stale locks after a kill), and holds across invocations.
On a cluster the scheduler assigns GPUs (CUDA_VISIBLE_DEVICES) and no lease is taken.

Outputs: Snakemake's own lock guards one invocation only; a job orphaned by a `kill -9` of
snakemake trains on after `snakemake --unlock`, and a rerun would start a second writer beside
it (issue 60: two trainers interleaved one metrics.jsonl). The CLI holds `.<name>.lock` beside
each stage's output (`results/train/.run.lock`, `results/features/.shard-00000.arrow.lock`; a
dot name that no rule output, glob or temporary pattern matches) for the whole job; a second
writer fails at once naming the holder's PID and host. A job that ends removes its lock file
(a locker checks that the file it locked is still the one on disk); one that is killed leaves
it, unlocked, for the next job to take. Children a job starts (torchrun's agent) are handed the
job's locks (`held_fds`), so a lock outlives the launcher while anything it started can still
write. Under SLURM the same lock lies on the shared
filesystem: flock works across NFS clients on Linux (NFSv4, or v3 with lockd); some parallel
filesystems lock per node only (Lustre without `-o flock`), where it guards one node.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from dflashpipe.errors import OutputBusyError

log = logging.getLogger(__name__)

LOCK_DIR = Path("results/.locks")
_held: set[int] = set()  # the fds of the locks this process holds


def _try_lock(path: Path) -> int | None:
    """An fd holding an exclusive flock on `path` (its text: `<pid> <host>`), or None while
    another process holds it."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        try:  # a holder removes an output's lock file as it lets go: lock the one on disk
            if os.path.samestat(os.fstat(fd), os.stat(path)):
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()} {socket.gethostname()}\n".encode())
    _held.add(fd)
    return fd


def _release(fd: int, remove: Path | None = None) -> None:
    _held.discard(fd)
    if remove is not None:  # while still held: a process that opened it meanwhile sees it gone
        remove.unlink(missing_ok=True)
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)


def held_fds() -> tuple[int, ...]:
    """The locks this process holds, for `subprocess.run(pass_fds=...)`: a child given them keeps
    them held (flock belongs to the open file, not the process) until it, too, is gone."""
    return tuple(sorted(_held))


def lock_path(output: str | Path) -> Path:
    """The lock file of an output (a file or a directory): `.<name>.lock` beside it."""
    output = Path(output)
    return output.parent / f".{output.name}.lock"


def _holder(path: Path) -> tuple[str, str]:
    """(pid, host) written in a held lock file; "?" where unreadable. The holder writes them just
    after taking the lock, so an empty file is read again for a moment."""
    for _ in range(20):
        try:
            words = path.read_text().split()
        except OSError:
            break
        if len(words) >= 2:
            return words[0], words[1]
        time.sleep(0.05)
    return "?", "?"


@contextlib.contextmanager
def hold_output(output: str | Path) -> Iterator[int]:
    """Be the only writer of `output` until the block ends (yields the lock's fd); raises
    OutputBusyError naming the holder's PID and host while another process writes it."""
    path = lock_path(output)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = _try_lock(path)
    if fd is None:
        pid, host = _holder(path)
        raise OutputBusyError(
            f"{output} is being written by another job: process {pid} on host {host} (or one it "
            f"started) holds {path}. Two writers would interleave their files: wait for that job "
            f"to end, or stop it (on {host}: kill {pid}), then rerun."
        )
    try:
        yield fd
    finally:
        _release(fd, remove=path)


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
                    _release(fd)
                return
        if not waited:
            log.info("every GPU of %s is leased by another job; waiting", pool)
            waited = True
        time.sleep(poll_s)
