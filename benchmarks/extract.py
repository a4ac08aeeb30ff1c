"""Extract stage throughput vs a bare forward of the same target, measured in one run.

Target: Qwen3-8B shapes (36 layers, hidden 4096, GQA 32/8, vocab 151936) built from its config
with random bf16 weights (speed does not depend on weight values). Baseline: `model(...)` over
all 36 layers, sdpa, batches of 8 x 2048 tokens, no LM head. Measured path: the stage's
`Extractor` (forward through layer 33 only, 5 layers tapped, pinned copies, encoder threads,
Arrow writer to local disk) over the same number of tokens.

    python benchmarks/extract.py --sequences 96 --out $OUT/extract.json

`--shape smollm2` runs the quality benchmark's target instead (SmolLM2-135M: 30 layers, hidden
576, taps [1, 8, 14, 20, 27]) with `--budget` tokens per batch and `--min-length` for ShareGPT-like
mixed lengths: at 135M parameters the host side, not the GPU, sets the pace.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch
from torch import nn
from transformers import LlamaConfig, LlamaModel, Qwen3Config, Qwen3Model

from dflashpipe.codecs import group_of, prepare
from dflashpipe.config import Config
from dflashpipe.extract import Extractor, forward_taps, truncate_base
from dflashpipe.shards import FeatureShard, ShardInfo
from dflashpipe.taps import LayerTaps

QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                rms_norm_eps=1e-6)  # fmt: skip
LAYERS = [1, 9, 17, 25, 33]
# --shape smollm2: the quality benchmark's target (a 135M model: host work, not the GPU, bounds it)
SMOLLM2 = json.loads(Path(__file__).with_name("smollm2-135m.json").read_text())
SMOLLM2_LAYERS = [1, 8, 14, 20, 27]


SMOKE = dict(QWEN3_8B, hidden_size=64, intermediate_size=128, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, vocab_size=1000)  # fmt: skip


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def build(device: torch.device, shape: dict) -> nn.Module:
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with device:
        if shape is SMOLLM2:
            model = LlamaModel(LlamaConfig(**shape, attn_implementation="sdpa"))
        else:
            model = Qwen3Model(Qwen3Config(**shape, attn_implementation="sdpa"))
    torch.set_default_dtype(torch.float32)
    return model.eval().requires_grad_(False)


def bare_forward_tok_s(model, ids: torch.Tensor, repeats: int = 5) -> float:
    mask = torch.ones_like(ids)
    times = []
    with torch.inference_mode():
        model(input_ids=ids, attention_mask=mask, use_cache=False)  # warm-up
        for _ in range(repeats):
            sync()
            t = time.perf_counter()
            model(input_ids=ids, attention_mask=mask, use_cache=False)
            sync()
            times.append(time.perf_counter() - t)
    return ids.numel() / statistics.median(times)


def gpu_path_tok_s(
    model, ids: torch.Tensor, codec: str, layers: list[int], repeats: int = 5
) -> float:
    """The measured path's GPU work alone: forward through the deepest tap, taps gathered,
    the codec's element-wise half; no host copy. The ceiling for the whole stage."""
    taps = LayerTaps(model, layers)
    times = []
    for i in range(repeats + 1):
        sync()
        t = time.perf_counter()
        prepare(forward_taps(model, taps, ids), codec, len(layers))
        sync()
        if i:
            times.append(time.perf_counter() - t)
    taps.remove()
    return ids.numel() / statistics.median(times)


def extract_tok_s(model, rows: list[dict], codec: str, level: int, out_dir: Path,
                  layers: list[int], budget: int, direct_io: bool) -> dict:  # fmt: skip
    hidden = model.config.hidden_size
    raw = {"target": {"model": "qwen3-8b-random"}, "prompts": {"sources": [{"name": "x", "kind": "jsonl", "path": "x"}]},
           "extract": {"codec": codec, "zstd_level": level, "token_budget": budget, "encode_workers": None,
                       "direct_io": direct_io}}  # fmt: skip
    cfg = Config.from_dict(raw)
    info = ShardInfo(codec, layers, hidden, {"name": "random"}, group_size=group_of(codec, None))
    ex = Extractor(cfg, model, layers, model.device)
    # warm-up: kernels, threads, and enough batches in flight to fill the pinned-memory cache
    ex.run(rows[:32], out_dir / "warmup.arrow", info, Counter())
    out = out_dir / f"{codec}-{level}.arrow"
    sync()
    t = time.perf_counter()
    ex.timing.clear()
    ex.run(rows, out, info, Counter())
    elapsed = time.perf_counter() - t
    ex.close()
    timing = {f"{k}_s": v for k, v in ex.timing.items()}
    check = read_back(out, rows)
    tokens = sum(len(r["input_ids"]) for r in rows)
    raw_bytes = tokens * len(layers) * hidden * 2
    return {
        "tok_s": tokens / elapsed,
        "bytes": out.stat().st_size,
        "ratio_vs_raw": raw_bytes / out.stat().st_size,
        "seconds": elapsed,
        "loop_tok_s": tokens / ex.timing["loop"],  # GPU loop alone, before the writer drains
        **timing,
        **check,
    }


