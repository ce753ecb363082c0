#!/usr/bin/env python3
"""Loads mxrl's converted checkpoints with transformers (+ compressed-tensors) as a user would,
and checks what the library quantized and what it computes.

Inputs: the folder scripts/clientcheck_prepare.sh writes (default .clientcheck/: src/, ckpt/NAME/,
logits/NAME.safetensors with mxrl's own `mxrl forward` logits, cases.json) and wheels of
compressed-tensors and its small dependencies in .whl/ (installed to /tmp/site first).

For each converted checkpoint, one line:
  - load: `AutoModelForCausalLM.from_pretrained` with output_loading_info, on the CPU in float32,
    else on the GPU in bfloat16, and for `fp8`/`mxfp8` checkpoints finally with transformers'
    own dequantize-at-load mode (FineGrainedFP8Config from the checkpoint's config,
    dequantize=True; then the modules check does not apply). A load (or first forward) that raises,
    or that reports missing / unexpected / mismatched keys (weights left at their random
    initialisation or dropped), is a layout transformers cannot load: LIMIT, with the
    library's own message. It is counted apart from PASS/FAIL and recorded in
    docs/checkpoint-clients.md.
  - modules: every nn.Linear that carries a compressed-tensors quantization scheme (or is an
    FP8 linear) must be exactly the modules mxrl.json records as stored quantized; every other
    nn.Linear is kept. Quantized tensors that are not nn.Linear in transformers (routed experts,
    fused into one module per layer) are reported as dequantized at load.
  - logits (the same token ids mxrl used), A = this checkpoint in transformers, M = mxrl's forward
    of the same checkpoint, B = transformers on the BF16 source, M0 = mxrl on the source:
      finite(A);
      nearer: max|A-M| < max|B-M| (the client runs the quantized model mxrl runs, not the source);
      bound (checkpoints whose quantized linears compressed-tensors runs, with their activation
      quantization): max|A-M| <= max|B-M0| + 2 max|A-W|, W = A's run with compressed-tensors'
      activation quantization switched off (module.quantization_enabled = False). Derivation:
      |A-M| <= |A-W| + |W-M|; W and mxrl differ by mxrl's activation quantization (NVFP4 blocks
      of 16 with E4M3 block scales, the same per-element error bound as compressed-tensors',
      whose effect |A-W| is measured) plus the implementations' difference on the same weights,
      measured on the unquantized source as |B-M0|.
    A checkpoint without quantized tensors must give A == B exactly.
The last line is `N passed, N failed`; the exit status is non-zero on any failure.

Device command (see docs/checkpoint-clients.md):
  python3 scripts/clientcheck_device.py --dir .clientcheck --wheels .whl --out $OUT/clientcheck.json
"""
import argparse
import glob
import json
import os
import subprocess
import sys
import traceback


