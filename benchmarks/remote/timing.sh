#!/bin/bash
# setsid bash benchmarks/remote/timing.sh DIR [PART...]: the step-time benchmarks that must have
# the card to themselves, in the background (they outlive the call that starts them; DIR/done
# marks the end), the PARTs in order (default: steps cells):
#   steps    DFlash's and DFlash2's decoding step at the recipe's shapes, alternating, two rounds
#            each (issue 63's 10% bound): DIR/step-ARCH-ROUND.{json,log}
#   cells    each quality cell's train step in turns (issue 62's 15% bound): DIR/cells.{json,log}
#   dflash2  decay CE's and DFlash2's train steps alone, in turns: DIR/dflash2.{json,log}
#   profile  decay CE's and DFlash2's train step, each cell's kernel table: DIR/prof-CELL.txt
cd "$(dirname "$0")/../.." && . benchmarks/remote/setup.sh >/dev/null
D=${1:-/tmp/t}; shift || true; mkdir -p $D; rm -f $D/done
for part in ${@:-steps cells}; do
  case $part in
    steps)
      for round in 1 2; do
        for a in dflash dflash2; do
          python3 benchmarks/evaluate.py --shapes smollm2 --block 8 --capacity 784 --budgets 16 \
            --prompts 2 --architecture $a --out $D/step-$a-$round.json > $D/step-$a-$round.log 2>&1
        done
      done ;;
    cells)
      python3 benchmarks/train.py --cells qx4-ce qx4-kl qx4-greedy qx4-dpace qx4-el qx4-dflash2 \
        --steps 10 --rounds 3 --out $D/cells.json > $D/cells.log 2>&1 ;;
    dflash2)
      python3 benchmarks/train.py --cells qx4-ce qx4-dflash2 --steps 10 --rounds 3 \
        --out $D/dflash2.json > $D/dflash2.log 2>&1 ;;
    profile)
      python3 benchmarks/train.py --cells qx4-ce qx4-dflash2 --steps 5 --rounds 1 \
        --profile $D/prof --out $D/prof.json > $D/prof.log 2>&1 ;;
    *) echo "timing.sh: unknown part $part (steps, cells, dflash2, profile)" >&2 ;;
  esac
done
touch $D/done
