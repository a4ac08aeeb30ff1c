"""Codec figures on real hidden states, from existing feature shards (any codec; lossless ones
give the exact states):

1. speed: compression ratio per codec and level, encode / decode MB/s on one CPU core (single
   thread); MB counts the raw bf16 bytes of the blocks.
2. quality of the lossy codecs (issue 46): bytes per token as a shard row stores them (the
   blocks and their scales), their ratio to fp8-zstd's, and the relative error (RMS of the error
   over RMS of the states) per tapped layer, the worst layer, and on each layer's
   massive-activation channels (those whose largest |value| exceeds 50x the RMS of the layer's
   median channel) and on its other channels, whose error a layer-wide RMS hides; for
   fp4-zstd at each group size, and beside it what was measured and not kept: stochastic
   rounding and the e2m1 (FP4) grid, through the same quantizer.

    python benchmarks/codecs.py results/features/shard-0000*.arrow --out codecs.json

Bound (issue 46): a 4-bit codec <= 0.6x fp8-zstd's bytes per token.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from dflashpipe.codecs import (
    E2M1_LEVELS,
    FP4_OUTLIERS,
    INT4_LEVELS,
    decode,
    dequantize_4bit,
    encode,
    pack,
    quantize_4bit,
)
from dflashpipe.shards import FeatureShard

RUNS = [
    ("raw", 3, None),
    ("bf16-zstd", 1, None),
    ("bf16-zstd", 3, None),
    ("fp8-zstd", 1, None),
    ("fp4-zstd", 1, 16),
    ("fp4-zstd", 1, 32),
    ("fp4-zstd", 1, 64),
]
# (name, group, grid, stochastic, outliers): the codecs first, then the alternatives measured and
# not kept
LOSSY = [("fp8-zstd", None, None, False, 0)]
LOSSY += [(f"fp4-zstd G{g}", g, E2M1_LEVELS, False, FP4_OUTLIERS) for g in (16, 32, 64)]
LOSSY += [("e2m1 G32, no outliers", 32, E2M1_LEVELS, False, 0),
          ("e2m1 G32, 2 outliers", 32, E2M1_LEVELS, False, 2),
          ("e2m1 G32, 8 outliers", 32, E2M1_LEVELS, False, 8),
          ("e2m1 G16, no outliers", 16, E2M1_LEVELS, False, 0)]  # fmt: skip
LOSSY += [(f"int4 G{g}", g, INT4_LEVELS, False, FP4_OUTLIERS) for g in (16, 32)]
LOSSY += [("int4 G32, no outliers", 32, INT4_LEVELS, False, 0)]
LOSSY += [("e2m1 stochastic G32", 32, E2M1_LEVELS, True, FP4_OUTLIERS),
          ("int4 stochastic G32", 32, INT4_LEVELS, True, FP4_OUTLIERS)]  # fmt: skip
MASSIVE = 50.0  # massive: a channel whose largest |value| exceeds this x the median channel's RMS


def speed(blocks: list[torch.Tensor], n_layers: int, raw_mb: float) -> list[dict]:
    runs = []
    for codec, level, group in RUNS:
        t = time.perf_counter()
        encoded = [encode(b, codec, n_layers, level, group) for b in blocks]
        t_enc = time.perf_counter() - t
        size = sum(len(e.hidden) + len(e.scales or b"") for e in encoded)
        t = time.perf_counter()
        for e, b in zip(encoded, blocks, strict=True):
            decode(e, codec, b.shape[0], b.shape[1], n_layers, group_size=group)
        t_dec = time.perf_counter() - t
        runs.append({"codec": codec, "level": level, "group": group, "ratio": raw_mb * 1e6 / size,
                     "encode_mb_s": raw_mb / t_enc, "decode_mb_s": raw_mb / t_dec})  # fmt: skip
    return runs


def lossy_round_trip(
    block: torch.Tensor,
    n_layers: int,
    group: int | None,
    grid,
    stochastic: bool,
    outliers: int,
    g: torch.Generator,
) -> tuple[torch.Tensor, int]:
    """(the bf16 states back, bytes a shard row stores) of one variant of `LOSSY`."""
    if group is None:
        enc = encode(block, "fp8-zstd", n_layers)
        out = decode(enc, "fp8-zstd", block.shape[0], block.shape[1], n_layers)
        return out, len(enc.hidden) + len(enc.scales)
    parts = quantize_4bit(block, n_layers, group, grid, stochastic, g, outliers)
    enc = pack(parts, "fp4-zstd")
    out = dequantize_4bit(*(p.numpy() for p in parts), group, grid)
    return torch.from_numpy(out).to(torch.bfloat16), len(enc.hidden) + len(enc.scales)


def quality(blocks: list[torch.Tensor], n_layers: int, layer_ids: list[int]) -> dict:
    ref = torch.cat(blocks).float().unflatten(-1, (n_layers, -1))  # (tokens, L, H)
    rms = ref.pow(2).mean((0, 2)).sqrt()  # (L,)
    typical = ref.pow(2).mean(0).sqrt().median(-1).values  # (L,) the median channel's RMS
    peak = ref.abs().amax(0)  # (L, H)
    massive = {layer_ids[li]: [int(c) for c in (peak[li] > MASSIVE * typical[li]).nonzero().flatten()]
               for li in range(n_layers)}  # fmt: skip
    out = {"massive_channels": {
        str(lid): {str(c): round(float(peak[li, c] / typical[li]), 1) for c in massive[lid]}
        for li, lid in enumerate(layer_ids)}, "variants": []}  # fmt: skip
    tokens = ref.shape[0]
    g = torch.Generator().manual_seed(0)
    for name, group, grid, stochastic, outliers in LOSSY:
        decoded, size = [], 0
        for b in blocks:
            got, n = lossy_round_trip(b, n_layers, group, grid, stochastic, outliers, g)
            decoded.append(got)
            size += n
        err = torch.cat(decoded).float().unflatten(-1, (n_layers, -1)) - ref
        rel = (err.pow(2).mean((0, 2)).sqrt() / rms).tolist()
        on_massive, rest = {}, {}
        for li, lid in enumerate(layer_ids):
            cols = massive[lid]
            if cols:
                e, x = err[:, li, cols], ref[:, li, cols]
                on_massive[str(lid)] = float(e.pow(2).mean().sqrt() / x.pow(2).mean().sqrt())
            other = [c for c in range(ref.shape[-1]) if c not in cols]
            e, x = err[:, li, other], ref[:, li, other]
            rest[str(lid)] = float(e.pow(2).mean().sqrt() / x.pow(2).mean().sqrt())
        worst = max(range(n_layers), key=lambda i: rel[i])
        out["variants"].append({"name": name, "bytes_per_token": size / tokens,
                                "rel_error": dict(zip(map(str, layer_ids), rel, strict=True)),
                                "worst_layer": layer_ids[worst],
                                "rel_error_massive": on_massive,
                                "rel_error_other_channels": rest})  # fmt: skip
    fp8 = out["variants"][0]["bytes_per_token"]
    for v in out["variants"]:
        v["x_fp8"] = v["bytes_per_token"] / fp8
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("shards", nargs="+")
    ap.add_argument("--samples", type=int, default=64, help="at most this many, over all shards")
    ap.add_argument("--out", default="codecs.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    shards = [FeatureShard(p) for p in args.shards]
    info = shards[0].info
    n_layers = len(info.layer_ids)
    blocks = [s.sample(i)["hidden"] for s in shards for i in range(len(s))][: args.samples]
    raw_mb = sum(b.numel() * 2 for b in blocks) / 1e6
    tokens = sum(b.shape[0] for b in blocks)
    results = {"shards": args.shards, "codec_read": info.codec, "target": info.target.get("name"),
               "layers": info.layer_ids, "hidden_size": info.hidden_size, "samples": len(blocks),
               "tokens": tokens, "raw_mb": raw_mb}  # fmt: skip
    results["runs"] = speed(blocks, n_layers, raw_mb)
    results["quality"] = quality(blocks, n_layers, info.layer_ids)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(f"{len(blocks)} samples, {tokens} tokens, {raw_mb:.0f} MB raw bf16, layers "
          f"{info.layer_ids} of hidden {info.hidden_size} (read as {info.codec})")  # fmt: skip
    print(
        f"{'codec':<10}{'level':>6}{'G':>4}{'ratio':>8}{'enc MB/s':>10}{'dec MB/s':>10}  (one core)"
    )
    for r in results["runs"]:
        print(f"{r['codec']:<10}{r['level']:>6}{r['group'] or '-':>4}{r['ratio']:>8.2f}"
              f"{r['encode_mb_s']:>10.0f}{r['decode_mb_s']:>10.0f}")  # fmt: skip
    q = results["quality"]
    print("massive channels (layer: channel: peak / the median channel's RMS):",
          q["massive_channels"])  # fmt: skip
    print(
        f"{'variant':<24}{'bytes/tok':>10}{'x fp8':>7}  rel. error per layer | on massive channels"
    )
    for v in q["variants"]:
        per_layer = " ".join(f"{e:.4f}" for e in v["rel_error"].values())
        on_massive = " ".join(f"{k}:{e:.4f}" for k, e in v["rel_error_massive"].items())
        rest = " ".join(f"{e:.4f}" for e in v["rel_error_other_channels"].values())
        print(f"{v['name']:<24}{v['bytes_per_token']:>10.0f}{v['x_fp8']:>7.3f}  {per_layer} "
              f"(worst {v['worst_layer']}) | {on_massive} | {rest}")  # fmt: skip
    return results


if __name__ == "__main__":
    main()
