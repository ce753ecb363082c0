#!/usr/bin/env bash
# Runs the low-byte GEMM kernels (ops_qgemm) on the host under cuemu (scripts/cuemu/): every
# fragment / staged kernel on ragged expert groups against a host reference, and bit for bit
# against the same kernels of BASE (a git revision) where both have them. No GPU and no CUDA
# toolkit needed (g++, nm and python3); this checks indexing, barriers, staging and the
# kernels' own sums, not speed and not the hardware's tensor-core summation (cuemu.h).
# `cargo test -p mxrl-cuda --test cuemu` runs the same checker without a base.
#
# Usage: scripts/cuemu.sh [--base REV] [--quick]
set -euo pipefail
cd "$(dirname "$0")/.."
base=""
args=()
while [[ $# -gt 0 ]]; do
  case $1 in
    --base) base=$2; shift 2 ;;
    *) args+=("$1"); shift ;;
  esac
done
out=target/cuemu
mkdir -p "$out/src"
cargo build --release -q -p mxrl-cuda --features cuda --example nvrtc_check
target/release/examples/nvrtc_check --sources "$out/src" >/dev/null
v0=()
if [[ -n $base ]]; then
  # The base revision's module: this prelude (generated from the contract) + its common.cuh,
  # quant.cu and ops_qgemm.cu, as crates/mxrl-cuda/src/ops/mod.rs assembles QGEMM_SOURCE.
  k=crates/mxrl-cuda/kernels
  { cat "$out/src/prelude.cuh"; echo; git show "$base:$k/common.cuh"; echo; git show "$base:$k/quant.cu"
    echo; git show "$base:$k/ops_qgemm.cu"; } >"$out/src/base_ops_qgemm.cu"
  v0=("$out/src/base_ops_qgemm.cu")
fi
scripts/cuemu/check.sh "$out/build" "$out/src/ops_qgemm.cu" "${v0[@]}" -- "${args[@]}"
