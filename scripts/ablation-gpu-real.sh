#!/usr/bin/env sh
# The GPU ablation (scripts/ablation-gpu.sh) at a real model's width, on one CUDA GPU: LAYERS
# decoder layers of Qwen3-30B-A3B's shape (hidden 2048, 32 q / 4 kv heads of 128, 128 experts
# top-8 with F = 768; 4 layers ≈ 2.5 B parameters), the chain task with a byte-level BPE
# tokenizer trained on its text (BASE/tokenizer, BASE/base/tokenizer.json), an SFT warm-up on
# the GPU that stops once sampled answers reach a mean reward of SFT_REWARD (at most SFT_STEPS
# steps), then every recipe of RECIPES (the six presets and fp8-block) plus BF16 with the
# NOISE_SEEDS (one more seed), STEPS GRPO steps each (PROMPTS prompts × SAMPLES samples,
# responses up to MAX_NEW_TOKENS tokens), every run on the device engine; report in OUT.
#
# WORKED=1 (the default) runs the chain task with worked responses (`--worked`): the model
# writes every step before the answer (`17+5*3-8=` → `5*3=15, 17+15=32, 32-8=24. #24`), ≈ 20
# tokens at OPS=3 with the trained tokenizer and about 6 more per operation, so a rollout's
# time is spent decoding and the report's tokens/s compares the recipes' decode speed; the reward is
# the final answer after `#` on a well-formed working (1/0). Raise OPS for longer responses
# (the longest possible one must fit in MAX_NEW_TOKENS or it is warned about). WORKED=0: the
# answer alone (about 2 tokens: prefill and fixed costs dominate). The warm-up in BASE is
# reused only for the same task, so switching WORKED needs another BASE (the default BASE
# names it).
#
# Usage (from the repository root; MXRL=path/to/mxrl uses a binary built elsewhere with
# `--features cuda` instead of building one here):
#   scripts/ablation-gpu-real.sh                  # 100 steps, 64 × 8, up to 256 tokens, 4 layers
#   STEPS=3 PROMPTS=8 MAX_NEW_TOKENS=32 LAYERS=1 SFT_STEPS=40 RECIPES=bf16,mxfp8,nvfp4-hp \
#     NOISE_SEEDS=none OUT=runs/ablation-gpu-real-reduced scripts/ablation-gpu-real.sh
#                                                 # reduced: a few minutes on one H200
# Memory: the trainer holds f32 masters, gradients and AdamW moments and the BF16 weights (18
# bytes per parameter), the rollout and the frozen reference the BF16 weights only (2 bytes
# each; block formats fewer): 22 bytes per parameter. Measured on an H100 80GB (64 × 8
# samples, MICRO_BATCH=16, responses up to 64 tokens): 4 layers peak at 59.1 GiB, 5 layers at
# 73.6 GiB of its 79.6 (the most it holds; a larger MICRO_BATCH needs more); one H200 has room for about 8
# layers (computed). The warm-up (`mxrl demo --size real`) asks the GPU first: a depth whose
# weights and optimizer state cannot fit is refused before any work, one that may not fit is
# warned about, each with the depth that should. Disk: a run's
# checkpoint holds masters and moments (12 bytes per parameter, ~30 GB at 4 layers), so by
# default none is written (CHECKPOINT_EVERY=0: runs cannot be resumed); CHECKPOINT_EVERY=N
# writes one every N steps and at the end (~30 GB per run on the output's disk).
#
# AUX_LOSS_COEF=0.001 adds the MoE auxiliary load-balancing loss to the warm-up and every run
# (default 0: none; the router then learns from the task's loss alone).
#
# In parts: ONLY=bf16,nvfp4-hp runs only those runs (names as in the report: a recipe, or
# bf16-seedS) into OUT and leaves the others; a later call with other names (or none: all)
# adds them. Finished runs are kept, checkpoint or not, so an ablation too long for one
# sitting can be run in several, each reusing the warm-up in BASE or redoing it: every run
# records the base model's digest and the card, and a part on another base or another kind
# of card is refused. RESTART=1 discards the runs already in OUT instead.
set -eu
STEPS="${STEPS:-100}"
PROMPTS="${PROMPTS:-64}"
SAMPLES="${SAMPLES:-8}"
MAX_NEW_TOKENS="${MAX_NEW_TOKENS:-256}"
LAYERS="${LAYERS:-4}"
MICRO_BATCH="${MICRO_BATCH:-64}"
LR="${LR:-1e-4}"
SFT_STEPS="${SFT_STEPS:-400}"
SFT_REWARD="${SFT_REWARD:-0.2}"
CHECKPOINT_EVERY="${CHECKPOINT_EVERY:-0}"
ONLY="${ONLY:-}"
RESTART="${RESTART:-0}"
case "$RESTART" in
  1) RESTART_FLAG="--restart" ;;
  0) RESTART_FLAG="" ;;
  *) echo "RESTART must be 1 or 0, not '$RESTART'" >&2; exit 2 ;;
