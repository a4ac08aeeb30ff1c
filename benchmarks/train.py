"""Drafter training step speed (tokens/s, MFU) and loader decode speed, in one run.

Qwen3-8B drafter: 5 layers, hidden 4096, GQA 32/8, head_dim 128, MLP 12288, block 16, vocab
151936 (frozen random embedding and LM head), 512 anchors per 3072-token micro-batch, random
target features. The step is the train stage's (`objective.forward_loss`): `Drafter` forward
(float32 master weights, bf16 autocast, compiled layers, flex attention), `block_labels`, chunked
`dflash_loss` against the bf16 head, backward, clip, fused AdamW. FLOPs by
`metrics.step_flops` (formula in its docstring); MFU over the card's dense bf16 peak
(`dflashpipe.cards`: 989 TFLOP/s on an H100 SXM or H200).
Loader: `PackedBatches` decoding a bf16-zstd shard of the same shapes, per worker count.

--cells V...: instead, the step of each quality cell (benchmarks/quality/V.yaml on the SmolLM2
recipe, as quality.py merges them; `main`: the recipe) at the recipe's shapes: SmolLM2-135M's
sizes, the cell's drafter (layers, block, architecture), micro-batch (tokens, anchors) and
micro-batches an optimizer step (train.tokens_per_step; the time is per micro-batch), its
objective (train.loss, distill_weight, the ranking term, a DFlash2 drafter's selector term at its
full alpha), on random features packed as the recipe packs answers (--answer-tokens each) with
the target's final hidden state and top-1 stored (what the qx4 cells' features hold). The cells
take turns, --rounds rounds of --steps timed steps each (drift falls on all alike); each cell's
median ms per micro-batch and its ratio to the first cell's (issue 62's bound: 1.15).

    python benchmarks/train.py --steps 20 --out $OUT/train.json
    python benchmarks/train.py --cells qx4-ce qx4-kl qx4-greedy qx4-dpace qx4-el qx4-dflash2 \
        --out $OUT/cells.json
    python benchmarks/train.py --smoke        # tiny shapes on the CPU: checks the script
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import quality
import torch
from shapes import SHAPES, Shape

from dflashpipe.cards import card
from dflashpipe.codecs import encode, pack_topk
from dflashpipe.config import Config
from dflashpipe.data import PackedBatches, Sample, make_loader, to_device
from dflashpipe.metrics import step_flops
from dflashpipe.model import Drafter, DrafterConfig
from dflashpipe.objective import compute_head, forward_loss, selector_settings, train_objective
from dflashpipe.shards import ShardInfo, feature_row, write_shard

# The headline step: a Qwen3-8B drafter, one 3,072-token sequence a micro-batch
HEADLINE = dict(tokens=3072, anchors=512, layers=5, block=16)
SMOKE = dict(tokens=256, anchors=32, layers=2)  # with shapes.SMOKE's sizes
DISTINCT = 4  # distinct random sequences in the benchmark's shard


def say(*what) -> None:
    """A phase's progress, flushed: a run cut short by a time limit still shows where it was."""
    print(time.strftime("%H:%M:%S"), *what, flush=True)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def drafter(shape: Shape, smoke: bool, device: torch.device, layers: int, block: int,
            **fields) -> Drafter:  # fmt: skip
    """A random drafter sized like the shape's target (`fields`: drafter.model_fields(), e.g.
    architecture dflash2), on `device`, its layers compiled on a GPU as the stage's are."""
    cfg = DrafterConfig.from_target(shape.target_config(smoke), mask_token_id=5, num_layers=layers,
                                    block_size=block, target_layer_ids=shape.target_taps(smoke),
                                    **fields)  # fmt: skip
    V, H = cfg.vocab_size, cfg.hidden_size
    # float32 master weights and bf16 autocast, as the train stage holds them
    torch.manual_seed(0)
    embed = torch.randn(V, H, device=device) * 0.02
    head = torch.randn(V, H, device=device) * 0.02
    model = Drafter(cfg, embed, head).to(device)
    if device.type == "cuda":
        for layer in model.layers:
            layer.compile()
    return model


