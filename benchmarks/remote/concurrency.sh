#!/bin/bash
# setsid bash benchmarks/remote/concurrency.sh [OVERLAY.yaml...]: issue 47's GPU cell in the
# background (OVERLAYs merged in order on the recipe: benchmarks/remote/concurrency.yaml unless
# named; CONC_OUT=DIR for another folder than /tmp/conc, e.g. a second cell's), alone on
# the card (its speeds are the figures). A drafter kept from an earlier machine (drafter-*.tar.zst,
# a zstd tar of drafter/, or mon.sh DRAFTER=...'s parts of it) and the eval prompts (eval.parquet)
# travel in a .remote/k* folder and land in /tmp/xfer; the recipe's evaluate with
# benchmarks/remote/concurrency.yaml on top decodes them one at a time and c at a time per level.
# /tmp/conc gets concurrency.json, evaluate.log, cc.tar.zst (the compile bundles this machine
# saved, evaluate's included: a few MB of zstd, for `pack.sh compile DIR` to carry next time) and
# DONE (holding the exit status); copy them into $OUT on a later call.
cd "$(dirname "$0")/../.." && . benchmarks/remote/setup.sh >/dev/null
C=${CONC_OUT:-/tmp/conc}; mkdir -p $C
D=$(ls /tmp/xfer/drafter-*.tar.zst.[0-9]* 2>/dev/null || ls /tmp/xfer/drafter-*.tar.zst)  # parts or joined
cat $D | unzst | tar x -C $C
[ $# -gt 0 ] || set -- benchmarks/remote/concurrency.yaml
python3 - "$@" <<'PY' > $C/config.yaml
import sys, yaml
sys.path.insert(0, "benchmarks")
from quality import merged_configs
print(yaml.safe_dump(merged_configs(["configs/smollm2-sharegpt.yaml", *sys.argv[1:]])))
PY
python3 -m dflashpipe evaluate --config $C/config.yaml --drafter $C/drafter \
  --prompts /tmp/xfer/eval.parquet --out $C/concurrency.json --device cuda:0 > $C/evaluate.log 2>&1
status=$?
bundles > $C/cc.tar.zst
echo $status > $C/DONE
