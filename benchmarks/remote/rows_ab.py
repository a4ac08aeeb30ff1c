"""The concurrent engine's step cost at c rows, repeated in one process on one tree (issue 61's
before/after: a single decode of 2c prompts per level is a few percent noisy at c = 1).

    python benchmarks/remote/rows_ab.py TREE --concurrency 1 16 --repeats 5 --out rows.json

TREE holds src/ and benchmarks/ (the new tree, or an old commit's `git archive`); its own
benchmarks/evaluate.py builds the random-weight SmolLM2 shape (block 8) and its own engines time
`measure_rows`. Prints and writes the median and spread of ms/step per (c, method)."""

import argparse
import importlib.util
import json
import statistics
import sys
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("tree")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    ap.add_argument("--out", default="rows.json")
    args = ap.parse_args()
    tree = Path(args.tree).resolve()
    sys.path.insert(0, str(tree / "src"))
    spec = importlib.util.spec_from_file_location("bench", tree / "benchmarks" / "evaluate.py")
    bench = importlib.util.module_from_spec(spec)
    sys.modules["bench"] = bench  # its dataclasses look their module up
    spec.loader.exec_module(bench)
    import torch

    from dflashpipe.decoding.engine import Engine

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    model, drafter, _ = bench.build(bench.SHAPES["smollm2"], device, dtype, args.smoke, 8)
    lens = bench.SMOKE_PROMPT_LENS if args.smoke else [200, 256, 300]
    new = bench.SMOKE_NEW_TOKENS if args.smoke else 64
    prompts = bench.make_prompts(lens, 3, model.config.vocab_size)
    engine = Engine(model, 64 if args.smoke else 784, drafter, graphs=cuda, compile=cuda)
    runs: dict[str, list[float]] = {}
    for _ in range(args.repeats):
        for c in args.concurrency:
            for method, row in bench.measure_rows(engine, c, prompts, new).items():
                runs.setdefault(f"c={c} {method}", []).append(row["ms_per_step"])
    out = {k: {"median": statistics.median(v), "min": min(v), "max": max(v), "runs": v}
           for k, v in runs.items()}  # fmt: skip
    for k, v in out.items():
        print(f"{tree.name:<8} {k:<14} median {v['median']:.3f} ms/step "
              f"(min {v['min']:.3f}, max {v['max']:.3f}, {len(v['runs'])} runs)")  # fmt: skip
    Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
