#!/usr/bin/env bash
# Builds cuemu's stand-in CUDA installation (fakecuda.cpp + every op module's kernels) into
# OUT/lib: libcuda.so, libnvrtc.so and libcublas.so, one library. With OUT/lib first on
# LD_LIBRARY_PATH, a `--features cuda` binary or test of this tree runs its kernels on the host.
# SRC: the module sources (`nvrtc_check --sources SRC`). Needs g++, nm and python3.
# ACCEPT (default SRC): the sources the stand-in NVRTC accepts, by content. Built from a copy of
# the sources with a planted fault and ACCEPT = the unmodified ones, the stand-in runs the
# faulted kernels for programs that compile the real sources (scripts/cuemu.sh: CUEMU_FAULT).
#
# Usage: scripts/cuemu/fake.sh SRC OUT [ACCEPT]
set -euo pipefail
emu=$(cd "$(dirname "$0")" && pwd)
src=$1
out=$2
accept=${3:-$1}
mkdir -p "$out/obj" "$out/lib"
cxx=(g++ -std=c++17 -O2 -fPIC -ffp-contract=off -fno-strict-aliasing -Wno-unknown-pragmas -I"$emu" -I"$out")
pairs=()
jobs=0
for cu in "$src"/*.cu; do
  m=$(basename "$cu" .cu)
  python3 "$emu/rewrite.py" "$cu" "$m" "$out/obj/$m.cpp"
  "${cxx[@]}" -c "$out/obj/$m.cpp" -o "$out/obj/$m.o" &
  [[ -f $accept/$m.cu ]] || { echo "fake.sh: $accept/$m.cu missing" >&2; exit 2; }
  pairs+=("$accept/$m.cu:$out/obj/$m.o")
  jobs=$((jobs + 1))
  if ((jobs % 2 == 0)); then wait; fi
done
wait
python3 "$emu/gen_kernels.py" "$out/fake_kernels.inc" "${pairs[@]}"
"${cxx[@]}" -c "$emu/runtime.cpp" -o "$out/obj/runtime.o"
"${cxx[@]}" -c "$emu/fakecuda.cpp" -o "$out/obj/fakecuda.o"
# A new file (not rewritten in place: a running test may have the old one mapped).
"${cxx[@]}" -shared -o "$out/lib/libcuemu.so.tmp" "$out"/obj/*.o
mv -f "$out/lib/libcuemu.so.tmp" "$out/lib/libcuemu.so"
for l in libcuda.so libnvrtc.so libcublas.so; do ln -sf libcuemu.so "$out/lib/$l"; done
echo "cuemu CUDA stand-in: $out/lib"
