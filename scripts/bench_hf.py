#!/usr/bin/env python3
"""Times transformers' eager Qwen3-MoE on the benchmark config of `mxrl bench model`.

The baseline the engine is measured against (BENCHMARKS.md): transformers'
`Qwen3MoeForCausalLM` built from a config (no download), BF16, random init, eager attention,
timed with CUDA events after warm-up (medians):

- a training step on 8 x 512 tokens (forward + backward + AdamW) -> tokens/s;
- prefill of 512 tokens (one sequence, building the KV cache);
- decode ms/step at batch 1, 8, 32, 128 after a 128-token prompt, with the KV cache
  (`model(ids, past_key_values=cache)` in a loop, greedy next token on the device; not
  `generate`);
- peak device memory per phase;
- a large device-to-device copy's bandwidth (bytes read + written per second), and the decode
  roofline it implies (active weight bytes per step / that bandwidth).

Prints one JSON object per figure (one line each), then a summary table. `--json-out FILE`
also writes everything as one JSON document (written to FILE.partial, then renamed), whose
`figures` list `mxrl bench model --hf-json` reads.
`--quick` uses small shapes (a smoke check; `--device cpu --quick` runs without a GPU).

Needs torch and transformers (tested against the APIs of torch 2.x and transformers 4.5x/5.x);
nothing is downloaded.
"""

import argparse
import inspect
import json
import os
import platform
import statistics
import sys
import time


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (default cuda)")
    ap.add_argument("--quick", action="store_true", help="small shapes (smoke check)")
    ap.add_argument("--json-out", metavar="FILE", help="also write all figures to FILE (JSON)")
    ap.add_argument("--warmup", type=int, default=None, help="warm-up iterations (default 3; quick 1)")
    ap.add_argument("--iters", type=int, default=None, help="timed iterations (default 10; quick 2)")
    ap.add_argument("--decode-steps", type=int, default=None,
                    help="timed decode steps per batch size (default 32; quick 4)")
    ap.add_argument("--seed", type=int, default=0, help="RNG seed of the weights and token ids")
    ap.add_argument("--skip", default="", help="comma list of phases to skip: train,prefill,decode,copy")
    args = ap.parse_args(argv)
    for name in ("warmup", "iters", "decode_steps"):
        v = getattr(args, name)
        if v is not None and v < (0 if name == "warmup" else 1):
            ap.error(f"--{name.replace('_', '-')} must be {'>= 0' if name == 'warmup' else '>= 1'}, got {v}")
    return args


# The fixed benchmark config (issue "The whole model on the GPU"): 2.63 B parameters.
FULL = dict(
    vocab_size=32000, hidden_size=2048, num_hidden_layers=8, num_attention_heads=16,
    num_key_value_heads=4, head_dim=128, num_experts=64, num_experts_per_tok=8,
    moe_intermediate_size=768, train_batch=8, train_seq=512, prefill=512, prompt=128,
    decode_batches=[1, 8, 32, 128], warmup=3, iters=10, decode_steps=32, copy_bytes=2 << 30,
)
QUICK = dict(
    vocab_size=512, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
    moe_intermediate_size=64, train_batch=2, train_seq=32, prefill=32, prompt=16,
    decode_batches=[1, 4], warmup=1, iters=2, decode_steps=4, copy_bytes=64 << 20,
)


class Timer:
    """Times a callable: CUDA events on a GPU (after synchronizing), wall clock on the CPU."""

    def __init__(self, torch, device):
        self.torch = torch
        self.cuda = device.type == "cuda"

    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize()

    def once_ms(self, fn):
        if self.cuda:
            s = self.torch.cuda.Event(enable_timing=True)
            e = self.torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            e.synchronize()
            return s.elapsed_time(e)
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    def median_ms(self, fn, warmup, iters):
        for _ in range(warmup):
            fn()
        self.sync()
        times = [self.once_ms(fn) for _ in range(iters)]
        return statistics.median(times), times


def build_model(torch, transformers, shape, device, seed):
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=shape["vocab_size"],
        hidden_size=shape["hidden_size"],
        intermediate_size=4 * shape["hidden_size"],  # unused: every layer is MoE
        num_hidden_layers=shape["num_hidden_layers"],
        num_attention_heads=shape["num_attention_heads"],
        num_key_value_heads=shape["num_key_value_heads"],
        head_dim=shape["head_dim"],
        num_experts=shape["num_experts"],
        num_experts_per_tok=shape["num_experts_per_tok"],
        moe_intermediate_size=shape["moe_intermediate_size"],
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        output_router_logits=False,
        use_cache=True,
    )
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    cls = transformers.Qwen3MoeForCausalLM
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            try:  # transformers 5: `dtype`
                model = cls._from_config(cfg, attn_implementation="eager", dtype=torch.bfloat16)
            except TypeError:  # transformers 4: `torch_dtype`
                model = cls._from_config(cfg, attn_implementation="eager", torch_dtype=torch.bfloat16)
    finally:
        torch.set_default_dtype(old)
    model.to(device=device, dtype=torch.bfloat16)
    impl = getattr(model.config, "_attn_implementation", None)
    if impl != "eager":
        raise SystemExit(f"bench_hf: expected eager attention, the model uses {impl!r}")
    return model, cfg


