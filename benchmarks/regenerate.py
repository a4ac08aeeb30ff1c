"""Generation throughput of the regenerate stage's batching vs plain `generate()` at batch 1.

Target: a SmolLM2-135M-shaped Llama (the config in benchmarks/smollm2-135m.json, read from the
GGUF's metadata) with random bf16 weights: speed does not depend on weight values. Random weights
never emit EOS, so every row generates exactly `--new-tokens` tokens.

    python benchmarks/regenerate.py --batch-sizes 1 32 128 256 --new-tokens 256 --out $OUT/regen.json
    python benchmarks/regenerate.py --batch-sizes 256 512 --caches static --width 512 \
        --lengths-file lengths.json     # a real prompt table's token counts, every batch at 512

    python benchmarks/regenerate.py --batch-sizes 512 1024 --caches static --width 512 \
        --lengths-file benchmarks/smollm2-sharegpt-prompt-lengths.json \
        --attns sdpa hf_sdpa flex_attention   # attention kernels at the recipe's shapes
    python benchmarks/regenerate.py --profile 1024 --caches static --width 512 --new-tokens 64 \
        --lengths-file benchmarks/smollm2-sharegpt-prompt-lengths.json   # where a step's time goes
    python benchmarks/regenerate.py --same-answers 64 --attns sdpa hf_sdpa --width 512 \
        --new-tokens 48 --lengths-file benchmarks/smollm2-sharegpt-prompt-lengths.json

benchmarks/smollm2-sharegpt-prompt-lengths.json: the token counts (chat template applied) of the
22,880 prompts of configs/smollm2-sharegpt.yaml's train table that regenerate answers (<= 512
tokens; mean 176), from the table rebuilt on 2026-12-04.

Prints one table: generated tokens/s per batch size and per method, and the ratio to plain
`generate()` at batch 1 measured in the same run. `--attns`: the target's attention
implementation per row, as `target.attn_implementation` names it (the model rebuilt and compile
caches reset for each): `sdpa` is the stage's (dflashpipe.attention: the query heads of a KV head
folded into the query length), `hf_sdpa` transformers' own, which under a padding mask on CUDA
copies each KV head over its query heads (a copy of the cache per layer per step).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from dflashpipe import attention
from dflashpipe.regenerate import generate_batch

HERE = Path(__file__).resolve().parent


def build_model(device: torch.device, attn: str = "sdpa") -> LlamaForCausalLM:
    """The SmolLM2 shape with `attn` as the config's target.attn_implementation names it ("sdpa":
    the stage's folded SDPA, "hf_sdpa": transformers' own; see the docstring)."""
    torch._dynamo.reset()  # compiled decode steps of the previous model/attention go
    config = LlamaConfig(
        **json.loads((HERE / "smollm2-135m.json").read_text()),
        attn_implementation=attention.implementation(attn),
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    return model.eval().requires_grad_(False)


def prompts(n: int, vocab: int, seed: int = 0, lengths_file: str | None = None) -> list[list[int]]:
    """n random prompts of 40-200 tokens, or of lengths drawn from a JSON list (e.g. a real
    prompt table's token counts)."""
    g = torch.Generator().manual_seed(seed)
    if lengths_file:
        pool = torch.tensor(json.loads(Path(lengths_file).read_text()))
        lengths = pool[torch.randint(len(pool), (n,), generator=g)].tolist()
    else:
        lengths = torch.randint(40, 200, (n,), generator=g).tolist()
    return [torch.randint(100, vocab, (k,), generator=g).tolist() for k in lengths]


def timed(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def bench_plain(model, ps, new_tokens: int) -> float:
    """Reference: plain generate(), one prompt at a time."""
    cfg = GenerationConfig(
        max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0
    )

    def go():
        for p in ps:
            model.generate(input_ids=torch.tensor([p], device=model.device), generation_config=cfg)

    model.generate(input_ids=torch.tensor([ps[0]], device=model.device), generation_config=cfg)
    return len(ps) * new_tokens / timed(go)


def stage_config(new_tokens: int, cache: str) -> GenerationConfig:
    """The stage path's greedy decoding of exactly `new_tokens` tokens (random weights: token 1
    stands in for the end of a turn, token 0 pads) with a `cache` KV cache."""
    return GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                            pad_token_id=0, eos_token_id=[1], cache_implementation=cache)  # fmt: skip


def bench_stage(model, ps, batch: int, new_tokens: int, cache: str, width: int = 0) -> float:
    """The stage's path: left-padded, length-sorted batches through generate_batch (width: every
    batch padded to at least this, as the stage pads a static-cache shard to its widest prompt)."""
    cfg = stage_config(new_tokens, cache)
    ps = sorted(ps, key=len, reverse=True)

    def go():
        for i in range(0, len(ps), batch):
            generate_batch(model, ps[i : i + batch], cfg, {1}, batch, width)

    generate_batch(model, ps[:batch], cfg, {1}, batch, width)  # warm-up (allocator, compile)
    return len(ps) * new_tokens / timed(go)


def profile(model, ps, batch: int, new_tokens: int, cache: str, width: int, name: str) -> None:
    """Where one batch's time goes: the stage's path (generate_batch) under torch.profiler after
    a warm-up batch; prints the wall time per decoding step, how much of it the GPU was busy,
    and the ops with the most self time on the GPU and on the CPU."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    cfg = stage_config(new_tokens, cache)
    rows = sorted(ps, key=len, reverse=True)[:batch]
    generate_batch(model, rows, cfg, {1}, batch, width)  # warm-up (allocator, compile)
    acts = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    with torch_profile(activities=acts) as prof:
        wall = timed(lambda: generate_batch(model, rows, cfg, {1}, batch, width))
    events = prof.key_averages()
    gpu_us = sum(e.self_device_time_total for e in events)
    print(f"\n== {name}: batch {batch}, {new_tokens} new tokens: {wall:.2f} s, "
          f"{1e3 * wall / new_tokens:.1f} ms per step, GPU busy {gpu_us / 1e6:.2f} s "
          f"({gpu_us / 1e4 / wall:.0f}%)", flush=True)  # fmt: skip
    for key in ("self_device_time_total", "self_cpu_time_total"):
        print(events.table(sort_by=key, row_limit=15, max_name_column_width=60), flush=True)


def same_answers(device, ps, attns: list[str], new_tokens: int, width: int) -> None:
    """Whether the attention implementations give the same greedy answers: float32, one static-
    cache batch of these prompts through the stage's path (compiled decoding); prints how many
    rows of each match the first's."""
    cfg = stage_config(new_tokens, "static")
    rows = sorted(ps, key=len, reverse=True)
    answers = {}
    for attn in attns:
        model = build_model(device, attn).float()
        answers[attn] = generate_batch(model, rows, cfg, {1}, len(rows), width)
        del model
        torch.cuda.empty_cache()
    first = answers[attns[0]]
    for attn in attns[1:]:
        same = sum(a == b for a, b in zip(first, answers[attn], strict=True))
        print(f"same answers: {attn} matches {attns[0]} on {same} of {len(first)} rows "
              f"(float32, {new_tokens} greedy tokens)", flush=True)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32, 128, 256])
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--prompts", type=int, default=512)
    ap.add_argument("--caches", nargs="+", default=["dynamic", "static"])
    ap.add_argument("--out", default="regen.json")
    ap.add_argument("--lengths-file", default=None, help="JSON list of prompt lengths to draw from")
    ap.add_argument("--width", type=int, default=0, help="pad every batch to at least this width")
    ap.add_argument("--attns", nargs="+", default=["sdpa"],
                    help="attention implementations: sdpa, hf_sdpa, flex_attention, eager")  # fmt: skip
    ap.add_argument("--profile", type=int, default=0, metavar="BATCH",
                    help="instead: profile one batch of BATCH rows per --attns/--caches through "
                         "the stage's path (after a warm-up) and print its top ops")  # fmt: skip
    ap.add_argument("--same-answers", type=int, default=0, metavar="ROWS",
                    help="instead: compare the --attns' float32 greedy answers on ROWS prompts")  # fmt: skip
    args = ap.parse_args()
    device = torch.device("cuda")
    model = build_model(device)
    ps = prompts(args.prompts, model.config.vocab_size, lengths_file=args.lengths_file)
    if args.same_answers:
        same_answers(device, ps[: args.same_answers], args.attns, args.new_tokens, args.width)
        return
    if args.profile:
        for attn in args.attns:
            for cache in args.caches:
                profile(build_model(device, attn), ps, args.profile, args.new_tokens, cache,
                        args.width, f"{attn}, {cache} cache")  # fmt: skip
        return
    base = bench_plain(model, ps[:8], args.new_tokens)
    rows = [{"method": "generate() batch 1", "batch": 1, "tok_s": base, "ratio": 1.0}]
    for attn in args.attns:
        del model
        torch.cuda.empty_cache()
        model = build_model(device, attn)
        for cache in args.caches:
            for b in args.batch_sizes:
                n = max(b, min(len(ps), 2 * b))
                try:
                    tok_s = bench_stage(model, ps[:n], b, args.new_tokens, cache, args.width)
                except Exception as e:  # one kernel failing must not lose the others' rows
                    print(f"{attn} {cache} batch {b}: {type(e).__name__}: {e}"[:500], flush=True)
                    continue
                rows.append({"method": f"stage ({cache} cache, {attn})", "batch": b,
                             "tok_s": tok_s, "ratio": tok_s / base})  # fmt: skip
                print(json.dumps(rows[-1]), flush=True)
    Path(args.out).write_text(
        json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=2)
    )
    print(f"\n{'method':<42}{'batch':>6}{'tok/s':>12}{'x base':>9}")
    for r in rows:
        print(f"{r['method']:<42}{r['batch']:>6}{r['tok_s']:>12.0f}{r['ratio']:>9.1f}")


if __name__ == "__main__":
    main()
