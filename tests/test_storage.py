import hashlib
import json
import os

import pytest

from dflashpipe.storage import atomic_path, sha256_file, write_json


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