def random_shard(
    path: Path, cfg: DrafterConfig, n: int, length: int, final: bool = False
) -> list[Sample]:
    """A bf16-zstd feature shard of n random sequences of `length` tokens at the drafter's
    taps; `final`: also the target's final hidden state and its top-1 (extract.final_hidden,
    extract.topk 1)."""
    taps, H, V = cfg.target_layer_ids, cfg.hidden_size, cfg.vocab_size
    blocks = len(taps) + final
    rows = []
    for i in range(n):
        if i < DISTINCT:  # 126 MB of states each: later rows repeat them (decoding costs the same)
            hidden = (torch.randn(length, blocks * H) * 2).to(torch.bfloat16)
            encoded = encode(hidden, "bf16-zstd", blocks, 1)
        ids = torch.randint(10, V, (length,)).tolist()
        mask = [0] * (length // 8) + [1] * (length - length // 8)  # a prompt, then the answer
        top = None
        if final:  # the next token's id a third of the time (greedy labels keep some blocks)
            nxt = torch.tensor(ids[1:] + ids[:1], dtype=torch.int32)
            pick = torch.where(
                torch.rand(length) < 0.33, nxt, torch.randint(10, V, (length,), dtype=torch.int32)
            )
            top = pack_topk(pick[:, None], torch.full((length, 1), -0.5, dtype=torch.float16))
        rows.append(feature_row(str(i), ids, mask, encoded, top))
    info = ShardInfo("bf16-zstd", taps, H, {"name": "random"}, topk=int(final), final_hidden=final)
    write_shard(path, rows, info)
    return [Sample(0, i, length) for i in range(n)]


def loader_rate(ds: PackedBatches, workers: int, pin: bool) -> float:
    """Steady-state micro-batches/s of the train stage's loader: timed from the first batch
    on, so the workers' start-up (fork, imports, opening the shard) is not counted."""
    it = iter(make_loader(ds, 0, workers, pin=pin))
    next(it)
    t, n = time.perf_counter(), sum(1 for _ in it)
    return n / (time.perf_counter() - t)


def make_step(model: Drafter, batch: dict, cfg: Config | None = None):
    """The train stage's optimizer step over `accum` micro-batches (all `batch`): forward +
    backward of each, then clipping and fused AdamW, as the stage runs `tokens_per_step`.
    `cfg`: a quality cell's objective (train.loss, distill_weight, the ranking term, a DFlash2
    drafter's selector term at its full alpha); None: decay cross-entropy at gamma 7."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, fused=batch["input_ids"].is_cuda)
    head = compute_head(model, batch["input_ids"].device)
    B = model.config.block_size
    if cfg is None:
        objective = dict(gamma=7.0)
    else:
        objective = train_objective(cfg.train, B)
        if sc := selector_settings(cfg.train, model.config.dflash2):
            objective["selector"] = (model.candidate_selector, sc, sc.alpha)

    def step(accum: int = 1) -> torch.Tensor:
        for _ in range(accum):
            loss, _ = forward_loss(model, head, batch, B, **objective)
            (loss / accum).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def step_time(model: Drafter, batch: dict, steps: int, accum: int = 1) -> tuple[float, float]:
    """Median seconds per micro-batch and FLOPs per micro-batch, with `accum` micro-batches per
    optimizer step (accum 1: the optimizer after every micro-batch)."""
    step = make_step(model, batch)
    times = []
    for i in range(steps + 3):
        sync()
        t = time.perf_counter()
        step(accum)
        sync()
        if i >= 3:  # the first steps compile
            times.append((time.perf_counter() - t) / accum)
        else:
            say(f"warm-up step {i + 1} (accum {accum}): {time.perf_counter() - t:.1f} s")
    pos = torch.where(batch["keep"], batch["position_ids"][batch["anchors"]], -1)
    taps = len(model.config.target_layer_ids)
    flops = float(step_flops(model.config, batch["input_ids"].shape[0], taps, pos))
    return statistics.median(times), flops


def mfu(flops: float, seconds: float, device: torch.device) -> float | None:
    peak = card(device).bf16_flops if device.type == "cuda" else None
    return flops / seconds / peak if peak else None


def profile_step(step, out: Path, accum: int = 1, rows: int = 30) -> None:
    """Time per kernel over two optimizer steps of `step` (make_step's; after the timed ones:
    compiled and warm), the table printed and written to `out`, to find where a step's time
    goes (CUDA time on a card, CPU time in a smoke run)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with profile(activities=activities) as prof:
        for _ in range(2):
            step(accum)
        sync()
    table = prof.key_averages().table(
        sort_by="cuda_time_total" if cuda else "cpu_time_total", row_limit=rows,
        max_name_column_width=70,
    )  # fmt: skip
    out.write_text(table)
    print(table, flush=True)


def cell_config(variant: str) -> Config:
    """A quality cell's config as quality.py runs it: the SmolLM2 recipe, then its overlays."""
    if quality.recipe(variant) != quality.RECIPE:
        raise SystemExit(f"{variant}: not a cell of the SmolLM2 recipe ({quality.recipe(variant)}); "
                         f"--cells prices steps at SmolLM2's shapes only")  # fmt: skip
    files = [str(quality.RECIPE), *map(str, quality.stack(variant))]
    return Config.from_dict(quality.merged_configs(files), origin=variant)


def time_cells(variants: list[str], steps: int, rounds: int, answer_tokens: int, smoke: bool,
               device: torch.device, profile: str | None = None) -> dict:  # fmt: skip
    """Each cell's median seconds per micro-batch (module docstring), its ratio to the first
    cell's, and what it trained (architecture, objective, the last step's loss). `profile`:
    after the rounds, each cell's kernel table (profile_step) into PROFILE-CELL.txt."""
    shape, cells = SHAPES["smollm2"], {}
    with tempfile.TemporaryDirectory() as tmp:
        for v in variants:
            cfg = cell_config(v)
            d, tc = cfg.drafter, cfg.train
            model = drafter(shape, smoke, device, SMOKE["layers"] if smoke else d.num_layers,
                            d.block_size, **d.model_fields())  # fmt: skip
            tokens = SMOKE["tokens"] if smoke else tc.micro_batch_tokens
            anchors = SMOKE["anchors"] if smoke else tc.num_anchors
            length = min(answer_tokens, tokens)
            shard = Path(tmp) / f"{v}.arrow"
            samples = random_shard(shard, model.config, tokens // length, length, final=True)
            plan = [list(range(len(samples)))]  # the recipe's pack: answers end to end
            ds = PackedBatches([shard], samples, plan, tokens, anchors, seed=0, epoch=0, topk=1)
            batch = to_device(ds[0], device, final=model.config.hidden_size)
            step = make_step(model, batch, cfg)
            # micro-batches an optimizer step (the smoke run's tiny ones: one)
            accum = 1 if smoke else max(1, (tc.tokens_per_step or 0) // tokens)
            for i in range(3):  # the first steps compile
                sync()
                t = time.perf_counter()
                step(accum)
                sync()
                say(f"{v}: warm-up step {i + 1}: {time.perf_counter() - t:.1f} s")
            cells[v] = dict(step=step, accum=accum, times=[], cfg=cfg,
                            params=sum(p.numel() for p in model.parameters()))  # fmt: skip
        for r in range(rounds):  # the cells take turns: drift falls on all of them alike
            for c in cells.values():
                for _ in range(steps):
                    sync()
                    t = time.perf_counter()
                    c["loss"] = c["step"](c["accum"])
                    sync()
                    c["times"].append((time.perf_counter() - t) / c["accum"])
            say(f"round {r + 1}: " + ", ".join(f"{v} {statistics.median(c['times']) * 1e3:.2f} ms"
                                              for v, c in cells.items()))  # fmt: skip
        for v, c in cells.items() if profile else ():
            profile_step(c["step"], Path(f"{profile}-{v}.txt"), c["accum"])
    first = statistics.median(next(iter(cells.values()))["times"])
    out = {}
    for v, c in cells.items():
        tc, median = c["cfg"].train, statistics.median(c["times"])
        out[v] = dict(step_ms=median * 1e3, x_first=median / first,
                      architecture=c["cfg"].drafter.architecture, objective=tc.loss.objective,
                      weighting=tc.loss.weighting, labels=tc.loss.labels,
                      distill_weight=tc.distill_weight, params=c["params"],
                      loss=float(c["loss"]), steps=len(c["times"]),
                      micro_batches_per_step=c["accum"])  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--sequences", type=int, default=48, help="micro-batches the loader decodes")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--accum", type=int, nargs="+", default=[1],
                    help="micro-batches per optimizer step (the stage's tokens_per_step); one "
                         "figure each, the first is the headline")  # fmt: skip
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--profile", help="also write a per-kernel CUDA time table of two steps here "
                    "(--cells: one per cell, PROFILE-CELL.txt)")  # fmt: skip
    ap.add_argument(
        "--cells", nargs="+", help="instead: these quality cells' steps (module docstring)"
    )
    ap.add_argument("--rounds", type=int, default=3, help="--cells: turns each cell takes")
    ap.add_argument("--answer-tokens", type=int, default=372,
                    help="--cells: tokens per packed answer (the recipe's packs: about 22 in 8,192)")  # fmt: skip
    ap.add_argument("--out", default="train.json")
    args = ap.parse_args(argv)
    device = torch.device("cpu" if args.smoke else "cuda")
    res: dict = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "card": card(device).describe(),
        "args": vars(args),
    }
    if args.cells:
        res["cells"] = time_cells(args.cells, args.steps, args.rounds, args.answer_tokens,
                                  args.smoke, device, args.profile)  # fmt: skip
        Path(args.out).write_text(json.dumps(res, indent=2))
        print("| cell | ms per micro-batch | x first | architecture | objective | labels |")
        print("|---|---:|---:|---|---|---|")
        for v, c in res["cells"].items():
            print(f"| {v} | {c['step_ms']:.2f} | {c['x_first']:.3f} | {c['architecture']} | "
                  f"{c['objective']} ({c['weighting']}) | {c['labels']} |")  # fmt: skip
        return res
    run = SMOKE if args.smoke else HEADLINE
    qwen = SHAPES["qwen3-8b"]
    with tempfile.TemporaryDirectory() as tmp:
        shard = Path(tmp) / "shard.arrow"
        model = drafter(qwen, args.smoke, device, run["layers"], HEADLINE["block"])
        say("drafter built")
        samples = random_shard(shard, model.config, args.sequences, run["tokens"])
        say(f"wrote {args.sequences} sequences ({shard.stat().st_size / 1e9:.1f} GB)")
        plan = [[i] for i in range(len(samples))]  # one 3072-token sequence per micro-batch
        ds = PackedBatches([shard], samples, plan, run["tokens"], run["anchors"], seed=0, epoch=0)
        # the step first: its compilation should not share the CPU with loader workers
        batch = {k: v.to(device) for k, v in ds[0].items()}
        seconds, flops = step_time(model, batch, args.steps, args.accum[0])
        say(f"step {seconds * 1e3:.1f} ms per micro-batch, {args.accum[0]} per optimizer step "
            f"(MFU {mfu(flops, seconds, device) or 0:.1%})")  # fmt: skip
        for accum in args.accum[1:]:
            s_acc, _ = step_time(model, batch, args.steps, accum)
            res[f"mfu_accum_{accum}"] = mfu(flops, s_acc, device)
            res[f"step_s_accum_{accum}"] = s_acc
            say(f"step {s_acc * 1e3:.1f} ms per micro-batch, {accum} per optimizer step "
                f"(MFU {res[f'mfu_accum_{accum}'] or 0:.1%})")  # fmt: skip
        if args.profile and device.type == "cuda":
            profile_step(make_step(model, batch), Path(args.profile), args.accum[0])
        for w in args.workers:
            res[f"loader_batches_per_s_{w}_workers"] = loader_rate(ds, w, device.type == "cuda")
            say(f"loader, {w} workers: {res[f'loader_batches_per_s_{w}_workers']:.2f} batches/s")
    res.update(step_s=seconds, seq_tokens_per_s=run["tokens"] / seconds,
               query_tokens_per_s=int(batch["keep"].sum()) * 16 / seconds, tflops=flops / seconds / 1e12,
               mfu=mfu(flops, seconds, device),
               peak_mem_gib=torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None)  # fmt: skip
    for w in args.workers:
        res[f"loader_vs_training_{w}_workers"] = res[f"loader_batches_per_s_{w}_workers"] * seconds
    Path(args.out).write_text(json.dumps(res, indent=2))
    for k, v in res.items():
        print(f"{k:<36} {v:.4g}" if isinstance(v, float) else f"{k:<36} {v}")
    return res


if __name__ == "__main__":
    main()
