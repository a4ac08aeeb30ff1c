"""Regenerate's decoding: the batched static-cache engine (decoding/batched.py) against today's
generate() path (padded, length-sorted batches, static cache), in one run, at two shapes:

    recipe     configs/smollm2-sharegpt.yaml: a SmolLM2-135M-shaped Llama (benchmarks/
               smollm2-135m.json, from the GGUF's metadata), 1,024 rows, prompts drawn from the
               recipe's real prompt lengths (benchmarks/smollm2-sharegpt-prompt-lengths.json:
               the 22,880 prompts of <= 512 tokens it answers, mean 176), real stopping drawn
               from its answers' lengths (below), max_new_tokens 256: cache 512 + 256 slots
    qwen3-8b   Qwen3-8B's shapes (36 layers, hidden 4,096, 8 KV heads): 256 rows, prompts of 768
               tokens answered to 256: 1K-token contexts

Random bf16 weights (speed does not depend on weight values); they never emit a stop token, so
each request carries its answer's length: the engine refills a row when it is reached, and
generate() decodes a batch until its longest answer ends (as it does with real answers). Real
stopping at the recipe's shapes: 65.1% of its answers reach the 256-token cap (RESULTS.md: 14,903
of 22,880) and the others average 95 tokens (8.60 M tokens over 22,880 sequences whose prompts
average 176): drawn uniformly from 1..190. `--answer-lengths FILE` takes real ones instead.

Printed per shape and path: generated tok/s (useful tokens over the whole run: prefills, refills
and the tail included) and the ms per decode step, each against its bound on the card the run
finds (`dflashpipe.cards`: H100 SXM 3.35 TB/s, H200 4.8 TB/s, both 989 TFLOP/s dense bf16; the
card and its figures are printed; `--hbm-tbs` / `--tflops` override them). A step's bound is
the bytes it reads (the weights once, the embedding table only where the LM head is not it, and
the whole static cache the step attends over: rows x slots x layers x 2 x kv_heads x head_dim x
2 bytes) over the card's bandwidth. A run's bound adds the two floors of its work: every answer
token decoded at that step bound with every row busy (answer tokens / rows steps), and every
prompt prefilled at the card's dense bf16 peak (2 x the decoder's matrix weights per token, the
causal attention over each prompt, the LM head once per prompt), so at Qwen3-8B's shapes, where
52 packs of 8,192 prompt tokens are compute-bound, the share is of something reachable. The
engine's step is timed alone too (idle rows, same kernels, the whole cache); in a run its steps
attend over a share of the cache (`span` below), so a run's tok/s may pass its bound's share.
generate() decodes as many rows per call as the card's free memory holds (its static cache and
prefill: `decoding/memory.generate_rows`, as regenerate's `engine: hf` does); `per_call` says how
many.

    python benchmarks/regenerate.py --out $OUT/regen.json                  # both shapes, both paths
    python benchmarks/regenerate.py --hbm-tbs 3.35 --tflops 989            # a card not in the table
    python benchmarks/regenerate.py --shapes qwen3-8b --paths engine       # one cell
    python benchmarks/regenerate.py --smoke                                # CPU, tiny shapes, < 1 min
    python benchmarks/regenerate.py --shapes recipe --paths engine --refill-rows 16 64 256
                                                                           # sweep the refill rule
    python benchmarks/regenerate.py --shapes recipe --paths engine --attention dense flex
                                                        # each row's own KV blocks (flex) or not
    python benchmarks/regenerate.py --tiny-model --paths engine --pack-tokens 2048
                                  # CPU: the refill rule's figures at the real rows and lengths

The engine's cells also give its refill figures: `active` (the share of row-steps that made a
token: what gathered refills cost), `prefills` (pack forwards in the run), `fill` (the packs'
prompt tokens over their length) and `span` (the share of the cache its steps attended over:
each takes the shortest quarter that holds its busy rows). Requests go in longest prompt first,
as regenerate's plan feeds them; every graph is captured before the timed run.

Diagnostics of the generate() path (CUDA): `--profile BATCH` (where a batch's step time goes,
torch.profiler) and `--same-answers ROWS` (float32 greedy answers of attention implementations).
`--same-as-generate CONFIG PROMPTS --count 64`: the engine's greedy answers against generate()'s
on a run's real prompts with the config's real target, float32 and bf16 (the GPU check of the
stage's answers; the suite checks the same on the CPU with fewer, shorter answers).
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from dflashpipe import attention
from dflashpipe.cards import Card, card
from dflashpipe.decoding.batched import ATTENTIONS, BatchedEngine, Request
from dflashpipe.decoding.hf_generate import fitting_rows, generate_batch

HERE = Path(__file__).resolve().parent
AT_CAP, STOPPED_MEAN = 14903 / 22880, 95  # the recipe's answers (module docstring)
QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                max_position_embeddings=40960, rope_theta=1e6, tie_word_embeddings=False)  # fmt: skip


@dataclass
class Shape:
    name: str
    rows: int  # the engine's row slots = generate()'s batch
    requests: int
    max_new: int
    prompt: int | None  # every prompt's length, or None: the recipe's lengths file
    real_stops: bool  # answer lengths from the recipe's distribution, else all max_new
    width: int  # generate()'s padded prompt width (the stage pads to the shard's widest)


SHAPES = {
    "recipe": Shape("recipe", 1024, 4096, 256, None, True, 512),
    "qwen3-8b": Shape("qwen3-8b", 256, 512, 256, 768, False, 1024),
}
SMOKE = {
    "recipe": Shape("recipe", 4, 12, 16, None, True, 64),
    "qwen3-8b": Shape("qwen3-8b", 4, 8, 8, 24, False, 64),
}


def build_model(name: str, device: torch.device, smoke: bool = False, attn: str = "sdpa"):
    """Random weights in the shape's architecture (bf16 on CUDA, float32 on the CPU); `attn`:
    the attention of generate() as target.attn_implementation names it."""
    torch._dynamo.reset()  # compiled steps of a previous model go
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    impl = attention.implementation(attn)
    if name == "recipe":
        sizes = json.loads((HERE / "smollm2-135m.json").read_text())
        tiny = dict(vocab_size=512, hidden_size=72, intermediate_size=128, num_hidden_layers=2,
                    head_dim=8)  # fmt: skip
        config = LlamaConfig(**{**sizes, **(tiny if smoke else {})}, attn_implementation=impl)
        cls = LlamaForCausalLM
    else:
        tiny = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16)  # fmt: skip
        config = Qwen3Config(**{**QWEN3_8B, **(tiny if smoke else {})}, attn_implementation=impl)
        cls = Qwen3ForCausalLM
    torch.manual_seed(0)
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # an 8B model built in float32 first would take 32 GB
    try:
        with torch.device(device):
            model = cls(config)
    finally:
        torch.set_default_dtype(before)
    return model.eval().requires_grad_(False)


def prompts(n: int, vocab: int, seed: int = 0, lengths_file: str | None = None,
            length: int | None = None, cap: int | None = None) -> list[list[int]]:  # fmt: skip
    """n random prompts of `length` tokens, or of lengths drawn from a JSON list (a real prompt
    table's token counts; at most `cap`), or of 40-200 tokens."""
    g = torch.Generator().manual_seed(seed)
    if length:
        lengths = [length] * n
    elif lengths_file:
        pool = torch.tensor(json.loads(Path(lengths_file).read_text()))
        lengths = pool[torch.randint(len(pool), (n,), generator=g)].clamp(max=cap).tolist()
    else:
        lengths = torch.randint(40, 200, (n,), generator=g).tolist()
    return [torch.randint(100, vocab, (k,), generator=g).tolist() for k in lengths]


def answer_lengths(n: int, cap: int, real: bool, seed: int = 1, file: str | None = None):
    """Each request's answer length: the recipe's stopping (module docstring), a file's, or cap."""
    g = torch.Generator().manual_seed(seed)
    if file:
        pool = torch.tensor(json.loads(Path(file).read_text()))
        return pool[torch.randint(len(pool), (n,), generator=g)].clamp(1, cap).tolist()
    if not real:
        return [cap] * n
    stopped = torch.randint(1, min(cap, 2 * STOPPED_MEAN + 1), (n,), generator=g)
    return torch.where(torch.rand(n, generator=g) < AT_CAP, cap, stopped).tolist()


def step_bytes(model, rows: int, slots: int) -> int:
    """What one decode step of `rows` rows over a static cache of `slots` slots reads: every
    weight once (the input embedding only where it is the LM head too: otherwise a step reads
    `rows` of its rows), and the whole cache (K and V of every layer)."""
    embed = model.get_input_embeddings().weight
    tied = embed.data_ptr() == model.get_output_embeddings().weight.data_ptr()
    seen, weights = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen and (tied or p is not embed):
            seen.add(p.data_ptr())
            weights += p.numel() * p.element_size()
    attn = model.get_decoder().layers[0].self_attn
    kv = len(model.get_decoder().layers) * 2 * attn.k_proj.weight.numel() // attn.k_proj.in_features
    return weights + rows * slots * kv * embed.element_size()


def prefill_flops(model, prompt_lengths: list[int]) -> float:
    """FLOPs of prefilling these prompts: 2 x the decoder layers' matrix weights per token, the
    causal attention (QK^T and PV: 2 x 2 x layers x heads x head_dim x length^2 / 2) and the LM
    head at each prompt's last token."""
    layers = model.get_decoder().layers
    matrices = sum(p.numel() for p in layers.parameters() if p.dim() == 2)
    attn = layers[0].self_attn
    q_width = attn.q_proj.weight.shape[0]  # heads x head_dim
    head = model.get_output_embeddings().weight.numel()
    return sum(2 * matrices * n + 2 * len(layers) * q_width * n * n + 2 * head
               for n in prompt_lengths)  # fmt: skip


def run_bound(model, shape: Shape, ps, lengths, slots: int, gpu: Card) -> dict:
    """A run's floors on the card (module docstring): a decode step reading the weights and the
    whole cache of `slots`, every row busy, and every prompt prefilled at the dense bf16 peak;
    None where the card's figures are unknown (the CPU)."""
    if not (gpu.hbm_bytes_per_s and gpu.bf16_flops):
        return {"bound_ms": None, "bound_tok_s": None, "prefill_bound_s": None}
    step = step_bytes(model, shape.rows, slots) / gpu.hbm_bytes_per_s
    prefill = prefill_flops(model, [len(p) for p in ps]) / gpu.bf16_flops
    total = sum(lengths) / shape.rows * step + prefill
    return {"bound_ms": 1e3 * step, "bound_tok_s": sum(lengths) / total, "prefill_bound_s": prefill}


def timed(fn, device: torch.device) -> float:
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def bench_engine(model, shape: Shape, ps, lengths, gpu: Card, pack: int | None = None,
                 refill: int | None = None, attention: str = "dense") -> dict:  # fmt: skip
    """The engine over every request (after a warm-up call that compiles, and every graph
    captured: `prepare`), then its step alone (idle rows). `pack` / `refill` / `attention`: the
    engine's pack_tokens / refill_rows (None: its defaults) / attention. Recompiling during the
    timed run fails loudly."""
    slots = max(map(len, ps)) + shape.max_new
    engine = BatchedEngine(model, shape.rows, slots, pack_tokens=pack, refill_rows=refill,
                           attention=attention)  # fmt: skip
    requests = [
        Request(str(i), p, None, n) for i, (p, n) in enumerate(zip(ps, lengths, strict=True))
    ]
    requests.sort(key=lambda r: -len(r.prompt))  # longest first, as regenerate's plan feeds it
    short = [Request(r.name, r.prompt, None, 2) for r in requests[: 2 * shape.rows]]
    warm = timed(lambda: (engine.prepare(), list(engine.generate(short, 2, set()))), engine.device)
    before = dict(engine.stats)
    torch._dynamo.config.error_on_recompile = True
    try:
        wall = timed(lambda: list(engine.generate(requests, shape.max_new, set())), engine.device)
        steps = engine.stats["steps"] - before.get("steps", 0)
        step = timed(lambda: engine.idle_steps(20), engine.device) / 20
    finally:
        torch._dynamo.config.error_on_recompile = False
    ran = engine.figures(before)
    row = {"path": "engine", "tok_s": sum(lengths) / wall,
           **run_bound(model, shape, ps, lengths, engine.capacity, gpu),
           "step_ms": 1e3 * wall / steps, "step_alone_ms": 1e3 * step, "warmup_s": warm, "steps": steps, "slots": engine.capacity,
           "pack_tokens": engine.pack, "refill_rows": engine.refill_rows, "attention": attention,
           "active_share": sum(lengths) / (steps * shape.rows),  # rows that made a token
           "prefills": ran["prefills"], "pack_fill": ran["pack_fill"],
           "span_share": ran["cache_read"], "captures_in_run": ran["captures"]}  # fmt: skip
    return row


def stage_config(new_tokens: int, cache: str) -> GenerationConfig:
    """The stage path's greedy decoding of exactly `new_tokens` tokens (random weights: token 1
    stands in for the end of a turn, token 0 pads) with a `cache` KV cache."""
    return GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                            pad_token_id=0, eos_token_id=[1], cache_implementation=cache)  # fmt: skip


