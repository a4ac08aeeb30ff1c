"""What evaluate.concurrency's levels cost to compile: per level, the seconds to compile and
prepare target-only's, DFlash's and prompt lookup's steps on a fresh ConcurrentEngine of that
many rows, and the graphs Dynamo compiled for them, with `--shapes dynamic` (the engine's
default: one graph per step function for every row count above 1) or `fixed` (one per row
count). Real weights: a recipe's target and an exported drafter. It compiles on the CPU too
(graphs there need a GPU), so it runs on the dev machine:

    PYTHONPATH=src python benchmarks/concurrency_compile.py --config configs/smollm2-sharegpt.yaml \\
        --drafter DRAFTER_DIR --shapes fixed dynamic

Each --shapes value runs in its own process (Dynamo's caches are per process). Figures go to
benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time


def measure(args: argparse.Namespace, shapes: str) -> None:
    import torch
    from torch._dynamo.utils import counters

    from dflashpipe.config import load_config
    from dflashpipe.decoding.concurrent import ConcurrentEngine
    from dflashpipe.decoding.engine import Engine
    from dflashpipe.decoding.lookup import LookupConfig
    from dflashpipe.evaluate import load_models

    device = torch.device(args.device)
    cfg = load_config(args.config)
    model, _, drafter = load_models(cfg.target, args.drafter, device)
    engine = Engine(model, args.capacity, drafter, compile=True)
    lookup = LookupConfig(num_drafts=cfg.evaluate.prompt_lookup_num_tokens,
                          max_ngram_size=cfg.evaluate.prompt_lookup_max_ngram)  # fmt: skip
    for c in args.levels:
        t, graphs = time.perf_counter(), counters["stats"]["unique_graphs"]
        concurrent = ConcurrentEngine(engine, c, None if shapes == "dynamic" else False)
        for method in ("target", "dflash", "prompt_lookup"):
            concurrent.prepare(method, lookup)
        graphs = counters["stats"]["unique_graphs"] - graphs
        print(f"| {shapes} | {c} | {time.perf_counter() - t:.1f} | {graphs} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--drafter", required=True, help="export dir (config.json + model.safetensors)")
    ap.add_argument("--shapes", nargs="+", choices=["dynamic", "fixed"], default=["dynamic"])
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--capacity", type=int, default=128, help="the engine's slots per row")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # the child process's shapes
    args = ap.parse_args()
    if args.one:
        measure(args, args.one)
        return
    print(
        "| shapes | rows | seconds to compile and prepare 3 steps | graphs |\n|---|---:|---:|---:|"
    )
    for shapes in args.shapes:
        subprocess.run([sys.executable, *sys.argv, "--one", shapes], check=True)


if __name__ == "__main__":
    main()
