"""How the workflow's jobs run this checkout's code.

Its `src/` goes first on PYTHONPATH in the environment that every job inherits (local jobs, jobs
under --sdm conda, SLURM jobs, which export the submitting environment), not into a rule's
command: the command is one of a rule's params, and a path there would replan every job of a
finished run once it is copied or moved.
"""

from __future__ import annotations

import os


def put_first_on_pythonpath(src: str) -> None:
    """`src` first on this process's PYTHONPATH (once), which its child processes inherit."""
    rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != src]
    os.environ["PYTHONPATH"] = os.pathsep.join([src, *rest])
