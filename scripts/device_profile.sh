#!/usr/bin/env bash
# Runs on the GPU machine: per-kernel device time of `mxrl bench model`'s training step (one
# warm-up + one timed step of 8 × 512 tokens, tiny prefill/decode), read by Nsight Compute
# with the clocks left alone, summed per kernel name; prints the 30 largest and the total.
# Usage: scripts/device_profile.sh [extra bench-model flags]
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/mxrl-device}
mkdir -p "$out"
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
timeout 500 "$ncu" --clock-control none --metrics gpu__time_duration.sum --csv \
  --log-file "$out/ncu.log" \
  .dev/mxrl bench model --device cuda --batches 1 --steps 1 --prefill 16 --reps 1 \
  --train-steps 1 "$@" >"$out/ncu.csv" 2>"$out/ncu.err"
echo "ncu rc=$?"
# With --log-file, ncu writes the CSV rows into the log file.
python3 - "$out/ncu.log" <<'PY'
import csv, sys, collections
rows = [l for l in open(sys.argv[1]) if l.startswith('"')]
tot = collections.defaultdict(float); cnt = collections.Counter()
for r in csv.DictReader(rows):
    if r.get("Metric Name") != "gpu__time_duration.sum":
        continue
    v = float(r["Metric Value"].replace(",", ""))
    unit = r.get("Metric Unit", "ns")
    v *= {"ns": 1e-3, "usecond": 1, "us": 1, "msecond": 1e3, "ms": 1e3}.get(unit, 1e-3)
    name = r["Kernel Name"].split("(")[0][:60]
    tot[name] += v; cnt[name] += 1
all_us = sum(tot.values())
print(f"kernels: {sum(cnt.values())}, total {all_us/1e3:.1f} ms")
for n, v in sorted(tot.items(), key=lambda x: -x[1])[:30]:
    print(f"{v/1e3:9.2f} ms {cnt[n]:6d}x {100*v/all_us:5.1f}%  {n}")
PY
tail -5 "$out/ncu.err"
