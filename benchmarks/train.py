"""Drafter training step speed (tokens/s, MFU) and loader decode speed, in one run.

Qwen3-8B drafter: 5 layers, hidden 4096, GQA 32/8, head_dim 128, MLP 12288, block 16, vocab
151936 (frozen random embedding and LM head), 512 anchors per 3072-token micro-batch, random
target features. The step is the train stage's (`objective.forward_loss`): `Drafter` forward
(float32 master weights, bf16 autocast, compiled layers, flex attention), `block_labels`, chunked
`dflash_loss` against the bf16 head, backward, clip, fused AdamW. FLOPs by
`metrics.step_flops` (formula in its docstring); MFU over the card's dense bf16 peak
(`dflashpipe.cards`: 989 TFLOP/s on an H100 SXM or H200).
Loader: `PackedBatches` decoding a bf16-zstd shard of the same shapes, per worker count.

    python benchmarks/train.py --steps 20 --out $OUT/train.json
    python benchmarks/train.py --smoke        # tiny shapes on the CPU: checks the script
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from dflashpipe.cards import card
from dflashpipe.codecs import encode
from dflashpipe.data import PackedBatches, Sample, make_loader
from dflashpipe.metrics import step_flops
from dflashpipe.model import Drafter, DrafterConfig
from dflashpipe.objective import compute_head, forward_loss
from dflashpipe.shards import ShardInfo, feature_row, write_shard

FULL = dict(hidden_size=4096, intermediate_size=12288, num_attention_heads=32, num_key_value_heads=8,
            head_dim=128, vocab_size=151936, tokens=3072, anchors=512, layers=5)  # fmt: skip
SMOKE = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, vocab_size=1000, tokens=256, anchors=32, layers=2)  # fmt: skip
TAPS = [1, 9, 17, 25, 33]
DISTINCT = 4  # distinct random sequences in the benchmark's shard


def say(*what) -> None:
    """A phase's progress, flushed: a run cut short by a time limit still shows where it was."""
    print(time.strftime("%H:%M:%S"), *what, flush=True)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def drafter(shape: dict, device: torch.device) -> Drafter:
    cfg = DrafterConfig(
        hidden_size=shape["hidden_size"], intermediate_size=shape["intermediate_size"],
        num_attention_heads=shape["num_attention_heads"], num_key_value_heads=shape["num_key_value_heads"],
        head_dim=shape["head_dim"], rms_norm_eps=1e-6, vocab_size=shape["vocab_size"],
        max_position_embeddings=40960, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        num_target_layers=36, mask_token_id=5, num_layers=shape["layers"], block_size=16,
        target_layer_ids=TAPS,
    )  # fmt: skip
    V, H = shape["vocab_size"], shape["hidden_size"]
    # float32 master weights and bf16 autocast, as the train stage holds them
    embed = torch.randn(V, H, device=device) * 0.02
    head = torch.randn(V, H, device=device) * 0.02
    model = Drafter(cfg, embed, head).to(device)
    if device.type == "cuda":
        for layer in model.layers:
            layer.compile()
    return model


def random_shard(path: Path, shape: dict, n: int) -> list[Sample]:
    """A bf16-zstd feature shard of n random sequences of `tokens` tokens, 5 taps."""
    T, H = shape["tokens"], shape["hidden_size"]
    rows = []
    for i in range(n):
        if i < DISTINCT:  # 126 MB of states each: later rows repeat them (decoding costs the same)
            hidden = (torch.randn(T, len(TAPS) * H) * 2).to(torch.bfloat16)
            encoded = encode(hidden, "bf16-zstd", len(TAPS), 1)
        ids = torch.randint(10, shape["vocab_size"], (T,)).tolist()
        mask = [0] * 64 + [1] * (T - 64)
        rows.append(feature_row(str(i), ids, mask, encoded))
    write_shard(path, rows, ShardInfo("bf16-zstd", TAPS, H, {"name": "random"}))
    return [Sample(0, i, T) for i in range(n)]