def bench_generate(model, shape: Shape, ps, lengths, batches: int | None, gpu: Card) -> dict:
    """The stage's `engine: hf` path: length-sorted batches of `rows` padded to the shape's
    width, each decoded until its longest answer ends (compiled static cache on CUDA), in calls
    of as many rows as the free memory holds; `batches`: the first few."""
    cache = "static" if model.device.type == "cuda" else "dynamic"
    order = sorted(range(len(ps)), key=lambda i: -len(ps[i]))
    groups = [order[i : i + shape.rows] for i in range(0, len(order), shape.rows)][:batches]
    per_call = fitting_rows(model, shape.rows, shape.width, shape.max_new)

    def batch(group: list[int]) -> None:
        new = max(lengths[i] for i in group)
        generate_batch(model, [ps[i] for i in group], stage_config(new, cache), {1}, shape.rows,
                       shape.width, per_call)  # fmt: skip

    warm = timed(lambda: batch(groups[0]), model.device)  # compiles the decode step
    wall = sum(timed(lambda g=g: batch(g), model.device) for g in groups)
    steps = sum(max(lengths[i] for i in g) for g in groups)
    useful = sum(lengths[i] for g in groups for i in g)
    timed_ps = [ps[i] for g in groups for i in g]
    timed_lengths = [lengths[i] for g in groups for i in g]
    slots = shape.width + shape.max_new
    return {"path": "generate()", "tok_s": useful / wall,
            **run_bound(model, shape, timed_ps, timed_lengths, slots, gpu),
            "step_ms": 1e3 * wall / steps, "warmup_s": warm, "steps": steps, "slots": slots,
            "per_call": per_call}  # fmt: skip


