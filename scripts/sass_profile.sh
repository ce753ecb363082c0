#!/usr/bin/env bash
# Static profile of the engine's CUDA kernels on a machine without a GPU: NVRTC compiles every
# op module as the engine does (crates/mxrl-cuda/examples/nvrtc_check.rs), ptxas assembles the
# PTX for sm_90 and reports registers, shared memory and spills, and scripts/sass_loops.py
# counts the SASS instructions of each kernel's tensor-core loops (a staged kernel's loop is
# one super-step of a pass). A kernel that issues fewer instructions per super-step at the same
# occupancy is the one to time on the GPU; this does not replace timing it.
#
# Usage: scripts/sass_profile.sh [REGEX] [OUT]
#   REGEX: kernels to profile (default: the staged fragment kernels, 'qgemm_fragsm_');
#   OUT:   where the PTX, cubin and ptxas log go (default: target/sass).
# The CUDA tools come from CUDA_TOOLS (a toolkit directory with bin/ptxas, bin/cuobjdump,
# bin/nvdisasm and lib*/libnvrtc*), or else from NVIDIA's wheels, installed once into a
# virtual environment under target/cudatools (needs python3 and the package index).
set -euo pipefail
cd "$(dirname "$0")/.."
regex=${1:-qgemm_fragsm_}
out=${2:-target/sass}
if [[ -z ${CUDA_TOOLS:-} ]]; then
  venv=target/cudatools
  if [[ ! -x $venv/bin/python3 ]]; then
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet nvidia-cuda-nvrtc nvidia-cuda-nvcc nvidia-cuda-cuobjdump \
      nvidia-cuda-nvdisasm
  fi
  CUDA_TOOLS=$(dirname "$(dirname "$(find "$venv" -path '*/bin/ptxas' -print -quit)")")
fi
export PATH=$CUDA_TOOLS/bin:$PATH
libdir=$(dirname "$(find -L "$CUDA_TOOLS" -name 'libnvrtc.so*' -print -quit)")
cargo build --release -p mxrl-cuda --features cuda --example nvrtc_check
rm -rf "$out" && mkdir -p "$out"
LD_LIBRARY_PATH=$libdir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} \
  target/release/examples/nvrtc_check --out "$out" | tail -1
for ptx in "$out"/*.ptx; do
  m=$(basename "$ptx" .ptx)
  ptxas -arch=sm_90 -v "$ptx" -o "$out/$m.cubin" 2>"$out/$m.ptxas.log"
  python3 scripts/sass_loops.py "$out/$m.cubin" "$regex" "$out/$m.ptxas.log"
done
