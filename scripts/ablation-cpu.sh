#!/usr/bin/env sh
# Regenerate docs/ablation-cpu: the demo's SFT warm-up (50 steps, seed 7), then the six-recipe
# CPU ablation with three BF16 seeds (1, 2, 3), 80 GRPO steps each, weight sync checked byte
# for byte after every update. Usage: scripts/ablation-cpu.sh [STEPS] (from the repository root).
set -eu
STEPS="${1:-80}"
cargo build --release -p mxrl-cli
MXRL=target/release/mxrl
BASE=runs/ablation-cpu-base
"$MXRL" sft --out "$BASE" --steps 50 --force
"$MXRL" ablate --model "$BASE" --steps "$STEPS" --noise-seeds 2,3 --check-weight-sync \
    --out docs/ablation-cpu --restart
