#!/usr/bin/env python3
"""Checks that real clients read mxrl's NVFP4 checkpoints as mxrl does.

- The compressed-tensors output is parsed with compressed-tensors' own QuantizationConfig and
  every weight is decompressed with its NVFP4PackedCompressor.
- The ModelOpt output is read with the safetensors library and dequantized the way ModelOpt
  consumers do: e2m1 value x e4m3 block scale x weight_scale_2, in float32, then BF16.

Both must equal, bit for bit, the BF16 tensors `mxrl dequantize` writes for the same checkpoint.

Usage (needs torch, safetensors, compressed-tensors):
  python3 scripts/check_client.py --mxrl target/release/mxrl --work /tmp/mxrl-client
      (writes a synthetic Qwen2-MoE checkpoint, converts it both ways, dequantizes both)
  python3 scripts/check_client.py --work DIR
      (uses DIR/modelopt, DIR/ct, DIR/deq-modelopt, DIR/deq-ct made earlier)
The last line is `N passed, M failed`; the exit status is non-zero on any failure.
"""
import argparse
import glob
import json
import os
import subprocess
import sys

import torch
from safetensors import safe_open

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float32)


def load_dir(d):
    out = {}
    for f in sorted(glob.glob(os.path.join(d, "*.safetensors"))):
        with safe_open(f, framework="pt") as fh:
            for k in fh.keys():
                out[k] = fh.get_tensor(k)
    return out


def unpack_e2m1(packed):
    """uint8 [N, K/2] -> float32 [N, K]; element 2i in the low nibble."""
    lo = (packed & 0x0F).to(torch.long)
    hi = (packed >> 4).to(torch.long)
    codes = torch.stack([lo, hi], dim=-1).reshape(packed.shape[0], -1)
    mag = E2M1[codes & 7]
    return torch.where((codes & 8) != 0, -mag, mag)


def same_bits(a, b):
    return a.dtype == b.dtype == torch.bfloat16 and a.shape == b.shape and torch.equal(
        a.view(torch.int16), b.view(torch.int16)
    )


def check_modelopt(conv_dir, deq_dir, results):
    conv, deq = load_dir(conv_dir), load_dir(deq_dir)
    cfg = json.load(open(os.path.join(conv_dir, "config.json")))["quantization_config"]
    hq = json.load(open(os.path.join(conv_dir, "hf_quant_config.json")))
    ok_cfg = (cfg["quant_method"] == "modelopt" and cfg["quant_algo"] == "NVFP4"
              and hq["quantization"]["quant_algo"] == "NVFP4"
              and hq["quantization"]["exclude_modules"] == cfg["ignore"])
    results.append(("modelopt config", ok_cfg, str(hq["quantization"]["exclude_modules"])))
    n = 0
    for k, s2 in conv.items():
        if not k.endswith(".weight_scale_2"):
            continue
        p = k[: -len(".weight_scale_2")]
        packed, sc = conv[p + ".weight"], conv[p + ".weight_scale"]
        assert packed.dtype == torch.uint8 and sc.dtype == torch.float8_e4m3fn, p
        vals = unpack_e2m1(packed)
        w = (vals * sc.to(torch.float32).repeat_interleave(16, dim=1)) * s2.to(torch.float32)
        ok = same_bits(w.to(torch.bfloat16), deq[p + ".weight"])
        results.append(("modelopt " + p, ok, "" if ok else "differs from mxrl dequantize"))
        n += 1
    results.append(("modelopt tensors found", n > 0, str(n)))


def check_compressed_tensors(conv_dir, deq_dir, results):
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationConfig

    conv, deq = load_dir(conv_dir), load_dir(deq_dir)
    raw = json.load(open(os.path.join(conv_dir, "config.json")))["quantization_config"]
    qc = QuantizationConfig.model_validate(raw)
    results.append(("compressed-tensors config", qc.format == "nvfp4-pack-quantized", qc.format))
    scheme = qc.config_groups["group_0"]
    n = 0
    for k in conv:
        if not k.endswith(".weight_packed"):
            continue
        p = k[: -len(".weight_packed")]
        sd = {s: conv[p + "." + s] for s in
              ("weight_packed", "weight_scale", "weight_global_scale", "input_global_scale")}
        w = NVFP4PackedCompressor.decompress(sd, scheme)["weight"]
        ok = same_bits(w, deq[p + ".weight"])
        results.append(("compressed-tensors " + p, ok,
                        "" if ok else f"differs from mxrl dequantize ({w.dtype})"))
        n += 1
    results.append(("compressed-tensors tensors found", n > 0, str(n)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mxrl", help="mxrl binary: build the inputs in --work first")
    ap.add_argument("--work", required=True)
    ap.add_argument("--report", help="write the results as JSON here")
    a = ap.parse_args()
    w = a.work
    if a.mxrl:
        run = lambda *args: subprocess.run([a.mxrl, *args], check=True)
        os.makedirs(w, exist_ok=True)
        src = os.path.join(w, "src")
        if not os.path.exists(src):
            run("synth", "--arch", "qwen2-moe", "--out", src)
        for fmt, name in (("modelopt", "modelopt"), ("compressed-tensors", "ct")):
            run("convert", "--model", src, "--recipe", "nvfp4-hp", "--out",
                os.path.join(w, name), "--format", fmt, "--force")
            run("dequantize", "--model", os.path.join(w, name), "--out",
                os.path.join(w, "deq-" + name), "--force")
    results = []
    check_modelopt(os.path.join(w, "modelopt"), os.path.join(w, "deq-modelopt"), results)
    try:
        check_compressed_tensors(os.path.join(w, "ct"), os.path.join(w, "deq-ct"), results)
    except ImportError as e:
        results.append(("compressed-tensors import", False, str(e)))
    failed = [r for r in results if not r[1]]
    for name, ok, detail in results:
        if not ok or name.endswith(("config", "found")):
            print(("ok   " if ok else "FAIL ") + name + ("  " + detail if detail else ""))
    versions = {"torch": torch.__version__}
    try:
        import compressed_tensors, safetensors
        versions["compressed_tensors"] = compressed_tensors.__version__
        versions["safetensors"] = safetensors.__version__
    except Exception:
        pass
    print("versions:", versions)
    if a.report:
        json.dump({"versions": versions, "results": results}, open(a.report, "w"), indent=1)
    print(f"{len(results) - len(failed)} passed, {len(failed)} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