def compare(args, device: torch.device, gpu: Card) -> list[dict]:
    rows = []
    for name in args.shapes:
        shape = (SMOKE if args.smoke else SHAPES)[name]
        model = build_model(name, device, args.smoke or args.tiny_model)
        lengths_file = str(HERE / "smollm2-sharegpt-prompt-lengths.json")
        cap = shape.width if shape.prompt is None else None
        ps = prompts(shape.requests, model.config.vocab_size, 0, lengths_file, shape.prompt, cap)
        lengths = answer_lengths(len(ps), shape.max_new, shape.real_stops, 1, args.answer_lengths)
        cells = [("generate", None, None, None) if path == "generate"
                 else ("engine", pack, refill, attn)
                 for path in args.paths for pack in args.pack_tokens
                 for refill in args.refill_rows for attn in args.attention]  # fmt: skip
        for path, pack, refill, attn in dict.fromkeys(cells):
            if path == "engine":
                row = bench_engine(model, shape, ps, lengths, gpu, pack, refill, attn)
            else:
                row = bench_generate(model, shape, ps, lengths, args.generate_batches, gpu)
            bound = row["bound_ms"] is not None
            row.update(shape=name, rows=shape.rows, tokens_per_answer=sum(lengths) / len(ps),
                       card=gpu.name,
                       step_bound_share=row["bound_ms"] / row.get("step_alone_ms", row["step_ms"])
                       if bound else None,
                       tok_s_bound_share=row["tok_s"] / row["bound_tok_s"] if bound else None)  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)
            gc.collect()  # the engine's graphs and cache (its steps hold it in a cycle)
            if device.type == "cuda":
                torch.cuda.empty_cache()
        del model
    return rows


