"""Cost of one decoding step: the eager loop against the static-cache engine, per model shape.

    per shape (--shapes: SmolLM2-135M, Qwen3-8B; random weights, bf16, built on the GPU and
    freed before the next shape; drafter: 5 random layers, block 16)
      prompts   --prompts random prompts, lengths cycling through --prompt-lens; every method
                decodes the same ones, --new-tokens each, no stop token
      eager     decoding/eager.py: target-only `greedy_decode`, DFlash `speculative_decode`
      engine    decoding/engine.py, compiled layers + CUDA graphs (--no-compile-too: graphs only,
                --no-graphs-too: neither): greedy, dflash (draft + verify a block), ddtree@N for
                N in --budgets (top_k --top-k); prompt lookup's step is a verify of K+1 tokens
      method    one warm-up decode of prompts[0] (the engine captures its graphs there, before
                its clock starts), then every prompt timed: ms/step = decode_s / steps, median
      check     engine.captures == 1 per step kind after every prompt: no recapture when the
                prompt length changes (raises otherwise)
      profile   --profile N: each step kind replayed N times under torch.profiler: device
                kernels per step, their summed time (GPU busy) against the wall time per step
      rows      --concurrency C...: decoding/concurrent.py's ConcurrentEngine on the same
                engine, c rows at a time for each C (2 x C prompts of the same lengths, refilled
                as rows finish), target-only and DFlash: ms per step (wall / steps, refill packs
                in the steps included) and generated tok/s
    --architecture dflash2: the DFlash2 drafter (its convolutions, its selector's walk in the
    chain and its scores in the tree) at the same shape, for its step's cost against DFlash's.
    --block (default 16; the quality recipe's drafter: 8) and --capacity (the engine's slots;
    evaluate sizes them by its longest prompt: 784 on the quality recipe's eval prompts) match a
    run's shapes.
    -> markdown table: ms/step, x the same loop's target step, x the eager target step; JSON --out

Random weights never emit a stop token and a random drafter is almost never accepted (tau ~1),
so every decode runs the same steps and the figures are costs per step, not speedups; the
speedup of a trained drafter is tau / (x target step). Issue goals, printed per shape: the
engine's target step >= 10x faster than the eager one and <= 1.9 ms per token at SmolLM2 shape;
a DFlash step <= 1.3 target steps. Run it as the only process on the GPU: a step is a few ms.

    PYTHONPATH=src python benchmarks/evaluate.py --shapes smollm2 qwen3-8b --no-compile-too \\
        --out $OUT/evaluate.json
    PYTHONPATH=src python benchmarks/evaluate.py --shapes smollm2 --block 8 --capacity 784 \\
        --budgets 16 32 --profile 20 --out $OUT/steps.json   # the quality run's shapes
    PYTHONPATH=src python benchmarks/evaluate.py --shapes smollm2 --block 8 --capacity 784 \\
        --budgets 16 --concurrency 1 16 --out $OUT/rows.json   # the concurrent engine's steps
    python benchmarks/evaluate.py --smoke --shapes smollm2 qwen3-8b --out /tmp/smoke.json  # CPU

Figures go to benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from functools import partial
from pathlib import Path

import torch
import transformers
from shapes import SHAPES, Shape
from transformers import AutoModelForCausalLM

import dflashpipe.decoding.ddtree  # noqa: F401 (registers the engine's "ddtree" steps)
from dflashpipe.decoding.concurrent import ConcurrentEngine
from dflashpipe.decoding.eager import DFlashProposer, Target, greedy_decode, speculative_decode
from dflashpipe.decoding.engine import Engine
from dflashpipe.decoding.types import Decoded
from dflashpipe.model import Drafter, DrafterConfig

DRAFTER_LAYERS = 5
SMOKE_PROMPT_LENS = [12, 16, 19]
SMOKE_NEW_TOKENS = 6
GOALS = {"speedup": 10.0, "ms_per_token": 1.9, "dflash_steps": 1.3}  # the targets


def say(*what) -> None:
    """Progress, flushed: a run cut short by a time limit still shows where it was."""
    print(time.strftime("%H:%M:%S"), *what, flush=True)


def build(
    shape: Shape, device: torch.device, dtype: torch.dtype, smoke: bool, block: int,
    architecture: str = "dflash",
):  # fmt: skip
    """Random target and drafter, created on `device` in `dtype` (an 8B model initialized on the
    CPU takes minutes, and in float32 twice the memory); `architecture` dflash2: the drafter's
    convolutions and selector at their default sizes (random, not the identity)."""
    taps = shape.target_taps(smoke)
    torch.manual_seed(0)
    with torch.device(device):
        config = shape.target_config(smoke)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        cfg = DrafterConfig.from_target(
            model.config,
            mask_token_id=0,
            num_layers=2 if smoke else DRAFTER_LAYERS,
            block_size=block,
            target_layer_ids=taps,
            architecture=architecture,
        )
        drafter = Drafter.from_target_model(cfg, model)  # shares the target's embedding, head
        if architecture == "dflash2":  # a trained selector's edges, not step 0's zeros
            torch.nn.init.normal_(drafter.candidate_selector.successor_codebook, std=0.02)
    model.eval().requires_grad_(False)
    return model, drafter.to(dtype).eval().requires_grad_(False), taps


def make_prompts(lengths: list[int], n: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [
        torch.randint(10, vocab, (lengths[i % len(lengths)],), generator=g).tolist()
        for i in range(n)
    ]


def summarize(runs: list[Decoded]) -> dict:
    """Medians over prompts; a step is a verify forward (with its draft), or one target token."""
    steps = [len(r.accepted_lengths) or r.decode_tokens for r in runs]
    return {
        "ms_per_step": 1e3
        * statistics.median(r.decode_s / max(1, s) for r, s in zip(runs, steps, strict=True)),
        "ms_prefill": 1e3 * statistics.median(r.prefill_s for r in runs),
        "steps": statistics.median(steps),
        "tau": statistics.median(r.acceptance_length or 1.0 for r in runs),
        "decode_tokens_per_s": statistics.median(r.decode_tokens_per_s for r in runs),
    }


def time_method(name: str, fn, prompts: list[list[int]]) -> dict:
    fn(prompts[0])  # warm-up, untimed: graph capture, allocator, kernel selection
    row = summarize([fn(p) for p in prompts])
    say(f"  {name:<28}{row['ms_per_step']:8.2f} ms/step  tau {row['tau']:.2f}")
    return row


def check_captures(engine: Engine, label: str, prompts: list[list[int]]) -> dict[str, int]:
    """Every step kind the engine ran (engine.steps) captured exactly once with graphs, never
    without: a recapture would mean a prompt length leaked into a step's shapes."""
    captures = dict(engine.captures)
    expected = {kind: 1 for kind in engine.steps} if engine.graphs else {}
    if captures != expected:
        lengths = sorted({len(p) for p in prompts})
        raise RuntimeError(
            f"{label}: graph captures {captures} after prompts of lengths {lengths}; expected "
            f"{expected} (one capture per step kind)"
        )
    return captures


