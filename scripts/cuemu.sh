#!/usr/bin/env bash
# cuemu: the engine's CUDA kernels on the host, no GPU and no CUDA toolkit needed (g++, nm and
# python3; scripts/cuemu/). Checks indexing, barriers, staging and the kernels' own sums, not
# speed and not the hardware's tensor-core summation order (cuemu.h says what is modelled).
#
#   scripts/cuemu.sh [check] [--base REV] [--quick]
#       The decode GEMM kernels (ops_qgemm) on ragged expert groups against a host reference,
#       and bit for bit against the same kernels of REV where both have them.
#       (`cargo test -p mxrl-cuda --test cuemu` runs this without a base.)
#   scripts/cuemu.sh tests [TEST...]
#       The crate's device tests (crates/mxrl-cuda/tests/*.rs, `--features cuda`; all, or the
#       named ones) on a stand-in CUDA installation whose every kernel runs under cuemu
#       (libcuda, libnvrtc and libcublas from scripts/cuemu/fake.sh). Slow: minutes per binary.
#       CUEMU_TEST_THREADS=N runs N tests of a binary at a time (default 1).
#       CUEMU_FAULT=FILE.sed plants a fault: the sed script edits the copied kernel sources,
#       and the stand-in runs the edited kernels where the tests compile the real ones, so the
#       tests meant to catch the fault must fail (a script that changes nothing is refused).
#   CUEMU_TRACE_GRAPHS=1 (any program run on the stand-in, e.g.
#   `LD_LIBRARY_PATH=target/cuemu/fake/lib target/release/mxrl bench model --device cuda --small
#   --train-seqs 0 --batches 1 --steps 1 --reps 1`) lists every captured CUDA graph's nodes on
#   stderr: kernel names, cuBLAS calls and copies in launch order, with the node count.
set -euo pipefail
cd "$(dirname "$0")/.."
mode=check
if [[ $# -gt 0 && ($1 == check || $1 == tests) ]]; then
  mode=$1
  shift
fi
out=target/cuemu
rm -rf "$out/src" && mkdir -p "$out/src"
cargo build --release -q -p mxrl-cuda --features cuda --example nvrtc_check
target/release/examples/nvrtc_check --sources "$out/src" >/dev/null
if [[ $mode == tests ]]; then
  mkdir -p "$out/srcs"
  rm -f "$out"/srcs/*.cu && cp "$out"/src/*.cu "$out/srcs/"
  if [[ -n ${CUEMU_FAULT:-} ]]; then
    sed -i -f "$CUEMU_FAULT" "$out"/srcs/*.cu
    echo "cuemu: planted fault ($CUEMU_FAULT):"
    changed=0
    for f in "$out"/srcs/*.cu; do
      if ! cmp -s "$f" "$out/src/${f##*/}"; then
        changed=1
        diff "$out/src/${f##*/}" "$f" | sed "s|^|  ${f##*/}: |" || true
      fi
    done
    if ((changed == 0)); then
      echo "cuemu: $CUEMU_FAULT changed no kernel source" >&2
      exit 2
    fi
    scripts/cuemu/fake.sh "$out/srcs" "$out/fake" "$out/src"
  else
    scripts/cuemu/fake.sh "$out/srcs" "$out/fake"
  fi
  mapfile -t bins < <(cargo test --release -p mxrl-cuda --features cuda --no-run --message-format=json 2>/dev/null |
    python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("target", {}).get("kind") == ["test"] and m.get("executable"):
        print(m["target"]["name"] + " " + m["executable"])')
  failed=0
  for entry in "${bins[@]}"; do
    name=${entry%% *}
    exe=${entry#* }
    if [[ $# -gt 0 ]] && ! printf '%s\n' "$@" | grep -qx "$name"; then continue; fi
    [[ $name == cuemu ]] && continue
    start=$SECONDS
    # CUEMU_TEST_THREADS tests at a time (default 1: the log reads in order). Each test thread
    # has its own stream (Gpu::shared), so a decode graph being recorded cannot capture another
    # test's work.
    if LD_LIBRARY_PATH=$PWD/$out/fake/lib "$exe" --test-threads="${CUEMU_TEST_THREADS:-1}" >"$out/test_$name.log" 2>&1; then
      echo "ok    $name ($((SECONDS - start)) s): $(grep '^test result' "$out/test_$name.log" | tail -1)"
    else
      failed=$((failed + 1))
      echo "FAIL  $name ($((SECONDS - start)) s): see $out/test_$name.log"
      grep -E '^test .* FAILED|panicked at|cuemu:' "$out/test_$name.log" | head -5 | sed 's/^/      /'
    fi
  done
  exit $((failed > 0))
fi
base=""
args=()
while [[ $# -gt 0 ]]; do
  case $1 in
    --base) base=$2; shift 2 ;;
    *) args+=("$1"); shift ;;
  esac
done
v0=()
if [[ -n $base ]]; then
  # The base revision's module: this prelude (generated from the contract) + its common.cuh,
  # quant.cu and ops_qgemm.cu, as crates/mxrl-cuda/src/ops/mod.rs assembles QGEMM_SOURCE.
  k=crates/mxrl-cuda/kernels
  { cat "$out/src/prelude.cuh"; echo; git show "$base:$k/common.cuh"; echo; git show "$base:$k/quant.cu"
    echo; git show "$base:$k/ops_qgemm.cu"; } >"$out/base_ops_qgemm.cu"
  v0=("$out/base_ops_qgemm.cu")
fi
scripts/cuemu/check.sh "$out/build" "$out/src/ops_qgemm.cu" "${v0[@]}" -- "${args[@]}"
