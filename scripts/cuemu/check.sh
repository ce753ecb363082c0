#!/usr/bin/env bash
# Builds and runs cuemu's kernel checker (qgemm_check.cpp) from full module sources (prelude +
# common.cuh + kernels, as NVRTC compiles them): V1 the version under test, V0 (optional) the
# base it must match bit for bit. Needs g++, nm and python3. Arguments after `--` go to the
# checker (`--quick`: two pass sizes instead of four).
#
# Usage: scripts/cuemu/check.sh OUT V1.cu [V0.cu] [-- ARGS...]
set -euo pipefail
emu=$(cd "$(dirname "$0")" && pwd)
out=$1
v1=$2
shift 2
v0=""
if [[ $# -gt 0 && $1 != "--" ]]; then
  v0=$1
  shift
fi
[[ $# -gt 0 && $1 == "--" ]] && shift
for tool in g++ nm python3; do
  command -v "$tool" >/dev/null || { echo "cuemu: needs $tool on the PATH" >&2; exit 2; }
done
rm -rf "$out" && mkdir -p "$out"
cxx=(g++ -std=c++17 -O2 -ffp-contract=off -fno-strict-aliasing -Wno-unknown-pragmas -I"$emu" -I"$out")
# The contract constants the host reference needs: the prelude's #define lines.
grep '^#define MXRL_' "$v1" >"$out/prelude.h"
pids=()
for v in v1 v0; do
  src=${!v}
  if [[ -z $src ]]; then
    : >"$out/names_$v.inc"
    continue
  fi
  python3 "$emu/rewrite.py" "$src" "$v" "$out/$v.cpp"
  "${cxx[@]}" -c "$out/$v.cpp" -o "$out/$v.o" &
  pids+=($!)
done
"${cxx[@]}" -c "$emu/runtime.cpp" -o "$out/runtime.o"
for p in "${pids[@]}"; do wait "$p"; done
objs=()
for v in v1 v0; do
  [[ -f $out/$v.o ]] || continue
  objs+=("$out/$v.o")
  # The version's kernels (its namespace's defined functions), for the signature check.
  nm -C --defined-only "$out/$v.o" | awk '$2=="T"{print $3}' |
    sed -n "s/^$v::\\([A-Za-z0-9_]*\\)(.*/\"\\1\",/p" | sort -u >"$out/names_$v.inc"
done
"${cxx[@]}" -c "$emu/qgemm_check.cpp" -o "$out/qgemm_check.o"
"${cxx[@]}" "${objs[@]}" "$out/runtime.o" "$out/qgemm_check.o" -o "$out/qgemm_check"
"$out/qgemm_check" "$@"