def report(rows: list[dict], gpu: Card) -> None:
    print(f"\ncard: {gpu.describe()}; bounds over these figures")
    print(f"{'shape':<10}{'path':<12}{'attn':>6}{'rows':>6}{'pack':>6}{'refill':>7}{'tok/s':>10}"
          f"{'bound':>10}{'share':>7}{'ms/step':>9}{'alone':>8}{'bound':>8}{'share':>7}"
          f"{'active':>7}{'prefills':>9}{'fill':>6}{'span':>6}")  # fmt: skip
    for r in rows:
        engine = r["path"] == "engine"

        def cell(key: str, fmt: str, width: int, r=r, engine=engine, always=False) -> str:
            shown = (engine or always) and r.get(key) is not None
            return f"{r[key]:>{width}{fmt}}" if shown else f"{'-':>{width}}"

        print(f"{r['shape']:<10}{r['path']:<12}{cell('attention', '', 6)}{r['rows']:>6}"
              f"{cell('pack_tokens', '', 6)}"
              f"{cell('refill_rows', '', 7)}{r['tok_s']:>10.0f}{cell('bound_tok_s', '.0f', 10, always=True)}"
              f"{cell('tok_s_bound_share', '.0%', 7, always=True)}{r['step_ms']:>9.2f}"
              f"{cell('step_alone_ms', '.2f', 8)} {cell('bound_ms', '.3g', 7, always=True)}"
              f"{cell('step_bound_share', '.0%', 7, always=True)}{cell('active_share', '.0%', 7)}"
              f"{cell('prefills', '', 9)}{cell('pack_fill', '.0%', 6)}"
              f"{cell('span_share', '.0%', 6)}")  # fmt: skip
    by = {}
    for r in rows:  # the best engine cell of each shape
        key = (r["shape"], r["path"])
        by[key] = max(by.get(key, 0), r["tok_s"])
    for shape in dict.fromkeys(r["shape"] for r in rows):
        if (shape, "engine") in by and (shape, "generate()") in by:
            print(f"{shape}: engine {by[shape, 'engine'] / by[shape, 'generate()']:.2f}x "
                  "generate()'s generated tok/s")  # fmt: skip


