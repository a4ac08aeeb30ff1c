"""The train stage's loader on one CPU core: ms per packed micro-batch, per codec, against what
a training step consumes.

A shard of random states at a training shape, then `PackedBatches.__getitem__` (what one
DataLoader worker runs per micro-batch: read, decode, pack, anchors) timed in this process with
one torch thread, as in a worker. Shapes: `recipe`, the quality recipe's (SmolLM2-135M: 5 taps of
hidden 576; samples of 372 tokens, 22 to an 8,192-token pack, as the recipe's packs hold) and
`qwen3-8b` (5 taps of hidden 4,096; 8 samples of 384 tokens to a 3,072-token pack). For the
quantized codecs also `quantized=True` (the train stage on a GPU: the pack keeps the arrays as
stored, and `data.to_device` dequantizes them on the device, not timed here).

`x step` = workers x a worker's tokens/s over the tokens/s a training step consumes on one GPU,
both given per shape (defaults: benchmarks/RESULTS.md's H200 figures: the recipe's run of 4,149
steps alone, median 302k tokens/s with its train.num_workers 4; the Qwen3-8B drafter's step,
3,072 tokens per 144.2 ms = 21.3k tokens/s, with 15 workers). Bound (issue 46): >= 2x.

    python benchmarks/loader.py --out loader.json
    python benchmarks/loader.py --shapes recipe qwen3-8b --codecs fp8-zstd fp4-zstd
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

from dflashpipe.codecs import FP4_GROUP, encode
from dflashpipe.data import PackedBatches, Sample
from dflashpipe.shards import ShardInfo, feature_row, write_shard

SHAPES = {
    "recipe": dict(hidden=576, taps=5, length=372, per_pack=22, tokens=8192, anchors=1024,
                   consumes=302e3, workers=4),
    "qwen3-8b": dict(hidden=4096, taps=5, length=384, per_pack=8, tokens=3072, anchors=512,
                     consumes=21.3e3, workers=15),
}  # fmt: skip
SMOKE = dict(hidden=32, taps=2, length=30, per_pack=4, tokens=128, anchors=16, consumes=1e3,
             workers=1)  # fmt: skip
CODECS = ("bf16-zstd", "fp8-zstd", "fp4-zstd")
QUANTIZED = ("fp8-zstd", "fp4-zstd")


def random_shard(path: Path, codec: str, shape: dict, n: int) -> list[Sample]:
    g = torch.Generator().manual_seed(0)
    T, width = shape["length"], shape["taps"] * shape["hidden"]
    rows = []
    for i in range(n):
        states = (torch.randn(T, width, generator=g) * 2).to(torch.bfloat16)
        ids = torch.randint(10, 49152, (T,), generator=g).tolist()
        mask = [0] * (T // 4) + [1] * (T - T // 4)
        rows.append(feature_row(str(i), ids, mask, encode(states, codec, shape["taps"])))
    group = FP4_GROUP if codec == "fp4-zstd" else None
    write_shard(path, rows, ShardInfo(codec, list(range(shape["taps"])), shape["hidden"],
                                      {"name": "random"}, group_size=group))  # fmt: skip
    return [Sample(0, i, T) for i in range(n)]


def ms_per_batch(ds: PackedBatches, repeats: int) -> float:
    ds[0]  # opens the shard
    times = []
    for k in range(repeats):
        t = time.perf_counter()
        ds[k % len(ds)]
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--shapes", nargs="+", default=["recipe"], choices=list(SHAPES))
    ap.add_argument("--codecs", nargs="+", default=list(CODECS), choices=CODECS)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default="loader.json")
    args = ap.parse_args(argv)
    shapes = {"smoke": SMOKE} if args.smoke else {name: SHAPES[name] for name in args.shapes}
    torch.set_num_threads(1)  # as in a DataLoader worker
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for shape_name, shape in shapes.items():
            per = shape["per_pack"]
            plan = [list(range(k * per, (k + 1) * per)) for k in range(2)]
            rows = results[shape_name] = {"shape": shape, "rows": {}}
            for codec in args.codecs:
                path = Path(tmp) / f"{shape_name}-{codec}.arrow"
                samples = random_shard(path, codec, shape, 2 * per)
                for quantized in (False, True) if codec in QUANTIZED else (False,):
                    ds = PackedBatches([path], samples, plan, shape["tokens"], shape["anchors"],
                                       0, 0, quantized=quantized)  # fmt: skip
                    ms = ms_per_batch(ds, args.repeats)
                    name = codec + (" quantized" if quantized else "")
                    rate = shape["tokens"] / ms * 1e3
                    x_step = shape["workers"] * rate / shape["consumes"]
                    rows["rows"][name] = {
                        "ms_per_batch": ms,
                        "tokens_per_s": rate,
                        "x_step": x_step,
                    }
                    print(f"{shape_name:9s} {name:20s} {ms:8.1f} ms per {shape['tokens']}-token "
                          f"micro-batch, {rate / 1e3:6.1f}k tokens/s per worker, "
                          f"{x_step:5.2f}x the step with {shape['workers']} workers", flush=True)  # fmt: skip
    Path(args.out).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