def active_params(shape):
    """Parameters a token multiplies (attention, router, its top-k experts, lm_head)."""
    h, hd = shape["hidden_size"], shape["head_dim"]
    q, kv = shape["num_attention_heads"] * hd, shape["num_key_value_heads"] * hd
    attn = h * q + 2 * h * kv + q * h
    experts = shape["num_experts_per_tok"] * 3 * h * shape["moe_intermediate_size"]
    router = h * shape["num_experts"]
    return shape["num_hidden_layers"] * (attn + experts + router) + shape["vocab_size"] * h


def decode_weight_bytes(shape, batch):
    """BF16 bytes of the weights one decode step must read at `batch` rows: attention, router,
    norms, the expected number of distinct experts hit (E·(1 − (1 − k/E)^batch), uniform
    routing), the lm_head and one embedding row per sequence."""
    h, hd = shape["hidden_size"], shape["head_dim"]
    q, kv = shape["num_attention_heads"] * hd, shape["num_key_value_heads"] * hd
    e, k = shape["num_experts"], shape["num_experts_per_tok"]
    distinct = e * (1.0 - (1.0 - k / e) ** batch)
    per_layer = (h * q + 2 * h * kv + q * h) + h * e + 2 * h + 2 * hd \
        + distinct * 3 * h * shape["moe_intermediate_size"]
    return 2.0 * (shape["num_hidden_layers"] * per_layer + shape["vocab_size"] * h + h
                  + batch * h)


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        import torch
        import transformers
    except ImportError as e:
        raise SystemExit(f"bench_hf: needs torch and transformers ({e})")
    shape = dict(QUICK if args.quick else FULL)
    warmup = shape["warmup"] if args.warmup is None else args.warmup
    iters = shape["iters"] if args.iters is None else args.iters
    steps = shape["decode_steps"] if args.decode_steps is None else args.decode_steps
    skip = {s for s in args.skip.split(",") if s}
    unknown = skip - {"train", "prefill", "decode", "copy"}
    if unknown:
        raise SystemExit(f"bench_hf: unknown phase(s) in --skip: {sorted(unknown)}")

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"bench_hf: --device {args.device} but torch sees no CUDA GPU "
                         "(use --device cpu --quick for a smoke check)")
    timer = Timer(torch, device)
    cuda = device.type == "cuda"
    machine = {
        "device": torch.cuda.get_device_name(device) if cuda else platform.processor() or "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.version.cuda if cuda else None,
        "python": platform.python_version(),
    }
    figures = []

    def emit(fig):
        figures.append(fig)
        print(json.dumps(fig), flush=True)

    def reset_peak():
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(device)

    def peak_bytes():
        return torch.cuda.max_memory_allocated(device) if cuda else None

    model, cfg = build_model(torch, transformers, shape, device, args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    n_active = active_params(shape)
    emit({"figure": "model", "params": n_params, "active_params_per_token": n_active,
          "config": {k: shape[k] for k in ("vocab_size", "hidden_size", "num_hidden_layers",
                                           "num_attention_heads", "num_key_value_heads",
                                           "head_dim", "num_experts", "num_experts_per_tok",
                                           "moe_intermediate_size")},
          "dtype": "bfloat16", "attention": "eager", "machine": machine})
    gen = torch.Generator(device="cpu").manual_seed(args.seed + 1)

    def ids(b, t):
        return torch.randint(0, shape["vocab_size"], (b, t), generator=gen).to(device)

    copy_gbs = None
    if "copy" not in skip:
        n = shape["copy_bytes"]
        src = torch.empty(n, dtype=torch.uint8, device=device).fill_(1)
        dst = torch.empty_like(src)
        ms, _ = timer.median_ms(lambda: dst.copy_(src), warmup, iters)
        copy_gbs = 2 * n / (ms * 1e-3) / 1e9
        emit({"figure": "device_copy", "bytes": n, "ms": ms, "gb_per_s_read_plus_write": copy_gbs})
        del src, dst

    if "train" not in skip:
        b, t = shape["train_batch"], shape["train_seq"]
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.01)
        x = ids(b, t)

        def step():
            out = model(input_ids=x, labels=x, use_cache=False)
            out.loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        reset_peak()
        ms, times = timer.median_ms(step, warmup, iters)
        tok_s = b * t / (ms * 1e-3)
        emit({"figure": "train_step", "batch": b, "seq": t, "ms": ms, "tokens_per_s": tok_s,
              "tflops_6nd": 6.0 * n_active * b * t / (ms * 1e-3) / 1e12,
              "peak_bytes": peak_bytes(), "times_ms": times, "optimizer": "torch.optim.AdamW"})
        del opt, x
        model.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.empty_cache()

    model.eval()
    if "prefill" not in skip:
        t = shape["prefill"]
        x = ids(1, t)

        def prefill():
            with torch.inference_mode():
                model(input_ids=x, use_cache=True)

        reset_peak()
        ms, times = timer.median_ms(prefill, warmup, iters)
        emit({"figure": "prefill", "tokens": t, "ms": ms, "tokens_per_s": t / (ms * 1e-3),
              "peak_bytes": peak_bytes(), "times_ms": times})

    if "decode" not in skip:
        # transformers >= 5.2x names the cache argument `cache` (`past_key_values` deprecated).
        params = inspect.signature(model.forward).parameters
        cache_kw = "cache" if "cache" in params else "past_key_values"

        def cache_of(o):
            c = getattr(o, "cache", None) if cache_kw == "cache" else None
            return c if c is not None else getattr(o, "past_key_values", None)

        for b in shape["decode_batches"]:
            prompt = ids(b, shape["prompt"])
            reset_peak()
            with torch.inference_mode():
                out = model(input_ids=prompt, use_cache=True)
                state = {"cache": cache_of(out),
                         "next": out.logits[:, -1, :].argmax(dim=-1, keepdim=True)}
                if state["cache"] is None:
                    raise SystemExit("bench_hf: the model returned no KV cache")

                def decode_step():
                    o = model(input_ids=state["next"], use_cache=True,
                              **{cache_kw: state["cache"]})
                    state["cache"] = cache_of(o)
                    state["next"] = o.logits[:, -1, :].argmax(dim=-1, keepdim=True)

                ms, times = timer.median_ms(decode_step, warmup, steps)
            # The steps really extended the cache (no recomputation of the prompt).
            want_len = shape["prompt"] + warmup + steps
            got_len = state["cache"].get_seq_length() if hasattr(state["cache"], "get_seq_length") \
                else None
            if got_len is not None and got_len != want_len:
                raise SystemExit(f"bench_hf: KV cache holds {got_len} positions, {want_len} expected")
            wbytes = decode_weight_bytes(shape, b)
            fig = {"figure": "decode", "batch": b, "prompt": shape["prompt"], "ms_per_step": ms,
                   "tokens_per_s": b / (ms * 1e-3), "weight_bytes_per_step": wbytes,
                   "cache_positions": got_len, "peak_bytes": peak_bytes(), "times_ms": times}
            if copy_gbs:
                roof = wbytes / (copy_gbs * 1e9) * 1e3
                fig["roofline_ms"] = roof
                fig["ratio_to_roofline"] = ms / roof
            emit(fig)
            del state, out, prompt
            if cuda:
                torch.cuda.empty_cache()

    # Summary table.
    print()
    print(f"transformers {machine['transformers']} eager, torch {machine['torch']}, "
          f"{machine['device']}, {n_params / 1e6:.1f} M parameters")
    print(f"{'figure':<22} {'value':>14} {'unit':<10} {'peak GiB':>9}")
    for f in figures:
        pk = f.get("peak_bytes")
        pk = f"{pk / 2**30:9.2f}" if pk else f"{'-':>9}"
        if f["figure"] == "train_step":
            print(f"{'train ' + str(f['batch']) + 'x' + str(f['seq']):<22} "
                  f"{f['tokens_per_s']:14.0f} {'tok/s':<10} {pk}")
        elif f["figure"] == "prefill":
            print(f"{'prefill ' + str(f['tokens']):<22} {f['ms']:14.3f} {'ms':<10} {pk}")
        elif f["figure"] == "decode":
            extra = f"  ({f['ratio_to_roofline']:.1f}x roofline {f['roofline_ms']:.3f} ms)" \
                if "roofline_ms" in f else ""
            print(f"{'decode batch ' + str(f['batch']):<22} {f['ms_per_step']:14.3f} "
                  f"{'ms/step':<10} {pk}{extra}")
        elif f["figure"] == "device_copy":
            print(f"{'device copy':<22} {f['gb_per_s_read_plus_write']:14.1f} {'GB/s':<10} {pk}")
    if cuda:
        print(f"{'peak (whole run)':<22} {torch.cuda.max_memory_allocated(device) / 2**30:14.2f} GiB")

    if args.json_out:
        doc = {"script": "scripts/bench_hf.py", "quick": args.quick, "machine": machine,
               "warmup": warmup, "iters": iters, "decode_steps": steps, "figures": figures}
        tmp = args.json_out + ".partial"
        with open(tmp, "w") as fh:
            json.dump(doc, fh, indent=1)
        os.replace(tmp, args.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
