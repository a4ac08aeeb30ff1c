#!/bin/bash
# A refactor of a captured hot path timed before and after on one card, back to back (issue 61):
# `bash benchmarks/remote/before_after.sh OLD CELL...` with OLD a folder holding the earlier
# commit's src/ and benchmarks/ (here: `mkdir .old && git archive <commit> src benchmarks | tar -x
# -C .old`, carried as an ignored path), each CELL one of
#   regen     benchmarks/regenerate.py --shapes recipe --paths engine: tok/s and the step alone
#   eval      benchmarks/evaluate.py --shapes smollm2 --block 8 --capacity 784 --budgets 16
#             --concurrency 1 16: target and DFlash steps at c = 1 (Engine) and c rows
# Each cell runs old, then new, then old and new again where REPEAT=1, every tree with its own
# benchmark script and code. Wheels the GPU machine lacks (jsonschema for the config module)
# travel in .whl. Logs and JSON go to $OUT (or /tmp/ba); the last lines print a table.
set -uo pipefail
cd "$(dirname "$0")/../.."
OLD=$1; shift
O=${OUT:-/tmp/ba}; mkdir -p "$O"
export PYTHONUNBUFFERED=1
if [ -d .whl ] && [ ! -f /tmp/site/.done-ba ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
    && touch /tmp/site/.done-ba
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$O/card.txt"
run_cell() {  # run_cell CELL TREE-ROOT TAG
  local cell=$1 root=$2 tag=$3 args
  case $cell in
    regen) args=(benchmarks/regenerate.py --shapes recipe --paths engine) ;;
    eval) args=(benchmarks/evaluate.py --shapes smollm2 --block 8 --capacity 784 --budgets 16
                --concurrency 1 16) ;;
    *) echo "before_after.sh: unknown cell $cell" >&2; return 2 ;;
  esac
  local t0=$SECONDS
  (cd "$root" && PYTHONPATH=/tmp/site:$PWD/src python3 "${args[@]}" --out "$O/$cell-$tag.json") \
    > "$O/$cell-$tag.log" 2>&1
  echo "$cell $tag: exit $? in $((SECONDS - t0)) s"
}
for cell in "$@"; do
  run_cell "$cell" "$OLD" old
  run_cell "$cell" . new
  if [ "${REPEAT:-0}" = 1 ]; then
    run_cell "$cell" . new2
    run_cell "$cell" "$OLD" old2
  fi
done
python3 - "$O" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
for path in sorted(out.glob("*.json")):
    res = json.loads(path.read_text())
    if "rows" in res:  # regenerate.py
        for r in res["rows"]:
            print(f"{path.stem:<12} {r['shape']} {r['path']}: {r['tok_s']:,.0f} tok/s, "
                  f"{r['step_ms']:.3f} ms/step in the run, {r['step_alone_ms']:.3f} alone")
    for shape in ("smollm2",):
        for name, r in (res.get(shape) or {}).get("methods", {}).items():
            if name.startswith("engine"):
                print(f"{path.stem:<12} {name:<34} {r['ms_per_step']:7.3f} ms/step")
PY
