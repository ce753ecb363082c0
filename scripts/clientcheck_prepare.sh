#!/usr/bin/env bash
# Writes the inputs of the real-client check (scripts/clientcheck_device.py) into one folder
# (default .clientcheck/, git-ignored), for a machine with python3 + torch + transformers and no
# Rust toolchain:
#   src/                      a tiny synthetic Qwen3-MoE (mxrl synth) in BF16
#   src-dense/                the same with every layer dense (mlp_only_layers: no experts,
#                             every linear an nn.Linear in transformers)
#   ckpt/NAME/                `mxrl convert` of src for every preset and format (and two
#                             recipes of scripts/clientcheck/: fp8-block, attn-nvfp4)
#   logits/NAME.safetensors   `mxrl forward --out` of each (src: f32 linears; converted: the
#                             stored quantized weights under the recorded recipe)
#   cases.json                the list of cases and the token ids
# Usage: scripts/clientcheck_prepare.sh [MXRL_BINARY] [OUT_DIR]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
mxrl=${1:-$root/target/release/mxrl}
out=${2:-$root/.clientcheck}
if [ ! -x "$mxrl" ]; then
  (cd "$root" && cargo build --release -p mxrl-cli)
  mxrl=$root/target/release/mxrl
fi
tokens=1,5,9,17,33,65,2,7,11,40,80,95
rm -rf "$out.partial"
mkdir -p "$out.partial/ckpt" "$out.partial/logits"
w=$out.partial
"$mxrl" synth --arch qwen3-moe --layers 3 --out "$w/src" >/dev/null
"$mxrl" synth --arch qwen3-moe --layers 3 --dense-layers 3 --out "$w/src-dense" >/dev/null
for s in src src-dense; do
  "$mxrl" forward --model "$w/$s" --tokens $tokens --out "$w/logits/$s.safetensors" >/dev/null
done
cases=()
add() { # NAME RECIPE FORMAT [SOURCE]
  local name=$1 recipe=$2 fmt=$3 src=${4:-src}
  "$mxrl" convert --model "$w/$src" --recipe "$recipe" --format "$fmt" --out "$w/ckpt/$name" >/dev/null
  "$mxrl" forward --model "$w/ckpt/$name" --tokens $tokens --out "$w/logits/$name.safetensors" >/dev/null
  cases+=("{\"name\": \"$name\", \"src\": \"$src\", \"recipe\": \"$(basename "$recipe")\", \"format\": \"$fmt\"}")
}
for preset in bf16 mxfp8 mxfp8-hp mxfp8-dq; do
  add "$preset" "$preset" modelopt
done
for preset in nvfp4-hp nvfp4-dq; do
  add "$preset-modelopt" "$preset" modelopt
  add "$preset-ct" "$preset" compressed-tensors
done
add fp8-block "$root/scripts/clientcheck/fp8-block.toml" modelopt
add attn-nvfp4-modelopt "$root/scripts/clientcheck/attn-nvfp4.toml" modelopt
add attn-nvfp4-ct "$root/scripts/clientcheck/attn-nvfp4.toml" compressed-tensors
add dense-nvfp4-ct "$root/scripts/clientcheck/dense-nvfp4.toml" compressed-tensors src-dense
add dense-nvfp4-modelopt "$root/scripts/clientcheck/dense-nvfp4.toml" modelopt src-dense
add dense-mxfp8 mxfp8 modelopt src-dense
{
  echo "{\"tokens\": [$tokens], \"mxrl\": \"$("$mxrl" --version)\", \"cases\": ["
  (IFS=,; echo "${cases[*]}")
  echo "]}"
} >"$w/cases.json"
rm -rf "$out"
mv "$w" "$out"
echo "wrote $out ($(du -sh "$out" | cut -f1), ${#cases[@]} converted checkpoints)"
