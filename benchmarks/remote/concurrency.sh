#!/bin/bash
# setsid bash benchmarks/remote/concurrency.sh [OVERLAY.yaml...]: issue 47's GPU cell in the
# background (OVERLAYs merged in order on the recipe: benchmarks/remote/concurrency.yaml unless
# named; CONC_OUT=DIR for another folder than /tmp/conc, e.g. a second cell's), alone on
# the card (its speeds are the figures). A drafter kept from an earlier machine (drafter-*.tar.zst,
# a zstd tar of drafter/, or mon.sh DRAFTER=...'s parts of it) and the eval prompts (eval.parquet)
# travel in a .remote/k* folder and land in /tmp/xfer (DRAFTER=VARIANT picks drafter-VARIANT.* where
# several came); the recipe's evaluate with
# benchmarks/remote/concurrency.yaml on top decodes them one at a time and c at a time per level.
# /tmp/conc gets concurrency.json, evaluate.log, cc.tar.zst (the compile bundles this machine
# saved, evaluate's included: a few MB of zstd, for `pack.sh compile DIR` to carry next time) and
# DONE (holding the exit status); copy them into $OUT on a later call. RECIPE=FILE: another
# recipe than configs/smollm2-sharegpt.yaml (e.g. Gemma 3's kept drafter evaluated as its recipe
# says: RECIPE=configs/gemma3-270m-quality.yaml ... concurrency.sh benchmarks/quality/gemma3.yaml).
cd "$(dirname "$0")/../.." && . benchmarks/remote/setup.sh >/dev/null
C=${CONC_OUT:-/tmp/conc}; mkdir -p $C
N=${DRAFTER:-*}  # DRAFTER=VARIANT: that run's drafter, where the machine holds several
D=$(ls /tmp/xfer/drafter-$N.tar.zst.[0-9]* 2>/dev/null || ls /tmp/xfer/drafter-$N.tar.zst)  # parts or joined
if [ -z "$D" ] || [ "$(printf '%s\n' $D | sed 's/[.][0-9]*$//' | sort -u | wc -l)" != 1 ]; then
  echo "concurrency.sh: $(echo $D | wc -w) drafter files match drafter-$N.tar.zst*; name one with DRAFTER=" >&2
  mkdir -p $C && echo 2 > $C/DONE; exit 2
fi
cat $D | unzst | tar x -C $C
[ $# -gt 0 ] || set -- benchmarks/remote/concurrency.yaml
# target.model as the real path setup.sh links resources/ to: a later call's copy of the working
# tree removes that link until its setup.sh makes it again, and an evaluate that read
# resources/ in that gap failed (nineteenth session: a GGUF conversion, then the end of a cell)
python3 - "$@" <<'PY' > $C/config.yaml
import os, sys, yaml
sys.path.insert(0, "benchmarks")
from quality import merged_configs
raw = merged_configs([os.environ.get("RECIPE", "configs/smollm2-sharegpt.yaml"), *sys.argv[1:]])
raw["target"]["model"] = os.path.realpath(raw["target"]["model"])
print(yaml.safe_dump(raw))
PY
python3 -m dflashpipe evaluate --config $C/config.yaml --drafter $C/drafter \
  --prompts /tmp/xfer/eval.parquet --out $C/concurrency.json --device cuda:0 > $C/evaluate.log 2>&1
status=$?
bundles > $C/cc.tar.zst
echo $status > $C/DONE
