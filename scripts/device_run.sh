#!/usr/bin/env bash
# Runs on the GPU machine (built by scripts/device_build.sh): every CUDA test binary, then the
# transformers baseline, `mxrl bench model` and the GEMM benchmark in the same call. All logs
# go to $OUT/device.log (one file: the device tool returns few files); JSON results beside it.
# Usage: scripts/device_run.sh [tests] [hf] [bench] [trainq] [gemm] [qgemm] [quant] [attn] [headops] [rl] [rlq] [clients] [staged] [fixed] [pdl] [ablation]
#   (default: tests hf bench). The steps run in the order named (`hf` before `bench` for its
#   ratios), so the one that matters most can go first.
#   staged (after `scripts/device_build.sh staged`): the low-byte expert and linear kernels in
#   one call — the device tests that build kept (ops_qgemm, ops_fp8block, ops_qlinear,
#   ops_elementwise, engine_gpu, rl_engine_gpu, ops_attention, ops_fused, ops_moe, devices;
#   a test is left out by leaving its binary out of what is carried), `bench_qgemm --large` and
#   `bench_fp8block --staged` at a rollout's batch with busy routing, and `mxrl bench model`
#   at real width with every block-format decode recipe.
#   fixed: decode of every block-format recipe on the fixed 2.63 B config (batch 1/32/128).
#   pdl: BF16 decode on the fixed config under each MXRL_GRAPH_PDL mode (off, ops, all).
#   ablation: the real-width ablation (see its step below; ABLATION_OUT, ABLATION_LIMIT and
#   scripts/ablation-gpu-real.sh's own variables).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/mxrl-device}
mkdir -p "$out"
log=$out/device.log
what=${*:-tests hf bench}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$log"
summary=()
# TESTS (default all): the test binaries to run, by name (engine_gpu ops_fused ...).
# DEVICE_DEADLINE (seconds from now, default none): every step's timeout is cut to what is left
# of it, so that one call's steps finish (and their logs come back) inside the call's limit.
t0=$(date +%s)
lim() {
  local want=$1
  [[ -z ${DEVICE_DEADLINE:-} ]] && { echo "$want"; return; }
  local left=$(( DEVICE_DEADLINE - ($(date +%s) - t0) - 5 ))
  (( left < 1 )) && left=1
  (( left < want )) && echo "$left" || echo "$want"
}
# Every test binary in .dev/tests, one after another, each line of the summary its result.
run_tests() {
  # The CLI's GPU tests run the binary built beside them, not the path baked in at build time.
  export MXRL_BIN=$PWD/.dev/mxrl
  for t in .dev/tests/*; do
    name=$(basename "$t")
    # TESTS="a b": only the binaries whose names end in -a or -b.
    if [[ -n ${TESTS:-} ]] && ! printf '%s\n' $TESTS | grep -qx "${name##*-}"; then continue; fi
    start=$(date +%s)
    echo "===== $name" >>"$log"
    timeout "$(lim "${TEST_TIMEOUT:-240}")" "$t" --test-threads=1 --nocapture >>"$log" 2>&1
    rc=$?
    res=$(sed -n "/===== $name/,\$p" "$log" | grep -E '^test result' | tail -1)
    summary+=("$name rc=$rc $(( $(date +%s) - start ))s ${res:-no result}")
  done
}
step_tests() {
  run_tests
}
step_hf() {
  echo "===== bench_hf" >>"$log"
  timeout "$(lim 420)" python3 scripts/bench_hf.py --json-out "$out/hf.json" >>"$log" 2>&1
  summary+=("bench_hf rc=$?")
}
step_bench() {
  hf=()
  if [[ -f $out/hf.json ]]; then hf=(--hf-json "$out/hf.json")
  elif [[ -f .dev/hf.json ]]; then hf=(--hf-json .dev/hf.json); fi
  echo "===== bench model" >>"$log"
  timeout "$(lim 420)" .dev/mxrl bench model --device cuda "${hf[@]}" --expert-formats bf16,mxfp8,nvfp4 --json-out "$out/bench.json" >>"$log" 2>&1
  summary+=("bench_model rc=$?")
  sed -n '/^mxrl bench model:/,$p' "$log" | tail -22
}
step_trainq() {
  # The training step under every preset (block formats on their stored bytes, each plan's
  # backward mode) and prefill/decode with the routed experts in each block format.
  echo "===== bench model trainq" >>"$log"
  timeout "$(lim 540)" .dev/mxrl bench model --device cuda --train-recipes \
    bf16,mxfp8,mxfp8-hp,mxfp8-dq,nvfp4-hp,nvfp4-dq,fp8-block --train-steps 3 --batches 1,32 \
    --expert-formats bf16,mxfp8,nvfp4,fp8-block --json-out "$out/bench-trainq.json" >>"$log" 2>&1
  summary+=("bench_trainq rc=$?")
  sed -n '/===== bench model trainq/,$p' "$log" | sed -n '/^mxrl bench model:/,$p' | tail -30
}
step_gemm() {
  echo "===== bench_gemm" >>"$log"
  timeout "$(lim 300)" .dev/bench_gemm >>"$log" 2>&1
  summary+=("bench_gemm rc=$?")
}
step_qgemm() {
  echo "===== bench_qgemm" >>"$log"
  timeout "$(lim 300)" .dev/bench_qgemm >>"$log" 2>&1
  summary+=("bench_qgemm rc=$?")
  sed -n '/===== bench_qgemm/,$p' "$log" | tail -40
}
step_quant() {
  echo "===== bench quantize" >>"$log"
  timeout "$(lim 300)" .dev/mxrl bench quantize >>"$log" 2>&1
  summary+=("bench_quantize rc=$?")
  sed -n '/===== bench quantize/,$p' "$log" | tail -14
}
step_attn() {
  echo "===== bench_attn_ops" >>"$log"
  timeout "$(lim 300)" .dev/bench_attn_ops >>"$log" 2>&1
  summary+=("bench_attn_ops rc=$?")
  sed -n '/===== bench_attn_ops/,$p' "$log" | tail -20
}
step_headops() {
  echo "===== bench_head_ops" >>"$log"
  timeout "$(lim 300)" .dev/bench_head_ops >>"$log" 2>&1
  summary+=("bench_head_ops rc=$?")
  sed -n '/===== bench_head_ops/,$p' "$log" | tail -30
}
step_rl() {
  # The RL commands on the device engine: the large demo (BF16 recipe), then `rl` on its
  # warmed-up model on the GPU and on the host's CPU; per-step times from metrics.jsonl.
  echo "===== rl" >>"$log"
  d=/tmp/mxrl-rl
  rm -rf "$d" && mkdir -p "$d"
  s0=$(date +%s)
  timeout "$(lim 300)" .dev/mxrl demo --device cuda --size large --recipes bf16 --steps 20 --out "$d/demo" >>"$log" 2>&1
  summary+=("demo_large_cuda rc=$? $(( $(date +%s) - s0 ))s")
  # cuda-spawn: trainer here, rollout in a `rollout-server --device cuda` child, bitwise mode.
  for dev in cuda cuda-spawn cpu; do
    steps=10; extra=(); [[ $dev == cpu ]] && steps=3
    [[ $dev == cuda-spawn ]] && extra=(--rollout spawn --bitwise)
    s0=$(date +%s)
    timeout "$(lim 240)" .dev/mxrl rl --model "$d/demo/base" --recipe bf16 --device "${dev%-spawn}" --steps $steps \
      --prompts-per-step 64 --samples 8 --max-new-tokens 8 --micro-batch 64 "${extra[@]}" --out "$d/rl-$dev" >>"$log" 2>&1
    summary+=("rl_$dev rc=$? $(( $(date +%s) - s0 ))s")
    cp "$d/rl-$dev/metrics.jsonl" "$out/rl-$dev.jsonl" 2>/dev/null
    python3 - "$d/rl-$dev/metrics.jsonl" "$dev" <<'PY' | tee -a "$log"
import json, sys, statistics as st
m = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
k = m[1:] or m
med = lambda f: st.median(x[f] for x in k)
print(f"rl {sys.argv[2]}: {len(m)} steps, median rollout {med('rollout_s')*1e3:.1f} ms "
      f"({med('tokens_per_s'):.0f} tok/s), train {med('train_s')*1e3:.1f} ms, sync {med('sync_s')*1e3:.1f} ms, "
      f"reward {m[0]['reward_mean']:.3f} -> {m[-1]['reward_mean']:.3f}, "
      f"max |dlogp| {max(x['train_rollout_logprob_abs_diff'] for x in m):.3g}")
PY
  done
}
step_rlq() {
  # Every recipe on the device engine (block formats multiply their stored bytes), `rl` on the
  # large demo's warmed-up model (made here when the `rl` step did not run), per-step medians.
  echo "===== rlq" >>"$log"
  d=/tmp/mxrl-rl
  if [[ ! -d $d/demo/base ]]; then
    rm -rf "$d" && mkdir -p "$d"
    timeout "$(lim 300)" .dev/mxrl demo --device cuda --size large --recipes bf16 --steps 2 --out "$d/demo" >>"$log" 2>&1
  fi
  for r in bf16 mxfp8 mxfp8-hp mxfp8-dq nvfp4-hp nvfp4-dq fp8-block; do
    s0=$(date +%s)
    timeout "$(lim 240)" .dev/mxrl rl --model "$d/demo/base" --recipe $r --device cuda --steps 8 \
      --prompts-per-step 64 --samples 8 --max-new-tokens 8 --micro-batch 64 --out "$d/rlq-$r" >>"$log" 2>&1
    summary+=("rlq_$r rc=$? $(( $(date +%s) - s0 ))s")
    cp "$d/rlq-$r/metrics.jsonl" "$out/rlq-$r.jsonl" 2>/dev/null
    python3 - "$d/rlq-$r/metrics.jsonl" "$r" <<'PY' | tee -a "$log"
import json, sys, statistics as st
m = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
k = m[1:] or m
med = lambda f: st.median(x[f] for x in k)
print(f"rlq {sys.argv[2]}: {len(m)} steps, median rollout {med('rollout_s')*1e3:.1f} ms "
      f"({med('tokens_per_s'):.0f} tok/s), train {med('train_s')*1e3:.1f} ms, sync {med('sync_s')*1e3:.1f} ms "
      f"({k[0]['sync_bytes']} B), reward {m[0]['reward_mean']:.3f} -> {m[-1]['reward_mean']:.3f}, "
      f"max |dlogp| {max(x['train_rollout_logprob_abs_diff'] for x in m):.3g}")
PY
  done
}
step_staged() {
  # The test binaries device_build.sh staged kept (the list lives there).
  [[ " $what " == *" tests "* ]] || run_tests
  echo "===== bench_qgemm --large" >>"$log"
  timeout "$(lim "${MICRO_TIMEOUT:-240}")" .dev/bench_qgemm --large --batches 512 --busy >>"$log" 2>&1
  summary+=("bench_qgemm_large rc=$?")
  echo "===== bench_fp8block --staged" >>"$log"
  timeout "$(lim "${MICRO_TIMEOUT:-180}")" .dev/bench_fp8block --staged --reps 10 --batches 512 --busy >>"$log" 2>&1
  summary+=("bench_fp8block_staged rc=$?")
  echo "===== bench model decode recipes" >>"$log"
  timeout "$(lim 300)" .dev/mxrl bench model --device cuda --layers 2 --experts 128 --q-heads 32 \
    --train-seqs 0 --vocab 512 --prompt 12 --batches 64,512 --generate-batches 512 \
    --generate-tokens 24 --decode-recipes mxfp8,nvfp4-hp,fp8-block \
    --json-out "$out/bench-staged.json" >>"$log" 2>&1
  summary+=("bench_model_decode rc=$?")
  sed -n '/===== bench model decode recipes/,$p' "$log" | sed -n '/^mxrl bench model:/,$p' | tail -30
}
step_fixed() {
  # Decode on the fixed 2.63 B benchmark config (BF16 and every block-format decode recipe,
  # batch 1 / 32 / 128, no training): the issue tables' decode columns.
  echo "===== bench model fixed decode" >>"$log"
  timeout "$(lim 300)" .dev/mxrl bench model --device cuda --train-seqs 0 --batches 1,32,128 \
    --decode-recipes mxfp8,nvfp4-hp,fp8-block --json-out "$out/bench-fixed.json" >>"$log" 2>&1
  summary+=("bench_model_fixed rc=$?")
  sed -n '/===== bench model fixed decode/,$p' "$log" | sed -n '/^mxrl bench model:/,$p' | tail -30
}
step_pdl() {
  # Decode on the fixed 2.63 B config with the decode graphs' kernel-to-kernel edges as
  # recorded, programmatic between op kernels, and programmatic from every kernel into an op
  # kernel (MXRL_GRAPH_PDL off / ops / all), one run each, in the same call.
  for mode in off ops all; do
    echo "===== bench model pdl $mode" >>"$log"
    MXRL_GRAPH_PDL=$mode timeout "$(lim 150)" .dev/mxrl bench model --device cuda --train-seqs 0 \
      --batches 1,8,32,128 --json-out "$out/bench-pdl-$mode.json" >>"$log" 2>&1
    summary+=("bench_model_pdl_$mode rc=$?")
    sed -n "/===== bench model pdl $mode/,\$p" "$log" | grep -E '^\| decode|programmatic' | sort -u | head -12
  done
}
step_ablation() {
  # The real-width ablation (scripts/ablation-gpu-real.sh with the environment's settings and
  # MXRL=.dev/mxrl), stopped after ABLATION_LIMIT seconds (default 540) so that what it wrote
  # still comes back: the report directory (runs' metrics, ablation.json, report, plots; no
  # checkpoints) packed into $OUT/ablation.tar.gz, the log beside it. ABLATION_OUT (default
  # runs/device-ablation) is emptied first.
  echo "===== ablation" >>"$log"
  abl_out=${ABLATION_OUT:-runs/device-ablation}
  rm -rf "$abl_out"
  s0=$(date +%s)
  OUT=$abl_out MXRL=.dev/mxrl timeout "$(lim "${ABLATION_LIMIT:-540}")" sh scripts/ablation-gpu-real.sh \
    >"$out/ablation.log" 2>&1
  summary+=("ablation rc=$? $(( $(date +%s) - s0 ))s")
  # Stopped before its end: a report of the runs that finished.
  [[ -f $abl_out/report.md ]] || timeout "$(lim 30)" .dev/mxrl report "$abl_out" >>"$out/ablation.log" 2>&1
  tar -czf "$out/ablation.tar.gz" --exclude='checkpoint*' "$abl_out" 2>>"$log"
  grep -E '^(run |[a-z0-9-]+: )|summary|reward' "$out/ablation.log" | tail -20
}
step_clients() {
  echo "===== clientcheck" >>"$log"
  timeout "$(lim 420)" python3 scripts/clientcheck_device.py --dir .clientcheck --wheels .whl --out "$out/clientcheck.json" >>"$log" 2>&1
  summary+=("clientcheck rc=$?")
}
# The steps run in the order they are named.
for w in $what; do
  if declare -F "step_$w" >/dev/null; then
    "step_$w"
  else
    echo "unknown step '$w'" | tee -a "$log" >&2
    summary+=("$w: unknown step")
  fi
done
echo "=== failures"
grep -E '^test .* FAILED|panicked at|^thread .* panicked' "$log" | head -20
echo "=== summary"
printf '%s\n' "${summary[@]}"
