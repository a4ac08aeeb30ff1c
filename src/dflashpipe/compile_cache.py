"""torch.compile's work carried between machines: a fresh GPU machine spends minutes compiling
what an earlier one already compiled (H200, 2026-12-04: 160-220 s before training's first
optimizer step).

With DFLASHPIPE_COMPILE_CACHE=DIR set, a stage process (regenerate, extract, evaluate, each
training process) loads every bundle in DIR before it compiles (torch.compiler's
load_cache_artifacts: Inductor's graphs and Triton kernels, AOTAutograd's, autotuning results)
and, when its work ends without an error, saves what it compiled as one more bundle
(save_cache_artifacts), named by its content's digest, so concurrent processes never write the
same name; a process that compiled nothing new (every graph a hit) adds none. torch checks each
artifact against its own version, Triton's and the GPU before it uses it; a bundle it cannot
read is logged and skipped.
Only local rank 0 of a training job saves (every rank compiles the same graphs).

    DIR = a folder carried to the next machine (benchmarks/remote: pack.sh compile DIR)
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from dflashpipe.storage import atomic_path

log = logging.getLogger(__name__)

ENV = "DFLASHPIPE_COMPILE_CACHE"
SUFFIX = ".torchcompile"


def folder() -> Path | None:
    value = os.environ.get(ENV, "").strip()
    return Path(value) if value else None


def load(where: Path) -> set[str]:
    """Every bundle in `where` into this process's compile caches; returns their artifacts'
    keys."""
    import torch

    loaded: set[str] = set()
    for bundle in sorted(where.glob(f"*{SUFFIX}")):
        try:
            info = torch.compiler.load_cache_artifacts(bundle.read_bytes())
        except Exception as e:  # another torch's format, a truncated copy: compile instead
            log.warning("compile cache: skipped %s (%s: %s)", bundle, type(e).__name__, e)
            continue
        if not artifacts(info):  # torch logs why and loads nothing
            log.warning("compile cache: skipped %s (torch read no artifacts from it)", bundle)
            continue
        loaded |= keys(info)
        log.info("compile cache: loaded %s (%s)", bundle.name, summary(info))
    return loaded


def save(where: Path, tag: str, known: frozenset[str] | set[str] = frozenset()) -> Path | None:
    """What this process compiled or used, as `where/{tag}-{digest}.torchcompile`; None when
    that is nothing beyond the `known` artifacts (those loaded: a machine that compiled nothing
    new adds no bundle)."""
    import torch

    saved = torch.compiler.save_cache_artifacts()
    if saved is None or not saved[0] or keys(saved[1]) <= known:
        return None
    data, info = saved
    path = where / f"{tag}-{hashlib.sha256(data).hexdigest()[:16]}{SUFFIX}"
    if not path.exists():
        where.mkdir(parents=True, exist_ok=True)
        with atomic_path(path) as tmp:
            tmp.write_bytes(data)
    log.info("compile cache: saved %s (%.1f MB; %s)", path, len(data) / 1e6, summary(info))
    return path


def artifacts(info) -> dict[str, list[str]]:
    """A CacheInfo's artifact keys by kind ({} for none, or no CacheInfo)."""
    return getattr(info, "artifacts", None) or {}


def keys(info) -> set[str]:
    """The artifacts' keys of a CacheInfo, as 'kind:key'."""
    return {f"{kind}:{key}" for kind, names in artifacts(info).items() for key in names}


def summary(info) -> str:
    """'inductor 3, aot_autograd 2' from a CacheInfo."""
    return ", ".join(f"{kind} {len(names)}" for kind, names in artifacts(info).items()) or "empty"


@contextmanager
def carried(tag: str) -> Iterator[None]:
    """The compile caches of DFLASHPIPE_COMPILE_CACHE (when set) loaded before the block and
    this process's new work saved after it, unless it raised (module docstring)."""
    where = folder()
    if where is None:
        yield
        return
    known = load(where) if where.is_dir() else set()
    yield
    if int(os.environ.get("LOCAL_RANK", 0)) == 0:
        save(where, tag, known)