def read_back(path: Path, rows: list[dict]) -> dict:
    """The written shard opened as training opens it: every row there, and a digest of the
    first and last samples' decoded states (runs of one codec must agree)."""
    shard = FeatureShard(path)
    if len(shard) != len(rows):
        raise SystemExit(f"{path}: {len(shard)} rows, expected {len(rows)}")
    digest = hashlib.sha256()
    for i in (0, len(shard) - 1):
        hidden = shard.sample(i)["hidden"]
        if not torch.isfinite(hidden.float()).all():
            raise SystemExit(f"{path}: row {i} decodes to non-finite values")
        digest.update(hidden.view(torch.int16).numpy().tobytes())
    return {"rows": len(shard), "decoded_digest": digest.hexdigest()[:16]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sequences", type=int, default=96)
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument(
        "--runs",
        nargs="+",
        default=["bf16-zstd:1", "bf16-zstd:1:direct", "fp8-zstd:1"],
        help="codec:zstd_level[:direct]; direct = O_DIRECT writes (extract.direct_io on); "
        "fp4-zstd takes its default group size",
    )
    ap.add_argument("--out", default="extract.json")
    ap.add_argument("--dir", default="/tmp", help="where shards are written (local disk)")
    ap.add_argument("--shape", choices=["qwen3-8b", "smollm2"], default="qwen3-8b")
    ap.add_argument("--min-length", type=int, default=0,
                    help="sequence lengths uniform in [min-length, length] (0: all --length)")  # fmt: skip
    ap.add_argument("--budget", type=int, default=16384, help="extract.token_budget")
    ap.add_argument(
        "--smoke", action="store_true", help="tiny shapes on the CPU (checks the script)"
    )
    args = ap.parse_args()
    shape = SMOKE if args.smoke else SMOLLM2 if args.shape == "smollm2" else QWEN3_8B
    layers = SMOLLM2_LAYERS if shape is SMOLLM2 else LAYERS
    device = torch.device("cpu" if args.smoke else "cuda")
    model = build(device, shape)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, shape["vocab_size"], (args.sequences, args.length), generator=g)
    lengths = torch.randint(args.min_length or args.length, args.length + 1, (args.sequences,),
                            generator=g).tolist()  # fmt: skip
    base_tok_s = bare_forward_tok_s(model, ids[: max(1, args.budget // args.length)].to(device))
    print(json.dumps({"bare_forward_tok_s": base_tok_s}), flush=True)
    rows = [{"sample_id": str(i), "input_ids": ids[i, :n].tolist(), "loss_mask": [1] * n}
            for i, n in enumerate(lengths)]  # fmt: skip
    truncate_base(model, max(layers))
    gpu_path = gpu_path_tok_s(model, ids[: max(1, args.budget // args.length)].to(device),
                              "bf16-zstd", layers)  # fmt: skip
    print(json.dumps({"gpu_path_tok_s": gpu_path}), flush=True)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    results = {"device": name, "bare_forward_tok_s": base_tok_s, "gpu_path_tok_s": gpu_path,
               "runs": {}}  # fmt: skip
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for spec in args.runs:
            codec, level, *io = spec.split(":")  # codec:level[:direct] (direct: direct_io on)
            r = extract_tok_s(model, rows, codec, int(level), Path(tmp), layers, args.budget,
                              direct_io=io == ["direct"])  # fmt: skip
            r["ratio_vs_bare_forward"] = r["tok_s"] / base_tok_s
            results["runs"][spec] = r
            print(json.dumps({spec: r}), flush=True)
            for f in Path(tmp).glob("*.arrow"):
                f.unlink()
    Path(args.out).write_text(json.dumps(results, indent=2))
    n = shape["num_hidden_layers"]
    print(f"\nbare forward ({n} layers, batches of {args.budget} tokens): {base_tok_s:,.0f} tok/s")
    print(f"GPU work of the path ({max(layers) + 1} layers, taps, planes): {gpu_path:,.0f} tok/s "
          f"({gpu_path / base_tok_s:.2f}x)")  # fmt: skip
    print(f"{'codec:level':<20}{'tok/s':>10}{'x bare':>8}{'size vs raw bf16':>18}"
          f"{'loop tok/s':>12}{'blocked gpu/host s':>20}{'decoded digest':>18}")  # fmt: skip
    for spec, r in results["runs"].items():
        waits = f"{r.get('blocked_on_gpu_s', 0):.1f}/{r.get('blocked_on_host_s', 0):.1f}"
        print(f"{spec:<20}{r['tok_s']:>10,.0f}{r['ratio_vs_bare_forward']:>8.2f}"
              f"{r['ratio_vs_raw']:>17.2f}x{r['loop_tok_s']:>12,.0f}{waits:>20}"
              f"{r['decoded_digest']:>18}")  # fmt: skip


if __name__ == "__main__":
    main()
