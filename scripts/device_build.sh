#!/usr/bin/env bash
# Builds, on a machine without a GPU, everything a GPU run needs and puts it, stripped, under
# .dev/ (git-ignored): the mxrl binary with CUDA support, the GEMM benchmarks (mxrl-cuda's
# bench_gemm, bench_head_ops, bench_qgemm, bench_attn_ops and bench_fp8block examples), the
# CUDA test binaries of mxrl-cuda and mxrl-cli's GPU test. `scripts/device_run.sh` runs them on
# the GPU machine, which needs no Rust toolchain. The CUDA libraries are loaded at run time, so
# no CUDA is needed here.
#
# Usage: scripts/device_build.sh [staged]
#   staged: keep only what `scripts/device_run.sh staged` runs (the tree that travels is
#   capped at 64 MiB; everything is about 70).
set -euo pipefail
cd "$(dirname "$0")/.."
out=.dev
rm -rf "$out" && mkdir -p "$out/tests"
cargo build --release -p mxrl-cli --features cuda
cp target/release/mxrl "$out/mxrl"
cargo build --release -p mxrl-cuda --features cuda --example bench_gemm
cp target/release/examples/bench_gemm "$out/bench_gemm"
cargo build --release -p mxrl-cuda --features cuda --example bench_head_ops
cp target/release/examples/bench_head_ops "$out/bench_head_ops"
cargo build --release -p mxrl-cuda --features cuda --example bench_qgemm
cp target/release/examples/bench_qgemm "$out/bench_qgemm"
cargo build --release -p mxrl-cuda --features cuda --example bench_attn_ops
cp target/release/examples/bench_attn_ops "$out/bench_attn_ops"
cargo build --release -p mxrl-cuda --features cuda --example bench_fp8block
cp target/release/examples/bench_fp8block "$out/bench_fp8block"
for pkg in mxrl-cuda mxrl-cli; do
  # mxrl-cli: only its GPU test (the two-process rollout on the device); the others are CI's.
  sel=(); [[ $pkg == mxrl-cli ]] && sel=(--test rollout_gpu)
  cargo test --release -p "$pkg" --features cuda "${sel[@]}" --no-run --message-format=json 2>/dev/null \
    | python3 -c '
import json, sys, shutil, os
for line in sys.stdin:
    try: m = json.loads(line)
    except Exception: continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m.get("profile", {}).get("test"):
        name = m["target"]["name"]
        kind = m["target"]["kind"][0]
        dst = os.path.join(sys.argv[1], f"{sys.argv[2]}-{kind}-{name}")
        shutil.copy(m["executable"], dst)
        print(dst)
' "$out/tests" "$pkg"
done
strip "$out/mxrl" "$out/bench_gemm" "$out/bench_head_ops" "$out/bench_qgemm" "$out/bench_attn_ops" \
  "$out/bench_fp8block" "$out"/tests/*
if [[ ${1:-} == staged ]]; then
  rm -f "$out/bench_gemm" "$out/bench_head_ops" "$out/bench_attn_ops"
  for t in "$out"/tests/*; do
    case $(basename "$t") in
      *-ops_qgemm | *-ops_fp8block | *-ops_qlinear | *-ops_elementwise | *-engine_gpu | *-rl_engine_gpu \
        | *-ops_attention | *-ops_fused | *-ops_moe | *-devices) ;;
      *) rm -f "$t" ;;
    esac
  done
fi
du -sh "$out"
# The tree that travels to the GPU machine is capped at 64 MiB: past ~60 MiB, delete the test
# binaries and benchmarks the run does not need before carrying .dev.
if (( $(du -sm "$out" | cut -f1) > 60 )); then
  echo "note: $out is over 60 MiB; remove what this run does not use (e.g. $out/bench_* or tests) before carrying it" >&2
fi
