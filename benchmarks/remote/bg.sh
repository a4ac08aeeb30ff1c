#!/bin/bash
# setsid bash benchmarks/remote/bg.sh VARIANT[:TARGET]...: the quality runs in the background (they
# outlive the call that starts them), main first; a variant starts once the deepest stage of main
# (or of the run its overlay's `# from:` line names) that its `# reuse:` line shares has finished
# (none: at once), and the files of other runs its `# wait:` line names (relative to its work
# directory) exist. /tmp/q/ALLDONE marks the end of every bg.sh started on the machine (one
# started while another runs, e.g. a second recipe's variant, holds it back). QUALITY_EXTRA="FILE..." adds config files on top of every run's (e.g. other sizes), in order;
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
# A run whose driver fails leaves /tmp/q/VARIANT.FAILED; the runs waiting on its files then
# give up (marked FAILED too, with the reason in their .out) instead of waiting for ever.
cd "$(dirname "$0")/../.." && . benchmarks/remote/setup.sh >/dev/null
mkdir -p /tmp/q
rm -f /tmp/q/ALLDONE; touch /tmp/q/running.$$  # ALLDONE once no bg.sh is left running
EXTRA="--restore /tmp/xfer"; for f in ${QUALITY_EXTRA:-}; do EXTRA="$EXTRA --configfile $f"; done
drive() {  # drive VARIANT TARGET: its quality run, FAILED marked where the driver fails
  python3 benchmarks/quality.py $1 --runs /tmp/runs --target $2 $EXTRA > /tmp/q/$1.out 2>&1 \
    || touch /tmp/q/$1.FAILED
}
await() {  # await VARIANT FILE RUN: wait for FILE, which RUN writes; false once RUN has failed
  until [ -e $2 ]; do
    if [ -e /tmp/q/$3.FAILED ]; then
      echo "bg.sh: $1 not run: $3, which writes $2, failed (Error)" > /tmp/q/$1.out
      touch /tmp/q/$1.FAILED; return 1
    fi
    sleep 5
  done
}
if [ "${MAIN_TARGET:-all}" != none ]; then
  rm -f /tmp/q/main.FAILED
  drive main ${MAIN_TARGET:-all} &
fi
for spec in "$@"; do rm -f /tmp/q/${spec%%:*}.FAILED; done  # an earlier call's, now run again
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
  (await $v $need ${from:-main} || exit
   for w in $waits; do  # ../quality-RUN/...: a file of another run
     run=$(sed -n 's|^\.\./quality-\([^/]*\)/.*|\1|p' <<< "$w")
     await $v /tmp/runs/quality-$v/$w "$run" || exit
   done; sleep 2
   if [ -n "${WARM:-}" ] && [ "$v" != "$WARM" ] && [[ $reuse == *" features "* ]]; then
     log=/tmp/runs/quality-$WARM/results/logs/train.log; t=$SECONDS
     until grep -qs "first optimizer step" $log || [ $((SECONDS - t)) -gt 300 ]; do sleep 5; done
   fi
   drive $v $target) &
done
wait
for v in ${ALONE:-}; do
  python3 benchmarks/quality.py $v --runs /tmp/runs --target all $EXTRA > /tmp/q/$v-alone.out 2>&1
done
if [ -n "${STEPS:-}" ]; then
  python3 benchmarks/evaluate.py --shapes smollm2 $STEPS --out /tmp/q/steps.json > /tmp/q/steps.out 2>&1
fi
rm -f /tmp/q/running.$$
ls /tmp/q/running.* >/dev/null 2>&1 || touch /tmp/q/ALLDONE
