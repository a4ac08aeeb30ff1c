"""The train stage's loader on one CPU core: ms per packed micro-batch, per codec.

A shard of random states at the quality recipe's shape (SmolLM2-135M: 5 taps of hidden 576;
samples of 372 tokens, 22 to an 8,192-token pack, as the recipe's packs hold), then
`PackedBatches.__getitem__` (what one DataLoader worker runs per micro-batch: read, decode, pack,
anchors) timed in this process with one torch thread, as in a worker. For fp8-zstd also
`quantized=True` (the train stage on a GPU: the pack keeps the e4m3 bytes and scales, and
`data.to_device` dequantizes them on the device, not timed here).

    python benchmarks/loader.py --out loader.json
    python benchmarks/loader.py --smoke      # tiny shapes: checks the script
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from dflashpipe.codecs import encode
from dflashpipe.data import PackedBatches, Sample
from dflashpipe.shards import ShardInfo, feature_row, write_shard

FULL = dict(hidden=576, taps=5, length=372, per_pack=22, tokens=8192, anchors=1024)
SMOKE = dict(hidden=32, taps=2, length=30, per_pack=4, tokens=128, anchors=16)


def random_shard(path: Path, codec: str, shape: dict, n: int) -> list[Sample]:
    g = torch.Generator().manual_seed(0)
    T, width = shape["length"], shape["taps"] * shape["hidden"]
    rows = []
    for i in range(n):
        states = (torch.randn(T, width, generator=g) * 2).to(torch.bfloat16)
        ids = torch.randint(10, 49152, (T,), generator=g).tolist()
        mask = [0] * (T // 4) + [1] * (T - T // 4)
        rows.append(feature_row(str(i), ids, mask, encode(states, codec, shape["taps"])))
    write_shard(path, rows, ShardInfo(codec, list(range(shape["taps"])), shape["hidden"],
                                      {"name": "random"}))  # fmt: skip
    return [Sample(0, i, T) for i in range(n)]


def ms_per_batch(ds: PackedBatches, repeats: int) -> float:
    ds[0]  # opens the shard
    times = []
    for k in range(repeats):
        t = time.perf_counter()
        ds[k % len(ds)]
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default="loader.json")
    args = ap.parse_args()
    shape = SMOKE if args.smoke else FULL
    torch.set_num_threads(1)  # as in a DataLoader worker
    per = shape["per_pack"]
    plan = [list(range(k * per, (k + 1) * per)) for k in range(2)]
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for codec in ("bf16-zstd", "fp8-zstd"):
            path = Path(tmp) / f"{codec}.arrow"
            samples = random_shard(path, codec, shape, 2 * per)
            for quantized in (False, True) if codec == "fp8-zstd" else (False,):
                ds = PackedBatches([path], samples, plan, shape["tokens"], shape["anchors"], 0, 0,
                                   quantized=quantized)  # fmt: skip
                ms = ms_per_batch(ds, args.repeats)
                name = codec + (" quantized" if quantized else "")
                rows[name] = {"ms_per_batch": ms, "tokens_per_s": shape["tokens"] / ms * 1e3}
                print(f"{name:22s} {ms:7.1f} ms per {shape['tokens']}-token micro-batch, "
                      f"{rows[name]['tokens_per_s'] / 1e3:.0f}k tokens/s per worker", flush=True)  # fmt: skip
    Path(args.out).write_text(json.dumps({"shape": shape, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
