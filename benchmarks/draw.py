"""The token choice at the end of regenerate's decode step (decoding/batched_step.advance: the
final norm, the LM head, float32 logits, then the argmax, or for sampled rows the top-p draw of
decoding/sampling.draw), timed alone for greedy and sampled steps at the recipes' vocabularies:

    smollm2   hidden 576, vocab 49,152  (configs/smollm2-sharegpt.yaml: greedy answers)
    gemma3    hidden 640, vocab 262,144 (configs/gemma3-270m-quality.yaml: 3 answers in 4
              sampled at temperature 0.7, top-p 0.95)

1,024 rows (both recipes' regenerate.batch_size), random bf16 weights and rows (the sort's cost
does not depend on the values' order enough to matter here), the step's code as the engine
compiles it (`torch.compile(fullgraph=True)`, fixed shapes; `--eager` without). Each cell: the
median ms of `--repeats` calls after warm-up, CUDA events on a GPU; the sampled cell's extra ms
over the greedy one is what top-p sampling adds to each decode step. Then the draw alone on the
step's logits: `draw` (the engine's: a sort of each row), `draw_searched` (the nucleus found by
a search over the probabilities' bits, no sort), whether the compiled search picks the eager
one's tokens, and `draw` with top-k 50 before top-p (a top-k of each row instead of a sort: what
a recipe that sets `regenerate.top_k` pays).

    python benchmarks/draw.py --out $OUT/draw.json       # GPU: both vocabularies
    python benchmarks/draw.py --smoke                    # CPU, tiny shapes: checks the script
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from torch import nn

from dflashpipe.decoding.batched_step import advance, decode_state
from dflashpipe.decoding.sampling import Sampling, draw, draw_searched

SHAPES = {"smollm2": (576, 49_152), "gemma3": (640, 262_144)}
RECIPE_SAMPLING = Sampling(temperature=0.7, top_p=0.95)
TOP_K_SAMPLING = Sampling(temperature=0.7, top_p=0.95, top_k=50)  # generate()'s default top_k


def state(rows: int, capacity: int, device: torch.device) -> dict[str, torch.Tensor]:
    """The engine's decode state (batched_step.decode_state) with every row active and sampled,
    mid-answer, its limit never reached."""
    s = decode_state(rows, capacity, device)
    s["length"].fill_(100)
    s["produced"].fill_(10)
    s["limit"].fill_(10**6)
    s["active"].fill_(True)
    s["sampled"].fill_(True)
    s["uniforms"].uniform_()
    return s


def timed(fn, repeats: int, device: torch.device) -> float:
    """Median ms of fn() over `repeats` calls, after three warm-up calls."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def cell(name: str, hidden: int, vocab: int, rows: int, args, device) -> dict:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    norm = nn.RMSNorm(hidden, device=device, dtype=dtype)
    lm_head = nn.Linear(hidden, vocab, bias=False, device=device, dtype=dtype)
    x = torch.randn(rows, hidden, device=device, dtype=dtype)
    stops = torch.full((8,), -1, dtype=torch.long, device=device)
    s = state(rows, 64, device)
    out = {"shape": name, "hidden": hidden, "vocab": vocab, "rows": rows}
    for kind, sampling in (("greedy", None), ("sampled", RECIPE_SAMPLING)):

        def step(sampling=sampling):
            advance(norm, lm_head, x, s, stops, sampling)
            s["produced"].fill_(10)  # the same uniform column every call

        fn = step if args.eager else torch.compile(step, fullgraph=True, dynamic=False)
        with torch.no_grad():
            out[f"{kind}_ms"] = timed(fn, args.repeats, device)
    out["sampling_adds_ms"] = out["sampled_ms"] - out["greedy_ms"]
    out["sampled_over_greedy"] = out["sampled_ms"] / out["greedy_ms"]
    # the draw alone on the step's logits: the engine's sort, and the nucleus search without one
    with torch.no_grad():
        logits = lm_head(norm(x)).float()
        u = torch.rand(rows, device=device)
        for kind, fn, sampling in (("sort", draw, RECIPE_SAMPLING),
                                   ("search", draw_searched, RECIPE_SAMPLING),
                                   ("topk", draw, TOP_K_SAMPLING)):  # fmt: skip
            run = fn if args.eager else torch.compile(fn, fullgraph=True, dynamic=False)
            out[f"draw_{kind}_ms"] = timed(lambda run=run, sampling=sampling: run(logits, u, sampling),
                                           args.repeats, device)  # fmt: skip
            if kind == "search":  # the compiled search picks what the eager one does
                tokens = run(logits, u, sampling)
                out["search_as_eager"] = bool((tokens == fn(logits, u, sampling)).all())
    out["search_over_sort"] = out["draw_search_ms"] / out["draw_sort_ms"]
    return out


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="JSON of the cells")
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--eager", action="store_true", help="the step uncompiled")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, eager")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    shapes = {k: (h // 8, v // 512) for k, (h, v) in SHAPES.items()} if args.smoke else SHAPES
    if args.smoke:
        args.rows, args.repeats, args.eager = 8, 3, True
    torch.manual_seed(0)
    rows = [cell(name, h, v, args.rows, args, device) for name, (h, v) in shapes.items()]
    card = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"{card}, {args.rows} rows, {'eager' if args.eager else 'compiled'}")
    print(f"{'shape':8} {'vocab':>8} {'greedy ms':>10} {'sampled ms':>11} {'adds ms':>8} {'x':>6}"
          f" {'sort ms':>8} {'search ms':>10} {'x':>6} {'as eager':>9} {'top-k ms':>9}")  # fmt: skip
    for r in rows:
        print(f"{r['shape']:8} {r['vocab']:>8} {r['greedy_ms']:>10.3f} {r['sampled_ms']:>11.3f} "
              f"{r['sampling_adds_ms']:>8.3f} {r['sampled_over_greedy']:>6.2f} "
              f"{r['draw_sort_ms']:>8.3f} {r['draw_search_ms']:>10.3f} "
              f"{r['search_over_sort']:>6.2f} {r['search_as_eager']!s:>9} {r['draw_topk_ms']:>9.3f}")  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps({"card": card, "args": vars(args), "rows": rows}))
    return rows


if __name__ == "__main__":
    main()
