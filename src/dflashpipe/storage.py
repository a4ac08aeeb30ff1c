"""Atomic file writes and checksums: an output either exists whole or not at all."""

from __future__ import annotations

import contextlib
import errno
import glob
import hashlib
import json
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dflashpipe import faults
from dflashpipe.errors import DiskFullError

_UMASK = os.umask(0)
os.umask(_UMASK)
# per-user cache: converted GGUF targets, remembered checksums
CACHE_DIR = Path(os.environ.get("DFLASHPIPE_CACHE", Path.home() / ".cache" / "dflashpipe"))
RACY_S = 2.0  # a file changed this recently may change again within its mtime's resolution


@contextlib.contextmanager
def atomic_path(dest: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside `dest`; on success fsync it and rename it over `dest`.

    On any exception the temporary file is removed and `dest` is left untouched, so a killed or
    failed writer never leaves a half-written final file behind.
    """
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(dest)
    fd, tmp = tempfile.mkstemp(
        prefix=f".{dest.name}.{os.getpid()}.", suffix=".tmp", dir=dest.parent
    )
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        os.chmod(tmp_path, 0o666 & ~_UMASK)  # mkstemp (and some writers) make 0600 files
        faults.point("atomic.written")
        with open(tmp_path, "rb") as f:
            os.fsync(f.fileno())
        faults.point("atomic.synced")
        os.replace(tmp_path, dest)
        faults.point("atomic.renamed")
        fsync_path(dest.parent)  # the rename is durable only once the directory is flushed
    except OSError as e:
        tmp_path.unlink(missing_ok=True)
        if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise DiskFullError(
                f"cannot write {dest}: {os.strerror(e.errno)}; the partial file was removed, "
                f"nothing of {dest.name} is left behind. Free space in {dest.parent} and rerun."
            ) from e
        raise
    except BaseException:
        tmp_path.unlink(missing_ok=True)
        raise


def remove_stale_temps(dest: Path) -> None:
    """Delete temporaries of `dest` left by writers that were killed (their process is gone).
    A temporary's name carries its writer's pid; one of a live process is left alone."""
    for tmp in dest.parent.glob(f".{glob.escape(dest.name)}.*.tmp"):
        pid = tmp.name[len(dest.name) + 2 :].split(".", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            tmp.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a directory: its entries, e.g. a rename into it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(dest: str | Path, obj: Any) -> None:
    with atomic_path(dest) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n", encoding="utf-8")


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def cached_sha256(path: str | Path) -> str:
    """sha256 of a file, remembered under CACHE_DIR by (real path, inode, size, mtime, ctime):
    weights and feature shards run to GBs or TBs and are hashed once, not on every load or
    restart. Any write changes mtime/ctime, so a changed file is hashed again; a file changed
    within RACY_S of its hashing is not remembered (timestamps are coarser than writes)."""
    real = Path(path).resolve()
    st = real.stat()
    key = f"{real}|{st.st_ino}|{st.st_size}|{st.st_mtime_ns}|{st.st_ctime_ns}"
    cache_file = CACHE_DIR / "sha256.json"
    try:
        cache = json.loads(cache_file.read_text())
    except (OSError, ValueError):
        cache = {}
    if key in cache:
        return cache[key]
    digest = sha256_file(real)
    if time.time() - max(st.st_mtime, st.st_ctime) > RACY_S:
        cache[key] = digest
        with contextlib.suppress(OSError):  # an unwritable cache only costs hashing again
            cache_file.parent.mkdir(parents=True, exist_ok=True)
            # a best-effort cache outside the run: replaced atomically, but not through
            # atomic_path, whose fault points must not depend on what earlier runs remembered
            fd, tmp = tempfile.mkstemp(prefix=".sha256.", dir=cache_file.parent)
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump(cache, f)
                os.replace(tmp, cache_file)
            finally:
                Path(tmp).unlink(missing_ok=True)  # gone already once replaced
    return digest
