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