def measure_engine(model, drafter, graphs: bool, compile: bool, max_len: int, prompts, args):
    label = {(True, True): "engine", (True, False): "engine (graphs, no compile)"}.get(
        (graphs, compile), "engine (no graphs)"
    )
    t0 = time.perf_counter()
    engine = Engine(model, max_len, drafter, graphs=graphs, compile=compile)
    new = args.new_tokens
    methods = {
        "target": partial(engine.greedy, max_new_tokens=new, stop_ids=set()),
        "dflash": partial(engine.dflash, max_new_tokens=new, stop_ids=set()),
    }
    for b in args.budgets:
        methods[f"ddtree@{b}"] = partial(
            engine.ddtree, max_new_tokens=new, stop_ids=set(), budget=b, top_k=args.top_k
        )
    rows = {f"{label} {m}": time_method(f"{label} {m}", fn, prompts) for m, fn in methods.items()}
    captures = check_captures(engine, label, prompts)
    shortest = min(prompts, key=len)
    steps = list(engine.steps) if args.profile else []
    profiles = {k: profile_step(engine, k, shortest, args.profile) for k in steps}
    if graphs == compile:  # the engine's defaults (or neither): its rows under load too
        rows |= {f"{label} rows c={c} {m}": r for c in args.concurrency
                 for m, r in measure_rows(engine, c, prompts, new).items()}  # fmt: skip
    say(f"  {label} captures per step kind: {captures}; {time.perf_counter() - t0:.0f} s in all "
        "(compilation and capture included)")  # fmt: skip
    return label, rows, captures, profiles


def measure_rows(engine: Engine, c: int, prompts: list[list[int]], new: int) -> dict:
    """Target-only and DFlash on `c` rows of the engine's models (ConcurrentEngine), 2 x c
    prompts cycling through the given ones' lengths, after one untimed decode of c prompts
    (its compile and captures): ms per step and generated tok/s of the whole decode."""
    rows = ConcurrentEngine(engine, c)
    queue = [prompts[i % len(prompts)] for i in range(2 * c)]
    out = {}
    for m in ("target", "dflash"):
        rows.prepare(m)
        rows.decode(m, queue[:c], new, set())  # warm-up, untimed
        decoded, wall = rows.decode(m, queue, new, set())
        tokens = sum(len(d.output_ids) for d in decoded)
        out[m] = {"ms_per_step": 1e3 * wall / max(1, rows.steps_run), "steps": rows.steps_run,
                  "tau": tokens / max(1, rows.steps_run) / c, "decode_tokens_per_s": tokens / wall}  # fmt: skip
        say(f"  rows c={c} {m:<8}{out[m]['ms_per_step']:8.2f} ms/step  "
            f"{out[m]['decode_tokens_per_s']:9.1f} tok/s")  # fmt: skip
    del rows
    return out