def profile(model, ps, batch: int, new_tokens: int, width: int) -> None:
    """Where one generate() batch's time goes (the stage's path, static cache, after a warm-up
    batch): wall time per decoding step, how much of it the GPU was busy, and the ops with the
    most self time on the GPU and on the CPU."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    cfg = stage_config(new_tokens, "static")
    rows = sorted(ps, key=len, reverse=True)[:batch]
    generate_batch(model, rows, cfg, {1}, batch, width)  # warm-up (allocator, compile)
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        wall = timed(lambda: generate_batch(model, rows, cfg, {1}, batch, width), model.device)
    events = prof.key_averages()
    gpu_us = sum(e.self_device_time_total for e in events)
    print(f"\n== batch {batch}, {new_tokens} new tokens: {wall:.2f} s, "
          f"{1e3 * wall / new_tokens:.1f} ms per step, GPU busy {gpu_us / 1e6:.2f} s "
          f"({gpu_us / 1e4 / wall:.0f}%)", flush=True)  # fmt: skip
    for key in ("self_device_time_total", "self_cpu_time_total"):
        print(events.table(sort_by=key, row_limit=15, max_name_column_width=60), flush=True)


def profile_engine(model, ps, rows: int, steps: int) -> None:
    """Where the batched engine's decode step goes (the recipe's rows and slots, after a warm-up
    that compiles and captures): the kernels with the most GPU time over `steps` idle steps,
    each replayed without graphs too, so the ops keep their names."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    engine = BatchedEngine(model, rows, 512 + 256)
    list(engine.generate([Request(str(i), p, None, 2) for i, p in enumerate(ps[:rows])], 2, set()))
    cuda = engine.device.type == "cuda"
    for graphs in (True, False) if cuda else (False,):
        engine.graphs = graphs
        engine.idle_steps(3)
        with torch_profile(
            activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]
        ) as prof:
            wall = timed(lambda: engine.idle_steps(steps), engine.device)
        events = prof.key_averages()
        gpu_us = sum(e.self_device_time_total if cuda else e.self_cpu_time_total for e in events)
        print(f"\n== engine step, graphs {graphs}: {1e3 * wall / steps:.2f} ms wall, GPU busy "
              f"{gpu_us / 1e3 / steps:.2f} ms per step", flush=True)  # fmt: skip
        key = "self_device_time_total" if cuda else "self_cpu_time_total"
        print(events.table(sort_by=key, row_limit=12,
                           max_name_column_width=70), flush=True)  # fmt: skip


