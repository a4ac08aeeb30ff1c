#!/usr/bin/env bash
# Prepares, on a machine that reaches PyPI and has resources/ retrieved (`snakemake --cores 1
# resources --configfile configs/smollm2-sharegpt.yaml`), what a GPU machine without network
# needs to run benchmarks/quality.py, in three parts of under 64 MiB each (one per transfer):
#   .remote/a: the wheels that machine lacks (wheels.txt, Python 3.12), ShareGPT (zstd), GGUF part 0
#   .remote/b: GGUF part 1, HumanEval
#   .remote/c: the code prompts' wheels (resources/code/; the recipe's five code sources)
# There: `. benchmarks/remote/setup.sh` after each part arrives (it assembles resources/ under
# /tmp/res once both are there), then `setsid bash benchmarks/remote/bg.sh bf16 ...` starts the
# runs in the background and `bash benchmarks/remote/mon.sh SECONDS` follows them.
# `pack.sh answers DIR...`: instead, the kept answers calls brought back (answers-*.part-*, from
# mon.sh with KEEP=..., each call's files_at a DIR) into .remote/k1, k2, ... of at most 60 MB
# each, one carry per folder;
# setup.sh gathers them and bg.sh restores them, so those runs start at extract.
# `pack.sh gemma`: Gemma 3 270M's GGUF (configs/gemma3-270m-quality.yaml, 253 MB, retrieved
# here) in five parts .remote/g1..g5 of about 51 MB, one carry each, beside a/b/c's wheels and
# prompts; setup.sh joins them once all five are there and checks the config's sha256.
# `pack.sh compile DIR...`: the compile-cache bundles (*.torchcompile) an earlier machine saved
# (mon.sh returns them) into .remote/cc; setup.sh puts them where DFLASHPIPE_COMPILE_CACHE points.
set -euo pipefail
cd "$(dirname "$0")/../.."
R=.remote
if [ "${1:-}" = gemma ]; then
  G=resources/gemma3/gemma-3-270m-q4_k_m.gguf
  rm -rf $R/g*; size=$(stat -c %s $G); part=$(( (size + 4) / 5 ))
  for i in 0 1 2 3 4; do
    mkdir -p $R/g$((i + 1))
    dd if=$G of=$R/g$((i + 1))/gemma.gguf.$i bs=4M iflag=skip_bytes,count_bytes skip=$((i * part)) count=$part status=none
  done
  sha256sum $G | cut -d' ' -f1 > $R/g1/gemma.gguf.sha256
  du -sh $R/g*; exit 0
fi
if [ "${1:-}" = compile ]; then
  shift; rm -rf $R/cc && mkdir -p $R/cc
  for d in "$@"; do cp "$d"/*.torchcompile $R/cc/; done
  du -sh $R/cc; exit 0
fi
if [ "${1:-}" = answers ]; then
  shift; rm -rf $R/k*; n=1; used=0
  for part in $(for d in "$@"; do ls "$d"/answers-*.part-*; done | awk -F/ '{print $NF" "$0}' | sort | cut -d' ' -f2); do
    size=$(stat -c %s "$part")
    if [ $((used + size)) -gt 60000000 ]; then n=$((n + 1)); used=0; fi
    mkdir -p $R/k$n && cp "$part" $R/k$n/ && used=$((used + size))
  done
  du -sh $R/k*; exit 0
fi
rm -rf $R && mkdir -p $R/a/whl $R/b $R/c
wheels=$(grep -v '^connection-pool' benchmarks/remote/wheels.txt)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d $R/a/whl $wheels
python3 -m pip wheel -q --no-deps -w $R/a/whl "$(grep '^connection-pool' benchmarks/remote/wheels.txt)"
python3 -c "import sys, zstandard; zstandard.ZstdCompressor(level=19, threads=-1).copy_stream(open(sys.argv[1], 'rb'), open(sys.argv[2], 'wb'))" \
    resources/sharegpt/ShareGPT_V3_unfiltered_cleaned_split.json $R/a/sharegpt.json.zst
G=resources/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
head -c 35000000 $G > $R/a/gguf.0
tail -c +35000001 $G > $R/b/gguf.1
cp resources/humaneval/HumanEval.jsonl.gz $R/b/
cp resources/code/*.whl $R/c/
du -sh $R/a $R/b $R/c