def profile_step(engine: Engine, kind: str, prompt: list[int], replays: int) -> dict:
    """One step kind replayed `replays` times after a prefill of `prompt`, each followed by a
    sync (the loop's one read-back), under torch.profiler: device kernels per step, their
    summed time per step (GPU busy) against the wall time per step, and the kernels taking the
    most of it. Busy well below wall: the device waits on launches or the host."""
    from torch.profiler import ProfilerActivity, profile

    cuda = engine.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    engine.capture([kind])
    with torch.no_grad():
        engine._prefill(prompt, taps=engine.drafter is not None)
    engine.run(kind)  # one untimed replay
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        t = time.perf_counter()
        for _ in range(replays):
            engine.run(kind)
            if cuda:
                torch.cuda.synchronize()
        wall = (time.perf_counter() - t) / replays
    device_type = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    kernels = [
        e for e in prof.events()
        if e.device_type == device_type and (cuda or e.name.startswith("aten::"))
    ]  # fmt: skip
    per_name: dict[str, float] = {}
    for e in kernels:  # a device kernel's own duration (on the CPU: the op's, nested included)
        per_name[e.name] = per_name.get(e.name, 0.0) + e.time_range.elapsed_us()
    top = sorted(per_name.items(), key=lambda kv: -kv[1])[:12]
    row = {
        "kernels_per_step": len(kernels) / replays,
        "busy_us_per_step": sum(per_name.values()) / replays if cuda else None,
        "wall_us_per_step": wall * 1e6,
        "top_kernels_us_per_step": {n: t / replays for n, t in top},
    }
    busy = f"{row['busy_us_per_step']:.0f}" if cuda else "-"
    say(f"  profile {kind:<14}{row['kernels_per_step']:6.0f} kernels/step, busy {busy} us, "
        f"wall {row['wall_us_per_step']:.0f} us per step")  # fmt: skip
    return row


