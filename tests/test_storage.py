import hashlib
import json
import os

import numpy as np
import pyarrow as pa
import pytest

from dflashpipe.storage import ChunkedFile, atomic_path, sha256_file, write_json


def test_atomic_path_replaces_only_on_success(tmp_path):
    dest = tmp_path / "sub" / "out.bin"
    with atomic_path(dest) as tmp:
        assert tmp.parent == dest.parent and tmp != dest
        tmp.write_bytes(b"first")
        assert not dest.exists()
    assert dest.read_bytes() == b"first"
    with pytest.raises(RuntimeError), atomic_path(dest) as tmp:
        tmp.write_bytes(b"half-writ")
        raise RuntimeError("writer died")
    assert dest.read_bytes() == b"first"
    assert os.listdir(dest.parent) == ["out.bin"]  # no temp file left behind


def test_write_json_and_sha256(tmp_path):
    write_json(tmp_path / "a.json", {"x": 1})
    assert (tmp_path / "a.json").read_text() == '{\n  "x": 1\n}\n'
    assert sha256_file(tmp_path / "a.json") == (
        __import__("hashlib").sha256(b'{\n  "x": 1\n}\n').hexdigest()
    )


def test_cached_sha256_remembers_unchanged_files_only(tmp_path, monkeypatch):
    from dflashpipe import storage

    monkeypatch.setattr(storage, "CACHE_DIR", tmp_path / "cache")
    f = tmp_path / "shard.arrow"
    f.write_bytes(b"a" * 1000)
    fresh = storage.cached_sha256(f)  # just written: hashed, not remembered (racy)
    assert fresh == hashlib.sha256(b"a" * 1000).hexdigest()
    assert not (tmp_path / "cache" / "sha256.json").exists()
    os.utime(f, (1e9, 1e9))  # old mtime; ctime is still now: still racy
    assert storage.cached_sha256(f) == fresh
    monkeypatch.setattr(storage, "RACY_S", -1.0)
    assert storage.cached_sha256(f) == fresh
    remembered = json.loads((tmp_path / "cache" / "sha256.json").read_text())
    assert list(remembered.values()) == [fresh] and str(f.resolve()) in next(iter(remembered))
    with open(f, "r+b") as fh:  # same size, one byte changed in place: hashed again
        fh.write(b"b")
    changed = storage.cached_sha256(f)
    assert changed == hashlib.sha256(b"b" + b"a" * 999).hexdigest() != fresh


@pytest.mark.parametrize("direct", [True, False])
def test_chunked_file_writes_exactly_the_bytes(tmp_path, direct):
    """Writes of every size, across chunk boundaries and a padded tail, give the exact bytes
    and size, with O_DIRECT and through the page cache alike."""
    rng = np.random.default_rng(0)
    parts = [
        rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in (1, 4095, 9000, 0, 20000, 7)
    ]
    path = tmp_path / "f.bin"
    with ChunkedFile(path, chunk_bytes=8192, direct=direct) as f:
        for p in parts:
            assert f.write(p) == len(p)
        assert f.tell() == sum(map(len, parts))
    assert path.read_bytes() == b"".join(parts)
    with ChunkedFile(tmp_path / "empty.bin", chunk_bytes=8192, direct=direct):
        pass
    assert (tmp_path / "empty.bin").read_bytes() == b""


@pytest.mark.parametrize("direct", [True, False])
def test_chunked_file_as_arrow_sink_matches_a_plain_file(tmp_path, direct):
    schema = pa.schema([("id", pa.string()), ("hidden", pa.large_binary())])
    rng = np.random.default_rng(1)
    batches = [
        pa.record_batch(
            [pa.array([f"s{i}"]), pa.array([rng.bytes(int(n))], pa.large_binary())], schema=schema
        )  # fmt: skip
        for i, n in enumerate(rng.integers(1, 300_000, 12))
    ]
    with pa.OSFile(str(tmp_path / "plain.arrow"), "wb") as sink, pa.ipc.new_file(sink, schema) as w:
        for b in batches:
            w.write_batch(b)
    chunked = ChunkedFile(tmp_path / "chunked.arrow", chunk_bytes=1 << 16, direct=direct)
    sink = pa.PythonFile(chunked, mode="w")
    with sink, pa.ipc.new_file(sink, schema) as w:
        for b in batches:
            w.write_batch(b)
    written = (tmp_path / "chunked.arrow").read_bytes()
    assert written == (tmp_path / "plain.arrow").read_bytes()
    assert pa.ipc.open_file(pa.py_buffer(written)).read_all().equals(pa.Table.from_batches(batches))


def test_chunked_file_raises_the_writers_error(tmp_path):
    """A failed write in the background thread (here: the file's descriptor closed under it)
    is raised to the caller, not lost."""
    f = ChunkedFile(tmp_path / "f.bin", chunk_bytes=4096)
    os.close(f.fd)
    f.fd = os.open(tmp_path / "f.bin", os.O_RDONLY)  # writes now fail with EBADF
    with pytest.raises(OSError, match="Bad file descriptor"):
        for _ in range(4):
            f.write(b"x" * 4096)
    with pytest.raises(OSError, match="Bad file descriptor"):
        f.close()  # raises again, and still closes the file
    assert f.closed and not f._thread.is_alive()
    with pytest.raises(OSError):
        os.fstat(f.fd)
    f.close()  # a second close does nothing
