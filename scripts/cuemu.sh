#!/usr/bin/env bash
# Runs the low-byte GEMM kernels (ops_qgemm) on the host under cuemu (scripts/cuemu/): every
# fragment / staged kernel on ragged expert groups against a host reference, and bit for bit
# against the same kernels of BASE (a git revision; default: none) where both have them. No
# GPU and no CUDA toolkit needed (g++ and python3); this checks indexing, barriers, staging and
# the kernels' own sums, not speed and not the hardware's tensor-core summation (cuemu.h).
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
rm -rf "$out" && mkdir -p "$out/v1" "$out/v0"
cargo build --release -q -p mxrl-cuda --features cuda --example nvrtc_check
target/release/examples/nvrtc_check --sources "$out/v1/src" >/dev/null
emu=scripts/cuemu
cxx=(g++ -std=c++17 -O2 -g -ffp-contract=off -fno-strict-aliasing -fno-pie -no-pie -Wno-unknown-pragmas -I"$emu" -I"$out")
python3 "$emu/rewrite.py" "$out/v1/src/ops_qgemm.cu" v1 "$out/v1/ops_qgemm.cpp"
cp "$out/v1/src/prelude.cuh" "$out/prelude.h"
objs=("$out/v1/ops_qgemm.o")
"${cxx[@]}" -c "$out/v1/ops_qgemm.cpp" -o "$out/v1/ops_qgemm.o" &
if [[ -n $base ]]; then
  # The base revision's module: this prelude (generated from the contract) + its common.cuh,
  # quant.cu and ops_qgemm.cu, as crates/mxrl-cuda/src/ops/mod.rs assembles QGEMM_SOURCE.
  mkdir -p "$out/v0/src"
  k=crates/mxrl-cuda/kernels
  { cat "$out/v1/src/prelude.cuh"; echo; git show "$base:$k/common.cuh"; echo; git show "$base:$k/quant.cu"
    echo; git show "$base:$k/ops_qgemm.cu"; } >"$out/v0/src/ops_qgemm.cu"
  python3 "$emu/rewrite.py" "$out/v0/src/ops_qgemm.cu" v0 "$out/v0/ops_qgemm.cpp"
  "${cxx[@]}" -c "$out/v0/ops_qgemm.cpp" -o "$out/v0/ops_qgemm.o" &
  objs+=("$out/v0/ops_qgemm.o")
fi
"${cxx[@]}" -c "$emu/runtime.cpp" -o "$out/runtime.o"
wait
# Each version's kernels (its namespace's defined functions), for the signature check.
for v in v0 v1; do
  if [[ -f $out/$v/ops_qgemm.o ]]; then
    nm -C --defined-only "$out/$v/ops_qgemm.o" | awk '$2=="T"{print $3}' |
      sed -n "s/^$v::\([A-Za-z0-9_]*\)(.*/\"\1\",/p" | sort -u >"$out/names_$v.inc"
  else
    : >"$out/names_$v.inc"
  fi
done
"${cxx[@]}" -c "$emu/qgemm_check.cpp" -o "$out/qgemm_check.o"
"${cxx[@]}" "${objs[@]}" "$out/runtime.o" "$out/qgemm_check.o" -o "$out/qgemm_check"
"$out/qgemm_check" "${args[@]}"