def loader_rate(ds: PackedBatches, workers: int, pin: bool) -> float:
    """Steady-state micro-batches/s of the train stage's loader: timed from the first batch
    on, so the workers' start-up (fork, imports, opening the shard) is not counted."""
    it = iter(make_loader(ds, 0, workers, pin=pin))
    next(it)
    t, n = time.perf_counter(), sum(1 for _ in it)
    return n / (time.perf_counter() - t)


def make_step(model: Drafter, batch: dict):
    """The train stage's optimizer step over `accum` micro-batches (all `batch`): forward +
    backward of each, then clipping and fused AdamW, as the stage runs `tokens_per_step`."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, fused=batch["input_ids"].is_cuda)
    head = compute_head(model, batch["input_ids"].device)

    def step(accum: int = 1) -> None:
        for _ in range(accum):
            loss, _ = forward_loss(model, head, batch, model.config.block_size, 7.0)
            (loss / accum).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

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
    flops = float(step_flops(model.config, batch["input_ids"].shape[0], len(TAPS), pos))
    return statistics.median(times), flops


def mfu(flops: float, seconds: float, device: torch.device) -> float | None:
    peak = card(device).bf16_flops if device.type == "cuda" else None
    return flops / seconds / peak if peak else None


def profile_step(model: Drafter, batch: dict, out: Path, rows: int = 30) -> None:
    """CUDA time per kernel over two steps (after the timed ones: compiled and warm), the
    table printed and written to `out`, to find where a step's time goes."""
    from torch.profiler import ProfilerActivity, profile

    step = make_step(model, batch)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            step()
        sync()
    table = prof.key_averages().table(
        sort_by="cuda_time_total", row_limit=rows, max_name_column_width=70
    )
    out.write_text(table)
    print(table, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--sequences", type=int, default=48, help="micro-batches the loader decodes")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--accum", type=int, nargs="+", default=[1],
                    help="micro-batches per optimizer step (the stage's tokens_per_step); one "
                         "figure each, the first is the headline")  # fmt: skip
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--profile", help="also write a per-kernel CUDA time table of two steps here")
    ap.add_argument("--out", default="train.json")
    args = ap.parse_args()
    shape = SMOKE if args.smoke else FULL
    device = torch.device("cpu" if args.smoke else "cuda")
    res: dict = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "card": card(device).describe(),
    }
    with tempfile.TemporaryDirectory() as tmp:
        shard = Path(tmp) / "shard.arrow"
        samples = random_shard(shard, shape, args.sequences)
        say(f"wrote {args.sequences} sequences ({shard.stat().st_size / 1e9:.1f} GB)")
        plan = [[i] for i in range(len(samples))]  # one 3072-token sequence per micro-batch
        ds = PackedBatches(
            [shard], samples, plan, shape["tokens"], shape["anchors"], seed=0, epoch=0
        )
        batch = {k: v.to(device) for k, v in ds[0].items()}
        # the step first: its compilation should not share the CPU with loader workers
        model = drafter(shape, device)
        say("drafter built")
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
            profile_step(model, batch, Path(args.profile))
        for w in args.workers:
            res[f"loader_batches_per_s_{w}_workers"] = loader_rate(ds, w, device.type == "cuda")
            say(f"loader, {w} workers: {res[f'loader_batches_per_s_{w}_workers']:.2f} batches/s")
    res.update(step_s=seconds, seq_tokens_per_s=shape["tokens"] / seconds,
               query_tokens_per_s=int(batch["keep"].sum()) * 16 / seconds, tflops=flops / seconds / 1e12,
               mfu=mfu(flops, seconds, device),
               peak_mem_gib=torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None)  # fmt: skip
    for w in args.workers:
        res[f"loader_vs_training_{w}_workers"] = res[f"loader_batches_per_s_{w}_workers"] * seconds
    Path(args.out).write_text(json.dumps(res, indent=2))
    for k, v in res.items():
        print(f"{k:<36} {v:.4g}" if isinstance(v, float) else f"{k:<36} {v}")


if __name__ == "__main__":
    main()
