"""Atomic file writes and checksums: an output either exists whole or not at all."""

from __future__ import annotations

import contextlib
import errno
import glob
import hashlib
import json
import mmap
import os
import queue
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

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


class ChunkedFile:
    """A write-only, sequential file sink that keeps the disk busy while the caller works.

    Feature shards run to tens of GB per job. Left to the page cache, a shard sits dirty in
    memory until the kernel's writeback or the final fsync gets to it, and the disk falls
    behind the GPU. Here every byte is copied into page-aligned chunks (numpy: the GIL is
    released) and a background thread writes each full chunk with one pwrite and at once asks
    the kernel to write it back (posix_fadvise DONTNEED), so the disk works while the caller
    fills the next chunk and the final fsync finds little left.

    direct=True opens the file with O_DIRECT instead (past the page cache; the aligned chunks
    are what it needs; `close` writes the tail padded to the alignment and truncates the file
    to its real size); where the file system refuses O_DIRECT, it falls back to the above.
    Errors of the writing thread (a full disk: ENOSPC, EFBIG) are raised by the next write or
    by close. Usable as the sink of `pyarrow.PythonFile`.
    """

    ALIGN = 4096  # covers the logical block size of common disks (512 or 4096)

    def __init__(
        self,
        path: str | Path,
        chunk_bytes: int = 32 << 20,
        in_flight: int = 2,
        direct: bool = False,
    ):
        if chunk_bytes % self.ALIGN:
            raise ValueError(f"chunk_bytes {chunk_bytes} is not a multiple of {self.ALIGN}")
        self.path, self.chunk = Path(path), chunk_bytes
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        self.direct = direct and hasattr(os, "O_DIRECT")
        try:
            self.fd = os.open(self.path, flags | (os.O_DIRECT if self.direct else 0), 0o644)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            self.direct = False
            self.fd = os.open(self.path, flags, 0o644)
        # anonymous maps are page-aligned, which O_DIRECT needs of the memory too
        self._free: queue.Queue = queue.Queue()
        for _ in range(in_flight + 1):
            self._free.put(mmap.mmap(-1, chunk_bytes))
        self._todo: queue.Queue = queue.Queue()
        self._error: OSError | None = None
        self._buf = self._free.get()
        self._fill = 0  # bytes in the current chunk
        self._offset = 0  # file offset of the current chunk
        self.closed = False
        self._thread = threading.Thread(target=self._write_chunks, daemon=True)
        self._thread.start()

    @property
    def mode(self) -> str:
        return "wb"

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._offset + self._fill

    def write(self, data) -> int:
        self._raise_error()
        src = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)
        done = 0
        while done < src.size:
            n = min(self.chunk - self._fill, src.size - done)
            dst = np.frombuffer(self._buf, dtype=np.uint8, count=n, offset=self._fill)
            np.copyto(dst, src[done : done + n])
            self._fill += n
            done += n
            if self._fill == self.chunk:
                self._submit()
        return done

    def flush(self) -> None:
        self._raise_error()

    def _submit(self) -> None:
        self._todo.put((self._buf, self._fill, self._offset))
        self._offset += self._fill
        self._fill = 0
        self._buf = self._free.get()  # waits while every chunk is in flight: back-pressure
        self._raise_error()

    def _write_chunks(self) -> None:
        while (item := self._todo.get()) is not None:
            buf, length, offset = item
            try:
                if self._error is None:
                    view = memoryview(buf)[:length]
                    done = 0
                    while done < length:
                        if not (n := os.pwrite(self.fd, view[done:], offset + done)):
                            raise OSError(errno.EIO, f"{self.path}: pwrite wrote nothing")
                        done += n
                    if not self.direct and hasattr(os, "posix_fadvise"):
                        os.posix_fadvise(self.fd, offset, length, os.POSIX_FADV_DONTNEED)
            except OSError as e:
                self._error = e
            finally:
                self._free.put(buf)

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            size, tail = self.tell(), self._fill
            if tail:
                # O_DIRECT writes whole aligned blocks; the truncate below cuts the padding
                padded = -(-tail // self.ALIGN) * self.ALIGN if self.direct else tail
                self._buf[tail:padded] = bytes(padded - tail)
                self._todo.put((self._buf, padded, self._offset))
            self._todo.put(None)
            self._thread.join()
            self._raise_error()
            if self.direct:
                os.ftruncate(self.fd, size)
        finally:
            if self._thread.is_alive():  # an exception before the stop was queued
                self._todo.put(None)
                self._thread.join()
            os.close(self.fd)

    def __enter__(self) -> ChunkedFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
