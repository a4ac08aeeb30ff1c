#!/bin/bash
# bash benchmarks/remote/mon.sh SECONDS: the background quality runs' status every 60 s until all
# are done or SECONDS pass; then the table, and their small files bundled into $OUT/q.tar.gz.
# KEEP="main stdlib-answers" also brings those runs' regenerated answers back in $OUT (parts of
# <= 15 MB in /tmp/q/keep, quality.py --keep; the first 4 beside the (up to four) other files it
# returns, the rest named for a later call to copy). BUNDLES=1 also returns the torch.compile
# bundles the runs saved (/tmp/cc, as one zstd tar cc.tar.zst: `pack.sh compile DIR` carries them
# to the next machine; not CC=1: the GPU machine exports CC, the C compiler). DRAFTER=VARIANT
# also returns that run's exported drafter as a zstd tar of drafter/ in parts of 15 MB
# (drafter-VARIANT.tar.zst.00, .01, ...: `cat` them; concurrency.sh takes the joined tar).
cd "$(dirname "$0")/../.." && . benchmarks/remote/setup.sh >/dev/null
end=$((SECONDS + $1))
if ! ls -d /tmp/runs/quality-* >/dev/null 2>&1; then  # a fresh machine: the warm one was handed back
  echo "mon.sh: no quality runs under /tmp/runs on this machine; start them with bg.sh" >&2; exit 1
fi
status() {
  echo "== $(date +%T)"
  for w in /tmp/runs/quality-*; do
    r=$w/results; n=$(basename $w)
    echo "$n: done[$(ls $r/benchmarks/*/ 2>/dev/null | grep -c tsv)] $(tail -c 300 $w/quality.log 2>/dev/null | tr '\n\r' '  ' | tail -c 160)"
    [ -f $r/train/metrics.jsonl ] && tail -1 $r/train/metrics.jsonl | cut -c1-200
    ls $r/logs/evaluate* >/dev/null 2>&1 && tail -c 200 $r/logs/evaluate*.log 2>/dev/null | tr '\r' '\n' | tail -2
  done
  for f in /tmp/q/*.FAILED; do  # a run whose driver failed (bg.sh), named at once with its error
    [ -e "$f" ] || continue
    out=${f%.FAILED}.out
    echo "FAILED $(basename "$out" .out): $(grep -E "Error|snakemake exit" "$out" | tail -2 | cut -c1-300)"
  done
  nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader
  echo "disk $(df -h --output=used,avail /tmp | tail -1) mem $(free -g | awk '/Mem/{print $3"G used"}') load $(cut -d' ' -f1 /proc/loadavg)"
}
while [ $SECONDS -lt $end ] && [ ! -f /tmp/q/ALLDONE ]; do
  status; sleep $(( (end - SECONDS) < 60 ? (end - SECONDS > 0 ? end - SECONDS : 1) : 60 ))
done
status
python3 benchmarks/quality.py --table --runs /tmp/runs --out $OUT/rows.json --bundle $OUT/q.tar.gz
cat /tmp/q/*.out > $OUT/drivers.out 2>/dev/null
[ -f /tmp/q/steps.json ] && cp /tmp/q/steps.json $OUT/  # bg.sh STEPS=...
if [ -n "${BUNDLES:-}" ] && ls /tmp/cc/*.torchcompile >/dev/null 2>&1; then  # BUNDLES=1: the compile bundles
  # in one zstd tar: they shrink about 29x (regenerate's 14.4 MB to 0.5 MB), under a returned
  # file's 16 MiB and a carry's 64 MiB together
  bundles > $OUT/cc.tar.zst
  ls /tmp/cc/*.torchcompile | xargs -n1 basename; du -sh $OUT/cc.tar.zst
fi
if [ -n "${DRAFTER:-}" ] && [ -d /tmp/runs/quality-$DRAFTER/results/drafter ]; then
  tar cf - -C /tmp/runs/quality-$DRAFTER/results drafter | zst | split -b 15000000 -d - $OUT/drafter-$DRAFTER.tar.zst.
  ls -la $OUT/drafter-$DRAFTER.tar.zst.*
fi
if [ -n "${KEEP:-}" ]; then   # a call returns 8 files: 4 parts here, the rest on later calls
  python3 benchmarks/quality.py $KEEP --runs /tmp/runs --table --keep /tmp/q/keep >/dev/null
  ls /tmp/q/keep | head -4 | while read -r f; do cp /tmp/q/keep/$f $OUT/; done
  ls /tmp/q/keep | tail -n +5 | sed 's/^/mon.sh: not returned yet, copy on a later call: \/tmp\/q\/keep\//'
fi