def install_wheels(whl_dir, site):
    whls = sorted(glob.glob(os.path.join(whl_dir, "*.whl")))
    if whls:
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
             "--no-compile", "--no-cache-dir", "--upgrade", "--target", site, *whls],
            check=True,
        )
    sys.path.insert(0, site)
    return [os.path.basename(w) for w in whls]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default=".clientcheck")
    ap.add_argument("--wheels", default=".whl")
    ap.add_argument("--site", default="/tmp/site")
    ap.add_argument("--out", default=None, help="JSON report")
    args = ap.parse_args()
    wheels = install_wheels(args.wheels, args.site)

    import torch
    import transformers
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    try:
        import compressed_tensors
        ct_version = getattr(compressed_tensors, "__version__", "?")
    except Exception as e:  # noqa: BLE001
        ct_version = f"not importable: {e}"
    cases = json.load(open(os.path.join(args.dir, "cases.json")))
    tokens = cases["tokens"]
    env = {
        "python": sys.version.split()[0], "torch": torch.__version__,
        "transformers": transformers.__version__, "compressed_tensors": ct_version,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "wheels": wheels, "mxrl": cases.get("mxrl"),
    }
    print("environment:", json.dumps(env), flush=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False

    import logging

    class Capture(logging.Handler):
        def __init__(self):
            super().__init__(logging.WARNING)
            self.messages = []

        def emit(self, record):
            self.messages.append(record.getMessage()[:400])

    capture = Capture()
    logging.getLogger("transformers").addHandler(capture)

    attempts = [("cpu", torch.float32)]
    if torch.cuda.is_available():
        attempts.append(("cuda", torch.bfloat16))

    def load(path, device, dtype, dequantize=False):
        kw = {}
        if dequantize:
            # transformers' own FP8 dequantize-at-load mode, configured from the checkpoint's
            # quantization_config (modules_to_not_convert included), dequantize switched on.
            from transformers import FineGrainedFP8Config
            qc = json.load(open(os.path.join(path, "config.json")))["quantization_config"]
            kw["quantization_config"] = FineGrainedFP8Config.from_dict({**qc, "dequantize": True})
        model, info = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, output_loading_info=True, **kw)
        model.to(device).eval()
        return model, info

    def logits_of(model, device):
        with torch.no_grad():
            ids = torch.tensor([tokens], device=device)
            return model(ids).logits[0].float().cpu()

    def module_report(model):
        """(every linear module, those compressed-tensors or transformers' FP8 quantize)."""
        linears, quantized = [], []
        for mn, mod in model.named_modules():
            cls = type(mod).__name__
            if isinstance(mod, torch.nn.Linear) or cls.endswith("Linear"):
                linears.append(mn)
                if getattr(mod, "quantization_scheme", None) is not None or "FP8" in cls.upper():
                    quantized.append(mn)
        return linears, quantized

    source_logits = {}

    def source(src, device, dtype):
        key = (src, device, str(dtype))
        if key not in source_logits:
            model, _ = load(os.path.join(args.dir, src), device, dtype)
            source_logits[key] = logits_of(model, device)
            del model
        return source_logits[key]

    def run_case(case):
        name = case["name"]
        path = os.path.join(args.dir, "ckpt", name)
        rec = json.load(open(os.path.join(path, "mxrl.json")))
        mxrl_q = {k[: -len(".weight")] for k, v in rec["tensors"].items()
                  if v["format"] != "bf16" and k.endswith(".weight")}
        m = load_file(os.path.join(args.dir, "logits", f"{name}.safetensors"))["logits"]
        src = case.get("src", "src")
        m0 = load_file(os.path.join(args.dir, "logits", f"{src}.safetensors"))["logits"]
        r = {"name": name, "source": case.get("src", "src"), "recipe": case["recipe"],
             "format": case["format"],
             "quantized_format": rec.get("quantized_format"), "errors": []}
        model = None
        capture.messages = []
        qm = (json.load(open(os.path.join(path, "config.json"))).get("quantization_config")
              or {}).get("quant_method")
        tries = [(d, t, False) for d, t in attempts]
        if qm in ("fp8", "mxfp8"):
            tries.append(("cpu", torch.float32, True))
        for device, dtype, deq in tries:
            try:
                model, info = load(path, device, dtype, deq)
                linears, quantized = module_report(model)  # before the first forward
                a = logits_of(model, device)
                r["device"], r["dtype"], r["dequantized_at_load"] = device, str(dtype), deq
                break
            except Exception as e:  # noqa: BLE001
                msg = "".join(traceback.format_exception_only(type(e), e)).strip()
                r["errors"].append(f"{device}/{dtype}{'/dequantize' if deq else ''}: {msg[:1500]}")
                model = None
        r["warnings"] = capture.messages[:10]
        if model is None:
            r["status"] = "LIMIT"
            r["why"] = "from_pretrained or the forward raised: " + " | ".join(r["errors"])
            print(f"LIMIT {name}: {r['why'][:800]}", flush=True)
            return r
        bad_keys = {k: sorted(info.get(k) or [])[:8] for k in
                    ("missing_keys", "unexpected_keys", "mismatched_keys") if info.get(k)}
        r["loading_info"] = {k: len(info.get(k) or []) for k in
                             ("missing_keys", "unexpected_keys", "mismatched_keys")}
        want = sorted(x for x in linears if x in mxrl_q)
        outside = sorted(x for x in mxrl_q if x not in set(linears))
        r["modules"] = {"linear": len(linears), "client_quantized": len(quantized),
                        "mxrl_quantized_linear": len(want),
                        "mxrl_quantized_outside_linear": len(outside)}
        r["modules_match"] = sorted(quantized) == want
        if not r["modules_match"]:
            r["module_diff"] = {
                "client_only": sorted(set(quantized) - set(want))[:10],
                "mxrl_only": sorted(set(want) - set(quantized))[:10]}
        device = r["device"]
        b = source(src, device, model.dtype)
        e_a = (a - m).abs().max().item()
        e_b = (b - m).abs().max().item()
        e_0 = (b - m0).abs().max().item()
        r.update(finite=bool(torch.isfinite(a).all()), max_abs_client_vs_mxrl=e_a,
                 max_abs_source_vs_mxrl=e_b, max_abs_source_vs_mxrl_source=e_0)
        checks = {"finite": r["finite"]}
        if not deq:  # dequantized at load: no quantized modules to compare
            checks["modules"] = r["modules_match"]
        if not mxrl_q:
            checks["equals_source"] = bool(torch.equal(a, b))
        else:
            checks["nearer"] = e_a < e_b
        ct_mods = [mod for _, mod in model.named_modules()
                   if getattr(mod, "quantization_scheme", None) is not None]
        if ct_mods:
            for mod in ct_mods:
                mod.quantization_enabled = False
            w = logits_of(model, device)
            for mod in ct_mods:
                mod.quantization_enabled = True
            e_w = (a - w).abs().max().item()
            bound = e_0 + 2 * e_w
            r.update(max_abs_act_quant_effect=e_w, bound=bound)
            checks["bound"] = e_a <= bound
        r["checks"] = checks
        if bad_keys:
            r["status"] = "LIMIT"
            r["why"] = f"loading_info reports {bad_keys}; warnings {r['warnings'][:3]}"
        else:
            r["status"] = "PASS" if all(checks.values()) else "FAIL"
        line = (f"{r['status']} {name}: on {device}/{dtype}{' (dequantized at load)' if deq else ''}, "
                f"linears {len(linears)}, "
                f"client-quantized {len(quantized)} (mxrl {len(want)}, match {r['modules_match']}), "
                f"quantized outside nn.Linear {len(outside)}; max|A-M| {e_a:.3e}, "
                f"max|B-M| {e_b:.3e}, max|B-M0| {e_0:.3e}")
        if "bound" in r:
            line += f", bound {r['bound']:.3e}"
        line += f"; checks {checks}"
        if r["status"] == "LIMIT":
            line += f"; {r['why']}"
        if r["errors"]:
            line += "; earlier attempts failed: " + " | ".join(e[:300] for e in r["errors"])
        print(line, flush=True)
        del model
        return r

    results = []
    for case in cases["cases"]:
        try:
            r = run_case(case)
        except Exception:  # noqa: BLE001
            tb = traceback.format_exc()
            print(tb, file=sys.stderr, flush=True)
            r = {"name": case["name"], "status": "FAIL",
                 "why": "check raised: " + tb.strip().splitlines()[-1]}
            print(f"FAIL {case['name']}: {r['why']}", flush=True)
        results.append(r)

    n_pass = sum(r["status"] == "PASS" for r in results)
    n_fail = sum(r["status"] == "FAIL" for r in results)
    n_limit = sum(r["status"] == "LIMIT" for r in results)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        json.dump({"environment": env, "results": results}, open(args.out, "w"), indent=1)
    print(f"{n_limit} layout(s) transformers cannot load (LIMIT, messages above)")
    print(f"{n_pass} passed, {n_fail} failed")
    sys.exit(1 if n_fail else 0)


if __name__ == "__main__":
    main()