def same_answers(device, ps, attns: list[str], new_tokens: int, width: int) -> None:
    """Whether attention implementations give generate() the same float32 greedy answers: one
    static-cache batch of these prompts each; prints how many rows match the first's."""
    cfg = stage_config(new_tokens, "static")
    rows = sorted(ps, key=len, reverse=True)
    answers = {}
    for attn in attns:
        model = build_model("recipe", device, attn=attn).float()
        answers[attn] = generate_batch(model, rows, cfg, {1}, len(rows), width)
        del model
        torch.cuda.empty_cache()
    first = answers[attns[0]]
    for attn in attns[1:]:
        same = sum(a == b for a, b in zip(first, answers[attn], strict=True))
        print(f"same answers: {attn} matches {attns[0]} on {same} of {len(first)} rows "
              f"(float32, {new_tokens} greedy tokens)", flush=True)  # fmt: skip


@torch.inference_mode()
def divergence(model, prompt: list[int], ref: list[int], got: list[int]) -> dict:
    """Where two greedy answers first differ, and how near a tie the reference's choice was
    there: one unpadded forward of the prompt and the common part, the gap between its top two
    logits (a gap at rounding level says the two kernels' sums rounded apart, not a bug)."""
    k = next((i for i, (a, b) in enumerate(zip(ref, got, strict=False)) if a != b),
             min(len(ref), len(got)))  # fmt: skip
    ids = torch.tensor([prompt + ref[:k]], device=model.device)
    logits = model(input_ids=ids).logits[0, -1].float()
    top = logits.topk(2).values
    return {"prompt_tokens": len(prompt), "position": k, "top2_gap": float(top[0] - top[1]),
            "gap_relative": float((top[0] - top[1]) / top[0].abs())}  # fmt: skip


