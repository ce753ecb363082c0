#!/usr/bin/env bash
# Runs on the GPU machine: the training step of every recipe under two `mxrl` binaries (e.g.
# a baseline commit's and HEAD's, both built with `--features cuda`, stripped and carried),
# alternated REPS times in one call so both see the same machine, then one line per binary and
# recipe: the median step over its runs, its forward / backward / optimizer, and × BF16 of the
# same binary. Logs of every run go to $OUT.
# Usage: scripts/device_ab.sh BIN_A BIN_B [RECIPES] [REPS]
#   RECIPES default bf16,mxfp8,mxfp8-hp,mxfp8-dq,nvfp4-hp,nvfp4-dq,fp8-block (bf16 is added
#   when missing: the ratios need it); REPS default 2.
#   BUDGET_S (optional): seconds this script may take; a pair of runs (one per binary)
#   starts only while at least twice RUN_S (default 70) of them are left, and a run is cut at
#   what is left, so a short call still ends with the table of the runs that finished.
set -uo pipefail
t0=$(date +%s)
# Seconds left, at least 1 (`timeout 0` would mean no limit).
left() {
  local l=$(( ${BUDGET_S:-100000} - ($(date +%s) - t0) ))
  echo $(( l < 1 ? 1 : l ))
}
a=$1
b=$2
recipes=${3:-bf16,mxfp8,mxfp8-hp,mxfp8-dq,nvfp4-hp,nvfp4-dq,fp8-block}
reps=${4:-2}
[[ ,$recipes, == *,bf16,* ]] || recipes=bf16,$recipes
out=${OUT:-/tmp/mxrl-device}
mkdir -p "$out"
for r in $(seq 1 "$reps"); do
  (( $(left) < 2 * ${RUN_S:-70} )) && break
  for bin in "$a" "$b"; do
    log="$out/ab_$(basename "$bin")_$r.txt"
    timeout "$(left)" "$bin" bench model --device cuda --train-recipes "$recipes" --train-steps 3 \
      --batches 1 --steps 2 --prefill 16 --reps 1 >"$log" 2>&1
    echo "$(basename "$bin") run $r: rc=$?"
  done
done
python3 - "$out" "$a" "$b" <<'PY'
import re, statistics, sys, glob, os
out, bins = sys.argv[1], sys.argv[2:]
pat = re.compile(r"^(\S+) train step (\d+): ([\d.]+) ms \(forward ([\d.]+), backward ([\d.]+)"
                 r".*optimizer ([\d.]+)\)")
for b in bins:
    name = os.path.basename(b)
    steps = {}
    for f in sorted(glob.glob(f"{out}/ab_{name}_*.txt")):
        for line in open(f):
            m = pat.match(line)
            # Steps 0-2 are the warm-up ones.
            if m and int(m.group(2)) >= 3:
                steps.setdefault(m.group(1), []).append(tuple(float(x) for x in m.group(3, 4, 5, 6)))
    if "bf16" not in steps:
        print(f"{name}: no BF16 step")
        continue
    base = statistics.median(s[0] for s in steps["bf16"])
    for rec, v in steps.items():
        med = sorted(v)[len(v) // 2]
        print(f"{name:14s} {rec:10s} {med[0]:7.1f} ms  fwd {med[1]:5.1f} bwd {med[2]:5.1f} "
              f"opt {med[3]:5.1f}  x{med[0] / base:.2f} BF16  ({len(v)} steps)")
PY