def measure_shape(name: str, args, device: torch.device, dtype: torch.dtype) -> dict:
    model, drafter, taps = build(SHAPES[name], device, dtype, args.smoke, args.block,
                                 args.architecture)  # fmt: skip
    prompts = make_prompts(args.prompt_lens, args.prompts, model.config.vocab_size)
    new = args.new_tokens
    params = sum(p.numel() for p in model.parameters()) / 1e6
    say(f"{name}: {type(model).__name__}, {params:,.1f} M parameters, taps {taps}, "
        f"prompt lengths {[len(p) for p in prompts]}, {new} new tokens")  # fmt: skip
    target = Target(model, taps)
    rows = {
        "eager target": time_method(
            "eager target", lambda ids: greedy_decode(target, ids, new, set()), prompts
        ),
        "eager dflash": time_method(
            "eager dflash",
            lambda ids: speculative_decode(target, DFlashProposer(drafter), ids, new, set()),
            prompts,
        ),
    }
    target.close()  # its hooks would fire in no engine step, but keep the model bare
    # prompt + new tokens + the widest step's slots past T (a block, or a tree and its root)
    max_len = max(args.prompt_lens) + new + max(args.block, max(args.budgets) + 1)
    if args.capacity:  # evaluate sizes its buffers by its longest prompt (784 slots, quality)
        if args.capacity < max_len:
            raise SystemExit(f"--capacity {args.capacity} is below the {max_len} slots needed")
        max_len = args.capacity
    cuda = device.type == "cuda"
    settings = [(cuda, cuda)]  # (graphs, compile): the engine's defaults
    settings += [(True, False)] if args.no_compile_too and cuda else []
    settings += [(False, False)] if args.no_graphs_too and cuda else []
    captures, profiles, loops = {}, {}, []
    for graphs, compile in settings:
        label, engine_rows, captures[label], profiles[label] = measure_engine(
            model, drafter, graphs, compile, max_len, prompts, args
        )
        rows |= engine_rows
        loops.append(label)
    add_ratios(rows)
    out = {
        "taps": taps,
        "prompt_lengths": [len(p) for p in prompts],
        "max_len": max_len,
        "methods": rows,
        "captures": captures,
        "profiles": profiles,  # per engine, per step kind (--profile)
        "goals": goals(name, rows, loops[0]),
    }
    if device.type == "cuda":
        out["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    return out


def add_ratios(rows: dict[str, dict]) -> None:
    """x target step: against the target-only step of the same loop; x eager target step:
    against the eager loop's."""
    eager = rows["eager target"]["ms_per_step"]
    for name, row in rows.items():
        loop = name.rsplit(" ", 1)[0]
        row["x_target_step"] = row["ms_per_step"] / rows[f"{loop} target"]["ms_per_step"]
        row["x_eager_target_step"] = row["ms_per_step"] / eager


def goals(name: str, rows: dict[str, dict], loop: str) -> dict:
    """The issue's targets, measured on the main engine (graphs on CUDA)."""
    target = rows[f"{loop} target"]
    out = {
        "engine_speedup": rows["eager target"]["ms_per_step"] / target["ms_per_step"],
        "engine_ms_per_token": target["ms_per_step"],
        "dflash_target_steps": rows[f"{loop} dflash"]["x_target_step"],
    }
    out["met"] = {
        "speedup": out["engine_speedup"] >= GOALS["speedup"],
        "dflash_steps": out["dflash_target_steps"] <= GOALS["dflash_steps"],
    }
    if name == "smollm2":  # the ms-per-token goal is set at this shape only
        out["met"]["ms_per_token"] = out["engine_ms_per_token"] <= GOALS["ms_per_token"]
    return out


def report(res: dict, shapes: list[str]) -> None:
    for name in shapes:
        g = res[name]["goals"]
        ms = f", goal <= {GOALS['ms_per_token']}" if name == "smollm2" else ""
        print(f"{name}: engine target step {g['engine_speedup']:.1f}x faster than eager "
              f"(goal >= {GOALS['speedup']:.0f}x), "
              f"{g['engine_ms_per_token']:.2f} ms per token{ms}; "
              f"DFlash step {g['dflash_target_steps']:.2f} target steps "
              f"(goal <= {GOALS['dflash_steps']}); met {g['met']}; "
              f"captures {res[name]['captures']}")  # fmt: skip
    print("\n| shape | method | ms/step | x target step | x eager target step |")
    print("|---|---|---:|---:|---:|")
    for name in shapes:
        for method, r in res[name]["methods"].items():
            print(f"| {name} | {method} | {r['ms_per_step']:.2f} | {r['x_target_step']:.2f} "
                  f"| {r['x_eager_target_step']:.3f} |")  # fmt: skip
    rows = [(n, e, k, p) for n in shapes for e, kinds in res[n]["profiles"].items()
            for k, p in kinds.items()]  # fmt: skip
    if rows:
        print("\n| shape | engine | step kind | kernels/step | GPU busy us/step | wall us/step |")
        print("|---|---|---|---:|---:|---:|")
        for name, engine, kind, p in rows:
            busy = "-" if p["busy_us_per_step"] is None else f"{p['busy_us_per_step']:.0f}"
            print(f"| {name} | {engine} | {kind} | {p['kernels_per_step']:.0f} | {busy} "
                  f"| {p['wall_us_per_step']:.0f} |")  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--prompt-lens", type=int, nargs="+", default=[200, 256, 300])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--budgets", type=int, nargs="+", default=[16, 32, 64, 128])
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--block", type=int, default=16, help="drafter block size (quality: 8)")
    ap.add_argument("--architecture", choices=["dflash", "dflash2"], default="dflash",
                    help="the drafter's: dflash2 adds its convolutions and selector")  # fmt: skip
    ap.add_argument(
        "--capacity",
        type=int,
        default=0,
        help="engine max_len (0: what the prompts need; quality's evaluate: 784)",
    )
    ap.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="also profile N replays of each step kind: kernels and GPU busy time",
    )
    ap.add_argument(
        "--concurrency",
        type=int,
        nargs="*",
        default=[],
        metavar="C",
        help="also the concurrent engine at these row counts (target, dflash)",
    )
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--no-graphs-too", action="store_true", help="also an engine without graphs")
    ap.add_argument(
        "--no-compile-too", action="store_true", help="also an engine with graphs, uncompiled"
    )
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, float32")
    ap.add_argument("--out", default="evaluate.json")
    args = ap.parse_args(argv)
    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke else getattr(torch, args.dtype)
    if args.smoke:
        args.prompt_lens, args.new_tokens = SMOKE_PROMPT_LENS, SMOKE_NEW_TOKENS
    res = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "args": vars(args),
    }
    for name in args.shapes:
        res[name] = measure_shape(name, args, device, dtype)
        Path(args.out).write_text(json.dumps(res, indent=2))  # each shape kept as it finishes
        gc.collect()  # the engine's step closures hold cycles: free the model's memory now
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
    report(res, args.shapes)
    return res


if __name__ == "__main__":
    main()
