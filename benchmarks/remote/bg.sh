#!/bin/bash
# setsid bash benchmarks/remote/bg.sh VARIANT[:TARGET]...: the quality runs in the background (they
# outlive the call that starts them), main first; a variant starts once the deepest stage of main
# (or of the run its overlay's `# from:` line names) that its `# reuse:` line shares has finished
# (none: at once), and the files of other runs its `# wait:` line names (relative to its work
# directory) exist. /tmp/q/ALLDONE marks the end. QUALITY_EXTRA="FILE..." adds config files on top of every run's (e.g. other sizes), in order;
# MAIN_TARGET=extract stops main at its features (when only a variant's drafter is wanted);
# MAIN_TARGET=none runs no main (variants on another recipe: MAIN_TARGET=none bg.sh gemma3).
# Answers kept from an earlier machine (mon.sh KEEP=..., carried as .remote/k*/ and gathered by
# setup.sh in /tmp/xfer) are restored into their runs first (quality.py --restore).
# After those: ALONE="betas999 ..." runs each listed variant on to `all`, one at a time with
# nothing beside it (its evaluate's speeds are timing-grade: e.g. betas999:train above, then
# ALONE=betas999), and
# STEPS="--block 8 --capacity 784 ..." runs benchmarks/evaluate.py alone with those arguments
# into /tmp/q/steps.json (mon.sh returns it); then ALLDONE.
# WARM=VARIANT (one of those listed): the other variants that train on features they reuse
# start once VARIANT's first optimizer step is logged (waiting at most 300 s), so that those of
# its shapes find its compiled graphs in the machine's Inductor cache instead of all compiling
# at once (H200, 2026-12-04: 221 s of compiling for the first cell, 5-6 s for those after it).
cd "$(dirname "$0")/../.." && . benchmarks/remote/setup.sh >/dev/null
mkdir -p /tmp/q
EXTRA="--restore /tmp/xfer"; for f in ${QUALITY_EXTRA:-}; do EXTRA="$EXTRA --configfile $f"; done
if [ "${MAIN_TARGET:-all}" != none ]; then
  python3 benchmarks/quality.py main --runs /tmp/runs --target ${MAIN_TARGET:-all} $EXTRA > /tmp/q/main.out 2>&1 &
fi
for spec in "$@"; do   # VARIANT or VARIANT:TARGET (e.g. block16:train: no evaluate)
  v=${spec%%:*}; target=all; [[ $spec == *:* ]] && target=${spec#*:}
  reuse=" $(sed -n 's/^# reuse://p' benchmarks/quality/$v.yaml) "
  from=$(sed -n 's/^# from: *//p' benchmarks/quality/$v.yaml)
  M=/tmp/runs/quality-${from:-main}/results
  case $reuse in   # wait for the deepest stage of that run the variant shares
    *" features "*) need=$M/features/manifest.json ;;
    *" sequences "*) need=$M/sequences/shard-00000.parquet ;;
    *" prompts "*) need=$M/prompts/train.parquet ;;
    *) need=/ ;;
  esac
  waits=$(sed -n 's/^# wait://p' benchmarks/quality/$v.yaml)  # other runs' files it reads
  mkdir -p /tmp/runs/quality-$v
  (until [ -e $need ]; do sleep 5; done
   for w in $waits; do until [ -e /tmp/runs/quality-$v/$w ]; do sleep 5; done; done; sleep 2
   if [ -n "${WARM:-}" ] && [ "$v" != "$WARM" ] && [[ $reuse == *" features "* ]]; then
     log=/tmp/runs/quality-$WARM/results/logs/train.log; t=$SECONDS
     until grep -qs "first optimizer step" $log || [ $((SECONDS - t)) -gt 300 ]; do sleep 5; done
   fi
   python3 benchmarks/quality.py $v --runs /tmp/runs --target $target $EXTRA > /tmp/q/$v.out 2>&1) &
done
wait
for v in ${ALONE:-}; do
  python3 benchmarks/quality.py $v --runs /tmp/runs --target all $EXTRA > /tmp/q/$v-alone.out 2>&1
done
if [ -n "${STEPS:-}" ]; then
  python3 benchmarks/evaluate.py --shapes smollm2 $STEPS --out /tmp/q/steps.json > /tmp/q/steps.out 2>&1
fi
touch /tmp/q/ALLDONE
