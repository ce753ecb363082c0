#!/usr/bin/env bash
# Runs on the GPU machine (built by scripts/device_build.sh): every CUDA test binary, then the
# transformers baseline, `mxrl bench model` and the GEMM benchmark in the same call. Logs go to
# $OUT when set.
# Usage: scripts/device_run.sh [tests] [bench] [hf] [gemm] [headops]   (default: all five)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/mxrl-device}
mkdir -p "$out"
what=${*:-tests bench hf gemm headops}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
summary=()
if [[ $what == *tests* ]]; then
  for t in .dev/tests/*; do
    name=$(basename "$t")
    timeout 300 "$t" --test-threads=1 >"$out/$name.log" 2>&1
    rc=$?
    res=$(grep -E '^test result' "$out/$name.log" | tail -1)
    summary+=("$name rc=$rc ${res:-no result}")
    grep -E '^test .* FAILED|panicked' "$out/$name.log" | head -5
  done
fi
if [[ $what == *hf* ]]; then
  timeout 400 python3 scripts/bench_hf.py --json-out "$out/hf.json" >"$out/hf.log" 2>&1
  summary+=("bench_hf rc=$?")
  tail -15 "$out/hf.log"
fi
if [[ $what == *bench* ]]; then
  hf=()
  [[ -f $out/hf.json ]] && hf=(--hf-json "$out/hf.json")
  timeout 400 .dev/mxrl bench model --device cuda "${hf[@]}" --json-out "$out/bench.json" 2>&1 | tee "$out/bench.log" | tail -20
  summary+=("bench_model rc=${PIPESTATUS[0]}")
fi
if [[ $what == *gemm* ]]; then
  timeout 300 .dev/bench_gemm 2>&1 | tee "$out/bench_gemm.log" | tail -80
  summary+=("bench_gemm rc=${PIPESTATUS[0]}")
fi
if [[ $what == *headops* ]]; then
  timeout 300 .dev/bench_head_ops 2>&1 | tee "$out/bench_head_ops.log" | tail -40
  summary+=("bench_head_ops rc=${PIPESTATUS[0]}")
fi
echo "=== summary"
printf '%s\n' "${summary[@]}"
