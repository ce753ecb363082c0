#!/usr/bin/env bash
# Runs on the GPU machine (built by scripts/device_build.sh): every CUDA test binary, then the
# transformers baseline, `mxrl bench model` and the GEMM benchmark in the same call. All logs
# go to $OUT/device.log (one file: the device tool returns few files); JSON results beside it.
# Usage: scripts/device_run.sh [tests] [hf] [bench] [gemm] [qgemm] [quant] [attn] [headops] [clients]
#   (default: tests hf bench)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/mxrl-device}
mkdir -p "$out"
log=$out/device.log
what=${*:-tests hf bench}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$log"
summary=()
if [[ " $what " == *" tests "* ]]; then
  for t in .dev/tests/*; do
    name=$(basename "$t")
    start=$(date +%s)
    echo "===== $name" >>"$log"
    timeout 240 "$t" --test-threads=1 --nocapture >>"$log" 2>&1
    rc=$?
    res=$(sed -n "/===== $name/,\$p" "$log" | grep -E '^test result' | tail -1)
    summary+=("$name rc=$rc $(( $(date +%s) - start ))s ${res:-no result}")
  done
fi
if [[ " $what " == *" hf "* ]]; then
  echo "===== bench_hf" >>"$log"
  timeout 420 python3 scripts/bench_hf.py --json-out "$out/hf.json" >>"$log" 2>&1
  summary+=("bench_hf rc=$?")
fi
if [[ " $what " == *" bench "* ]]; then
  hf=()
  if [[ -f $out/hf.json ]]; then hf=(--hf-json "$out/hf.json")
  elif [[ -f .dev/hf.json ]]; then hf=(--hf-json .dev/hf.json); fi
  echo "===== bench model" >>"$log"
  timeout 420 .dev/mxrl bench model --device cuda "${hf[@]}" --expert-formats bf16,mxfp8,nvfp4 --json-out "$out/bench.json" >>"$log" 2>&1
  summary+=("bench_model rc=$?")
  sed -n '/^mxrl bench model:/,$p' "$log" | tail -22
fi
if [[ " $what " == *" gemm "* ]]; then
  echo "===== bench_gemm" >>"$log"
  timeout 300 .dev/bench_gemm >>"$log" 2>&1
  summary+=("bench_gemm rc=$?")
fi
if [[ " $what " == *" qgemm "* ]]; then
  echo "===== bench_qgemm" >>"$log"
  timeout 300 .dev/bench_qgemm >>"$log" 2>&1
  summary+=("bench_qgemm rc=$?")
  sed -n '/===== bench_qgemm/,$p' "$log" | tail -40
fi
if [[ " $what " == *" quant "* ]]; then
  echo "===== bench quantize" >>"$log"
  timeout 300 .dev/mxrl bench quantize >>"$log" 2>&1
  summary+=("bench_quantize rc=$?")
  sed -n '/===== bench quantize/,$p' "$log" | tail -14
fi
if [[ " $what " == *" attn "* ]]; then
  echo "===== bench_attn_ops" >>"$log"
  timeout 300 .dev/bench_attn_ops >>"$log" 2>&1
  summary+=("bench_attn_ops rc=$?")
  sed -n '/===== bench_attn_ops/,$p' "$log" | tail -20
fi
if [[ " $what " == *" headops "* ]]; then
  echo "===== bench_head_ops" >>"$log"
  timeout 300 .dev/bench_head_ops >>"$log" 2>&1
  summary+=("bench_head_ops rc=$?")
  sed -n '/===== bench_head_ops/,$p' "$log" | tail -30
fi
if [[ " $what " == *" clients "* ]]; then
  echo "===== clientcheck" >>"$log"
  timeout 420 python3 scripts/clientcheck_device.py --dir .clientcheck --wheels .whl --out "$out/clientcheck.json" >>"$log" 2>&1
  summary+=("clientcheck rc=$?")
fi
echo "=== failures"
grep -E '^test .* FAILED|panicked at|^thread .* panicked' "$log" | head -20
echo "=== summary"
printf '%s\n' "${summary[@]}"