esac
# The recipes compared: the six presets and fp8-block (every linear dimension of this shape is
# a multiple of its 128-wide blocks).
RECIPES="${RECIPES:-bf16,mxfp8,mxfp8-hp,mxfp8-dq,nvfp4-hp,nvfp4-dq,fp8-block}"
# The chain task's operations per problem and digits per operand (the task's defaults: 3, 1).
OPS="${OPS:-3}"
DIGITS="${DIGITS:-1}"
# Worked responses (1) or the answer alone (0).
WORKED="${WORKED:-1}"
case "$WORKED" in
  1) WORKED_FLAG="--worked"; WORKED_TAG="-worked" ;;
  0) WORKED_FLAG=""; WORKED_TAG="" ;;
  *) echo "WORKED must be 1 or 0, not '$WORKED'" >&2; exit 2 ;;
esac
# Seeds of the extra BF16 runs (run-to-run noise); `none` for no extra run.
NOISE_SEEDS="${NOISE_SEEDS:-2}"
# The MoE auxiliary load-balancing loss's coefficient in the warm-up and every run (0: none;
# 0.001 is Qwen3-MoE's); a warm-up is reused only with its own coefficient.
AUX_LOSS_COEF="${AUX_LOSS_COEF:-0}"
case "$AUX_LOSS_COEF" in
  0|0.0) AUX_TAG="" ;;
  *) AUX_TAG="-aux$AUX_LOSS_COEF" ;;
esac
BASE="${BASE:-runs/ablation-gpu-real-base-L$LAYERS$WORKED_TAG$AUX_TAG}"
OUT="${OUT:-docs/ablation-gpu}"
if [ -z "${MXRL:-}" ]; then
  cargo build --release -p mxrl-cli --features cuda
  MXRL=target/release/mxrl
fi
# Tokenizer and warm-up (reused when BASE already holds them for this task and tokenizer).
"$MXRL" demo --device cuda --size real --layers "$LAYERS" --task chain --ops "$OPS" --digits "$DIGITS" \
    $WORKED_FLAG --sft-steps "$SFT_STEPS" --sft-reward "$SFT_REWARD" --aux-loss-coef "$AUX_LOSS_COEF" \
    --warmup-only --out "$BASE"
"$MXRL" ablate --model "$BASE/base" --device cuda --task chain --ops "$OPS" --digits "$DIGITS" \
    $WORKED_FLAG --recipes "$RECIPES" \
    --noise-seeds "$NOISE_SEEDS" --steps "$STEPS" --prompts-per-step "$PROMPTS" \
    --samples "$SAMPLES" --max-new-tokens "$MAX_NEW_TOKENS" --micro-batch "$MICRO_BATCH" \
    --lr "$LR" --aux-loss-coef "$AUX_LOSS_COEF" --checkpoint-every "$CHECKPOINT_EVERY" --out "$OUT" $RESTART_FLAG \
    ${ONLY:+--only "$ONLY"}
