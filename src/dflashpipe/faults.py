"""Fault injection for the reliability suite (tests/test_reliability.py).

Stages call `point(name)` at the places where a crash is most interesting (a batch done, a
file about to be renamed into place, a step finished). Two environment variables act on them:

- `DFLASHPIPE_KILL_AT=name:n`: the process SIGKILLs itself the n-th time (from 1) it passes
  `name`: a real, uncatchable kill at a chosen place instead of a timer's guess.
- `DFLASHPIPE_FAULT_TRACE=path`: every point passed is appended to `path` as `name:n`, so a test
  can list the points of an uninterrupted run and draw kill points from them.

Neither is set outside tests; then `point` returns after two environment lookups.
"""

from __future__ import annotations

import os
import signal
import threading

_counts: dict[str, int] = {}
_lock = threading.Lock()


def point(name: str) -> None:
    kill_at = os.environ.get("DFLASHPIPE_KILL_AT")
    trace = os.environ.get("DFLASHPIPE_FAULT_TRACE")
    if not kill_at and not trace:
        return
    with _lock:
        n = _counts[name] = _counts.get(name, 0) + 1
        if trace:
            with open(trace, "a", encoding="utf-8") as f:
                f.write(f"{name}:{n}\n")
    if kill_at == f"{name}:{n}":
        os.kill(os.getpid(), signal.SIGKILL)


def reset() -> None:
    """Forget the counts (a forked child starts from zero)."""
    with _lock:
        _counts.clear()
