"""Training checkpoints: model, optimizer, scheduler, RNG states, data position, step.

Each checkpoint is a directory `step-XXXXXXXX/` under the run directory, written under a
temporary name and renamed when complete, so a directory with the final name is always whole.
The run directory is not a Snakemake output: a failed job does not delete it, and the next
attempt resumes from the newest checkpoint. `finished.json`, written after the export, tells a
forced rerun of a finished run (trained afresh) from a cut-off one (resumed).
"""

from __future__ import annotations

import json
import logging
import random
import shutil
from pathlib import Path

import numpy as np
import torch

from dflashpipe import faults
from dflashpipe.errors import DataError
from dflashpipe.storage import fsync_path, write_json

log = logging.getLogger(__name__)
PREFIX = "step-"
FINISHED = "finished.json"  # mark_finished: the run ended and was exported


def rng_state() -> dict:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save(run_dir: Path, step: int, state: dict, fingerprint: dict, keep: int) -> Path:
    """Write checkpoint `step` (state: model/optimizer/scheduler/data/... as torch objects)."""
    final = run_dir / f"{PREFIX}{step:08d}"
    tmp = run_dir / f".{final.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    torch.save({**state, "rng": rng_state(), "step": step}, tmp / "state.pt")
    (tmp / "fingerprint.json").write_text(json.dumps(fingerprint, indent=2, sort_keys=True))
    for path in (tmp / "state.pt", tmp / "fingerprint.json", tmp):
        fsync_path(path)
    faults.point("checkpoint.written")
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    fsync_path(run_dir)
    faults.point("checkpoint.renamed")
    for old in sorted(run_dir.glob(f"{PREFIX}*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def complete(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first; half-written ones (a killed save) are removed."""
    for stale in run_dir.glob(f".{PREFIX}*.tmp"):
        shutil.rmtree(stale, ignore_errors=True)
    return sorted(p for p in run_dir.glob(f"{PREFIX}*") if (p / "state.pt").is_file())


def latest(run_dir: Path) -> Path | None:
    """The newest complete checkpoint."""
    done = complete(run_dir)
    return done[-1] if done else None


def changed_keys(run_dir: Path, fingerprint: dict) -> list[str]:
    """The fingerprint keys whose values differ from the newest complete checkpoint's (keys on
    one side only count as changed); [] when there is none or it agrees."""
    newest = latest(run_dir)
    if newest is None:
        return []
    try:
        saved = json.loads((newest / "fingerprint.json").read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return []  # unreadable: load_latest passes it over for an older one, or says so
    keys = sorted(set(saved) | set(fingerprint))
    return [k for k in keys if saved.get(k, "<unset>") != fingerprint.get(k, "<unset>")]


def mark_finished(run_dir: Path, step: int, settings: dict) -> None:
    """Record that the run ended: every step trained, the drafter and metrics exported. Written
    last, so a run cut off anywhere before (mid-training, or between the final checkpoint and
    the export) has no record and resumes. `settings`: every key train's digest covers."""
    write_json(run_dir / FINISHED, {"step": step, "settings": settings})


def finished_settings(run_dir: Path) -> dict | None:
    """The settings the run ended with (mark_finished); None while it has not ended, or when
    the record cannot be read (then it resumes, as runs did before the record existed)."""
    try:
        return json.loads((run_dir / FINISHED).read_text())["settings"]
    except (OSError, json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
        return None


def set_aside(run_dir: Path) -> Path:
    """Move a run directory out of the way (renamed `<name>.superseded-N`, nothing deleted) and
    leave an empty one in its place; returns where the old one went."""
    n = 1
    while (moved := run_dir.with_name(f"{run_dir.name}.superseded-{n}")).exists():
        n += 1
    run_dir.rename(moved)
    run_dir.mkdir()
    fsync_path(run_dir.parent)
    return moved


def load_latest(run_dir: Path, fingerprint: dict) -> tuple[Path, dict] | None:
    """The newest checkpoint that can be read, and its state; None when there is none.

    A checkpoint made for another drafter or data is refused (not skipped); one that cannot be
    read (a damaged disk, a file cut short by hand) is passed over for the next older, with a
    warning. If checkpoints exist but none can be read, that is an error naming them."""
    broken = []
    for path in reversed(complete(run_dir)):
        try:
            return path, load(path, fingerprint)
        except DataError:
            raise
        except Exception as e:  # torch.load / json on a damaged file: many exception types
            log.warning("checkpoint %s cannot be read (%s); trying an older one", path, e)
            broken.append(f"{path} ({type(e).__name__})")
    if broken:
        raise DataError(
            f"checkpoint(s) {', '.join(broken)} cannot be read; move {run_dir} away to start afresh"
        )
    return None


def load(path: Path, fingerprint: dict) -> dict:
    """The state of checkpoint `path`, refused when it was made for another drafter or data."""
    try:
        saved = json.loads((path / "fingerprint.json").read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"fingerprint.json unreadable: {e}") from None
    for key, want in fingerprint.items():
        if saved.get(key) != want:
            raise DataError(
                f"checkpoint {path} was made with {key}={saved.get(key)!r}, but this run has "
                f"{key}={want!r}; move {path.parent} away to start afresh"
            )
    return torch.load(path / "state.pt", map_location="cpu", weights_only=False)