def same_as_generate(config_path: str, prompts_path: str, count: int, device,
                     dtypes: tuple[str, ...] = ("float32", "bfloat16")) -> dict:  # fmt: skip
    """The engine's greedy answers against generate()'s (dynamic cache: transformers' own path)
    on the first `count` prompts of a run's prompt table, with the config's target, chat
    template, max_new_tokens and max_prompt_tokens: in float32 they must be equal; bf16 rounds a
    batch's rows differently, so there near-tied argmaxes may flip (counted, information)."""
    from dataclasses import replace

    import pyarrow.parquet as pq

    from dflashpipe.chat import encode_prompts, end_of_turn_ids
    from dflashpipe.config import load_config
    from dflashpipe.decoding.hf_generate import generation_config
    from dflashpipe.target import load_target

    cfg = load_config(config_path)
    gen = replace(cfg.regenerate, cache="dynamic", temperature=0.0)
    rows = pq.read_table(prompts_path).to_pylist()
    out = {}
    for dtype in dtypes:
        model, tok = load_target(replace(cfg.target, dtype=dtype), device)
        stops = end_of_turn_ids(tok)
        ps = encode_prompts(tok, [r["messages"] for r in rows], gen.enable_thinking)
        ps = [p for p in ps if len(p) <= (gen.max_prompt_tokens or len(p))][:count]
        engine = BatchedEngine(model, len(ps), max(map(len, ps)) + gen.max_new_tokens)
        requests = [Request(str(i), p) for i, p in enumerate(ps)]
        mine = {a.index: (a.tokens, a.finish) for a in engine.generate(requests,
                                                                       gen.max_new_tokens, stops)}  # fmt: skip
        pad = tok.pad_token_id if tok.pad_token_id is not None else min(stops)
        theirs = generate_batch(model, ps, generation_config(gen, stops, pad, model.device, False),
                                stops, len(ps))  # fmt: skip
        same = [list(mine[i][0]) == list(theirs[i][0]) for i in range(len(ps))]
        out[dtype] = {"prompts": len(ps), "same": sum(same),
                      "tokens": sum(len(t) for t, _ in theirs),
                      "stopped": sum(f == "stop" for _, f in theirs),
                      "divergences": [divergence(model, ps[i], list(theirs[i][0]), list(mine[i][0]))
                                      for i in range(len(ps)) if not same[i]]}  # fmt: skip
        print(f"{dtype}: the engine's greedy answers equal generate()'s on {sum(same)} of "
              f"{len(ps)} prompts ({out[dtype]['stopped']} stopped before {gen.max_new_tokens} "
              "tokens)", flush=True)  # fmt: skip
        for d in out[dtype]["divergences"][:8]:
            print(f"  prompt of {d['prompt_tokens']} tokens: first differs at answer token "
                  f"{d['position']}, where generate()'s top two logits are {d['top2_gap']:.3g} "
                  f"apart ({d['gap_relative']:.2g} of the top logit)", flush=True)  # fmt: skip
        del engine, model
        gc.collect()
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    ap.add_argument("--paths", nargs="+", choices=["engine", "generate"],
                    default=["engine", "generate"])  # fmt: skip
    ap.add_argument("--generate-batches", type=int, default=None,
                    help="time only the first N generate() batches (default: all)")  # fmt: skip
    ap.add_argument("--answer-lengths", default=None, help="JSON list of real answer lengths")
    ap.add_argument("--pack-tokens", type=int, nargs="+", default=[None],
                    help="the engine's prefill pack lengths to sweep (default: its own)")  # fmt: skip
    ap.add_argument("--refill-rows", type=int, nargs="+", default=[None],
                    help="the engine's refill gathering (free rows) to sweep (default: its own)")  # fmt: skip
    ap.add_argument("--attention", nargs="+", choices=ATTENTIONS, default=["dense"],
                    help="the engine's decode attention(s) to compare (flex: per-row KV blocks)")  # fmt: skip
    ap.add_argument("--hbm-tbs", type=float, default=None,
                    help="the card's HBM bandwidth in TB/s (default: dflashpipe.cards by name)")  # fmt: skip
    ap.add_argument("--tflops", type=float, default=None,
                    help="the card's dense bf16 peak in TFLOP/s (default: by name)")  # fmt: skip
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes (the suite runs it)")
    ap.add_argument("--tiny-model", action="store_true",
                    help="CPU: the shapes' rows, prompts and answers on a 2-layer model; only the "
                    "refill figures (steps, active, prefills, fill) mean anything")  # fmt: skip
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    ap.add_argument("--profile", type=int, default=0, metavar="BATCH",
                    help="instead: profile one generate() batch of BATCH recipe rows")  # fmt: skip
    ap.add_argument("--profile-engine", type=int, default=0, metavar="ROWS",
                    help="instead: profile the batched engine's decode step at ROWS rows")  # fmt: skip
    ap.add_argument("--same-answers", type=int, default=0, metavar="ROWS",
                    help="instead: compare --attns' float32 greedy answers on ROWS prompts")  # fmt: skip
    ap.add_argument("--attns", nargs="+", default=["sdpa", "hf_sdpa"])
    ap.add_argument("--same-as-generate", nargs=2, metavar=("CONFIG", "PROMPTS"),
                    help="instead: the engine's greedy answers against generate()'s on the first "
                    "--count prompts of a run's prompt table (float32 and bf16)")  # fmt: skip
    ap.add_argument("--count", type=int, default=64, help="--same-as-generate's prompts")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"],
                    choices=["float32", "bfloat16"], help="--same-as-generate's precisions")  # fmt: skip
    ap.add_argument("--new-tokens", type=int, default=64, help="--profile / --same-answers")
    args = ap.parse_args(argv)
    cpu = args.smoke or args.tiny_model or not torch.cuda.is_available()
    device = torch.device("cpu" if cpu else "cuda")
    if args.same_as_generate:
        res = same_as_generate(*args.same_as_generate, args.count, device, tuple(args.dtypes))
        if args.out:
            Path(args.out).write_text(json.dumps(res, indent=2))
        return []
    if args.profile or args.same_answers or args.profile_engine:
        lengths = str(HERE / "smollm2-sharegpt-prompt-lengths.json")
        n = max(args.profile, args.same_answers, args.profile_engine)
        ps = prompts(n, 49152, 0, lengths, cap=512)
        if args.profile_engine:
            profile_engine(build_model("recipe", device), ps, n, 10)
        elif args.same_answers:
            same_answers(device, ps, args.attns, args.new_tokens, 512)
        else:
            profile(build_model("recipe", device), ps, args.profile, args.new_tokens, 512)
        return []
    gpu = card(device, args.hbm_tbs, args.tflops)
    print(f"card: {gpu.describe()}", flush=True)
    rows = compare(args, device, gpu)
    report(rows, gpu)
    if args.out:
        name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
        facts = {"card": gpu.name, "hbm_bytes_per_s": gpu.hbm_bytes_per_s,
                 "bf16_flops": gpu.bf16_flops}  # fmt: skip
        Path(args.out).write_text(json.dumps({"device": name, **facts, "rows": rows}, indent=2))
    return rows


if __name__ == "__main__":
    main()
