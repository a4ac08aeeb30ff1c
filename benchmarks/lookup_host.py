"""Prompt lookup's host work per step under load: the seconds `ConcurrentEngine._plan_lookups`
takes to find every busy row's drafts and hand them to the device's step input, for R rows of
random prompts (300 tokens over a 200-token vocabulary, so the n-grams recur) that each accept
3 tokens a step. Host work only, so the dev machine's CPU measures it:

    PYTHONPATH=src python benchmarks/lookup_host.py --rows 16 64

On the GPU it is `host_ms_per_step` of evaluate.concurrency's prompt lookup (1.29 ms a step at
c = 64 on an H100, 2026-12-05, benchmarks/RESULTS.md), where the device waits for it.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from types import SimpleNamespace

import numpy as np
import torch

from dflashpipe.decoding.concurrent import ConcurrentEngine, _Row
from dflashpipe.decoding.lookup import PromptLookupProposer


def measure(rows: int, steps: int, drafts: int, seed: int) -> float:
    """The median seconds of one planning step over `steps` steps."""
    rng = random.Random(seed)
    kind = f"lookup@{drafts}"
    engine = SimpleNamespace(  # the state _plan_lookups reads and writes
        drafts={kind: torch.zeros(rows, drafts + 1, dtype=torch.long)},
        plans={kind: np.zeros((rows, drafts + 1), dtype=np.int64)},
    )
    busy = {}
    for r in range(rows):
        prompt = [rng.randrange(200) for _ in range(300)]
        row = _Row(r, prompt, prompt[100:110])
        row.proposer = PromptLookupProposer(drafts, 4, "latest", "all")
        row.proposer.start(prompt, None)
        busy[r] = row
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        ConcurrentEngine._plan_lookups(engine, kind, busy)
        times.append(time.perf_counter() - t)
        for row in busy.values():
            row.take([rng.randrange(200) for _ in range(3)])
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--drafts", type=int, default=16, help="prompt lookup's num_drafts (K)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print("| rows | host ms per step (median) |\n|---:|---:|")
    for rows in args.rows:
        print(f"| {rows} | {1e3 * measure(rows, args.steps, args.drafts, args.seed):.3f} |")


if __name__ == "__main__":
    main()
