#!/usr/bin/env bash
# Prepares, on a machine that reaches PyPI and has resources/ retrieved (`snakemake --cores 1
# resources --configfile configs/smollm2-sharegpt.yaml`), what a GPU machine without network
# needs to run benchmarks/quality.py, in two parts of under 64 MiB each with the working tree
# (one per transfer), so the second call can already start the recipe:
#   .remote/a: the wheels that machine lacks (wheels.txt, Python 3.12), ShareGPT (zstd),
#              HumanEval, the code prompts' wheels (resources/code/), the GGUF's zstd stream's head
#   .remote/b: the rest of the GGUF's zstd stream (SmolLM2's Q4_1 GGUF: 98.4 MB, 90.1 MB in zstd)
# There: `. benchmarks/remote/setup.sh` after each part arrives (it assembles resources/ under
# /tmp/res once both are there), then `setsid bash benchmarks/remote/bg.sh bf16 ...` starts the
# runs in the background and `bash benchmarks/remote/mon.sh SECONDS` follows them.
# `pack.sh answers DIR...`: instead, the kept answers calls brought back (answers-*.part-*, from
# mon.sh with KEEP=..., each call's files_at a DIR) into .remote/k1, k2, ..., each as full as one
# carry beside the working tree allows (largest parts first), one carry per folder;
# setup.sh gathers them and bg.sh restores them, so those runs start at extract.
# `pack.sh gemma`: Gemma 3 270M's GGUF (configs/gemma3-270m-quality.yaml, 253 MB, retrieved
# here) in five parts .remote/g1..g5 of about 51 MB, one carry each, beside a/b/c's wheels and
# prompts; setup.sh joins them once all five are there and checks the config's sha256.
# `pack.sh compile DIR...`: the compile-cache bundles an earlier machine saved (mon.sh BUNDLES=1
# returns them as DIR/cc.tar.zst, a few MB) into .remote/cc, carried beside a part or alone;
# setup.sh unpacks them where DFLASHPIPE_COMPILE_CACHE points.
# `pack.sh tests`: pytest and what it needs beyond the GPU machine's packages (this machine's
# versions, about 1.7 MB) into .remote/t/whl, carried beside a part; setup.sh installs them, and
# `python3 -m pytest -p no:xdist -o addopts= -q -m gpu tests/test_engine.py` runs the
# gpu-marked tests there (no xdist on that machine: addopts emptied).
set -euo pipefail
cd "$(dirname "$0")/../.."
R=${PACK_OUT:-.remote}   # PACK_OUT: another folder for the parts (the tests)
# The bytes a call carries beside a part: the working tree, tracked and untracked-not-ignored
# files. A source tree without .git (a `git archive` tarball) has no index to ask: there every
# file counts but those under a name .gitignore lists (a name or glob, matched at any depth as
# git does); a pattern with a slash inside or a negation is refused rather than mis-measured.
tree_bytes() {
  if [ "$(git rev-parse --show-toplevel 2>/dev/null)" = "$(pwd -P)" ]; then
    git ls-files -z -co --exclude-standard
  else
    local skip=(-name .git -prune) p
    while IFS= read -r p || [ -n "$p" ]; do
      case $p in ''|'#'*) continue ;; esac
      p=${p%/}
      case $p in */*|'!'*)
        echo "pack.sh: .gitignore pattern '$p' needs git to measure the tree; run it in a checkout" >&2
        return 1 ;;
      esac
      skip+=(-o -name "$p" -prune)
    done < .gitignore
    find . \( "${skip[@]}" \) -o -type f -print0
  fi | du -cb --files0-from=- | tail -1 | cut -f1
}
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
if [ "${1:-}" = tests ]; then
  rm -rf $R/t && mkdir -p $R/t/whl
  pins=$(python3 -c "from importlib.metadata import version as v; print(*[f'{p}=={v(p)}' for p in ('pytest', 'pluggy', 'iniconfig', 'pygments')])")
  python3 -m pip download -q --no-deps -d $R/t/whl $pins
  du -sh $R/t; exit 0
fi
if [ "${1:-}" = compile ]; then
  shift; rm -rf $R/cc && mkdir -p $R/cc; n=0
  for d in "$@"; do n=$((n + 1)); cp "$d"/cc.tar.zst $R/cc/cc-$n.tar.zst; done
  du -sh $R/cc; exit 0
fi
if [ "${1:-}" = answers ]; then   # first fit, largest parts first: the fewest carries
  shift; rm -rf $R/k*
  tree=$(tree_bytes)
  python3 - $R $((67108864 - tree - 1000000)) "$@" <<'PY'
import shutil, sys
from pathlib import Path
out, room, dirs = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
parts = [p for d in dirs for p in Path(d).glob("answers-*.part-*")]
used: list[int] = []
for part in sorted(parts, key=lambda p: (-p.stat().st_size, p.name)):
    size = part.stat().st_size
    n = next((i for i, u in enumerate(used) if u + size <= room), len(used))
    used += [0] * (n + 1 - len(used))
    used[n] += size
    (out / f"k{n + 1}").mkdir(parents=True, exist_ok=True)
    shutil.copy(part, out / f"k{n + 1}" / part.name)
PY
  du -sh $R/k*; exit 0
fi
rm -rf $R && mkdir -p $R/a/whl $R/b
wheels=$(grep -v '^connection-pool' benchmarks/remote/wheels.txt)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d $R/a/whl $wheels
python3 -m pip wheel -q --no-deps -w $R/a/whl "$(grep '^connection-pool' benchmarks/remote/wheels.txt)"
zst() { python3 -c "import sys, zstandard; zstandard.ZstdCompressor(level=19, threads=-1).copy_stream(open(sys.argv[1], 'rb'), open(sys.argv[2], 'wb'))" "$1" "$2"; }
zst resources/sharegpt/ShareGPT_V3_unfiltered_cleaned_split.json $R/a/sharegpt.json.zst
cp resources/humaneval/HumanEval.jsonl.gz $R/a/
cp resources/code/*.whl $R/a/
G=resources/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
zst $G $R/gguf.zst
# the stream's head fills part a up to half of everything; part b takes its tail
head_bytes=$(( ($(du -sb $R/a | cut -f1) + $(stat -c %s $R/gguf.zst)) / 2 - $(du -sb $R/a | cut -f1) ))
head -c $head_bytes $R/gguf.zst > $R/a/gguf.zst.0
tail -c +$((head_bytes + 1)) $R/gguf.zst > $R/b/gguf.zst.1
rm $R/gguf.zst
# a call carries its part beside the working tree (tracked and untracked-not-ignored files)
tree=$(tree_bytes)
for part in $R/a $R/b; do
  total=$(( $(du -sb $part | cut -f1) + tree ))
  echo "$part with the working tree: $total bytes (a call carries at most 67108864)"
  if [ $total -gt 67108864 ]; then echo "pack.sh: $part does not fit one call" >&2; exit 1; fi
done
