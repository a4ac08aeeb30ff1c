"""Codec figures on real hidden states: compression ratio per codec and level, and encode /
decode MB/s on one CPU core (single thread), from an existing feature shard.

    python benchmarks/codecs.py results/features/shard-00000.arrow --out codecs.json

The shard's blocks are decoded once (any codec) and re-encoded with each codec; MB counts the
raw bf16 bytes of the blocks.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from dflashpipe.codecs import decode, encode
from dflashpipe.shards import FeatureShard

RUNS = [
    ("raw", 3),
    ("bf16-zstd", 1),
    ("bf16-zstd", 3),
    ("bf16-zstd", 9),
    ("fp8-zstd", 1),
    ("fp8-zstd", 3),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("shard")
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--out", default="codecs.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    shard = FeatureShard(args.shard)
    n_layers = len(shard.info.layer_ids)
    blocks = [shard.sample(i)["hidden"] for i in range(min(args.samples, len(shard)))]
    raw_mb = sum(b.numel() * 2 for b in blocks) / 1e6
    results = {"shard": args.shard, "target": shard.info.target.get("name"), "layers": shard.info.layer_ids,
               "tokens": sum(b.shape[0] for b in blocks), "raw_mb": raw_mb, "runs": []}  # fmt: skip
    for codec, level in RUNS:
        t = time.perf_counter()
        encoded = [encode(b, codec, n_layers, level) for b in blocks]
        t_enc = time.perf_counter() - t
        size = sum(len(e.hidden) + len(e.scales or b"") for e in encoded)
        t = time.perf_counter()
        for e, b in zip(encoded, blocks, strict=True):
            decode(e, codec, b.shape[0], b.shape[1], n_layers)
        t_dec = time.perf_counter() - t
        results["runs"].append({"codec": codec, "level": level, "ratio": raw_mb * 1e6 / size,
                                "encode_mb_s": raw_mb / t_enc, "decode_mb_s": raw_mb / t_dec})  # fmt: skip
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(f"{results['tokens']} tokens, {raw_mb:.0f} MB raw bf16, layers {results['layers']}")
    print(f"{'codec':<10}{'level':>6}{'ratio':>8}{'enc MB/s':>10}{'dec MB/s':>10}   (one core)")
    for r in results["runs"]:
        print(
            f"{r['codec']:<10}{r['level']:>6}{r['ratio']:>8.2f}{r['encode_mb_s']:>10.0f}{r['decode_mb_s']:>10.0f}"
        )


if __name__ == "__main__":
    main()
