#!/usr/bin/env sh
# Regenerate docs/ablation-gpu-45m on one CUDA GPU: the large demo model (~45 M-parameter Qwen3-MoE,
# SFT warm-up on the GPU), then the six recipes and BF16 with two more seeds, STEPS GRPO steps each
# (64 prompts × 8 samples, responses up to 64 tokens), every run on the device engine.
# Usage: scripts/ablation-gpu.sh [STEPS] (from the repository root; MXRL=path/to/mxrl uses a
# binary built elsewhere with `--features cuda` instead of building one here).
set -eu
STEPS="${1:-100}"
if [ -z "${MXRL:-}" ]; then
  cargo build --release -p mxrl-cli --features cuda
  MXRL=target/release/mxrl
fi
BASE=runs/ablation-gpu-base
"$MXRL" demo --device cuda --size large --recipes bf16 --steps 1 --out "$BASE"
"$MXRL" ablate --model "$BASE/base" --device cuda --steps "$STEPS" --prompts-per-step 64 \
    --samples 8 --max-new-tokens 64 --micro-batch 64 --lr 3e-4 --noise-seeds 2,3 \
    --out docs/ablation-gpu-45m --restart
