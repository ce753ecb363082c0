#!/usr/bin/env bash
set -uo pipefail
out=${OUT:-/tmp/o}; log=$out/device.log
for t in .dev/tests/*; do echo "===== $t" >>"$log"; timeout 200 "$t" --test-threads=1 >>"$log" 2>&1; echo "$t rc=$? $(grep -E '^test result' "$log" | tail -1)"; done
grep -E "panicked|FAILED|failed" "$log" | head -20
timeout 330 .dev/mxrl bench model --device cuda --train-recipes bf16,mxfp8,mxfp8-hp,mxfp8-dq,nvfp4-hp,nvfp4-dq --train-steps 3 --batches 32 --expert-formats bf16 >>"$log" 2>&1
echo "bench rc=$?"
sed -n '/^mxrl bench model:/,$p' "$log" | tail -30
grep -E "phase|backward|optimizer" "$log" | tail -30
