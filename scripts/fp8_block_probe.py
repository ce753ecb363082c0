#!/usr/bin/env python3
"""Block-scaled FP8 GEMMs through PyTorch's cuBLASLt path on this GPU (device-side probe).

Times BF16 `a @ w.T` against `torch._scaled_mm` with E4M3 operands, once with one scale per
tensor and once with one f32 scale per 1x128 block of the activation and per 128x128 block of
the weight (the fp8-block recipe's layout), at a dense training shape and at one routed
expert's shapes of the fixed benchmark config. For the block-scaled product it prints the
largest deviation from the f32 product of the dequantized operands, relative to the largest
output. Needs torch with CUDA on the machine; prints the cuBLASLt version it finds.
"""
import ctypes
import glob
import time

import torch


def timed(fn, reps=20):
    fn()
    torch.cuda.synchronize()
    s = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - s) / reps * 1e3


def main():
    print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())
    for lib in sorted(glob.glob("/usr/local/cuda*/lib64/libcublasLt.so*"))[:1]:
        print("cublasLt", lib, ctypes.CDLL(lib).cublasLtGetVersion())
    dev, f8 = "cuda", torch.float8_e4m3fn
    for m, k, n in [(4096, 2048, 2048), (512, 2048, 1536), (512, 768, 2048), (4096, 768, 2048)]:
        a, w = torch.randn(m, k, device=dev), torch.randn(n, k, device=dev)
        ab, wb = a.bfloat16(), w.bfloat16()
        flop = 2 * m * n * k
        tb = timed(lambda: ab @ wb.t())
        line = f"M{m} K{k} N{n}: bf16 {tb:.4f} ms ({flop / tb / 1e9:.0f} TFLOP/s)"
        a8, w8 = a.to(f8), w.to(f8)
        one = torch.ones((), device=dev)
        try:
            tt = timed(lambda: torch._scaled_mm(a8, w8.t(), one, one, out_dtype=torch.bfloat16))
            line += f" | fp8 per tensor {tt:.4f} ({flop / tt / 1e9:.0f})"
        except RuntimeError as e:
            line += f" | per tensor: {str(e)[:120]}"
        sa = torch.rand(m, k // 128, device=dev) + 0.5  # 1x128 blocks of a
        sb = torch.rand(n // 128, k // 128, device=dev) + 0.5  # 128x128 blocks of w
        sa_cm = sa.t().contiguous().t()  # outer-dimension-major
        try:
            out = torch._scaled_mm(a8, w8.t(), sa_cm, sb.t(), out_dtype=torch.bfloat16)
            tt = timed(lambda: torch._scaled_mm(a8, w8.t(), sa_cm, sb.t(), out_dtype=torch.bfloat16))
            ad = a8.float() * sa.repeat_interleave(128, 1)
            wd = w8.float() * sb.repeat_interleave(128, 0).repeat_interleave(128, 1)
            ref = ad @ wd.t()
            err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
            line += f" | fp8 1x128/128x128 {tt:.4f} ({flop / tt / 1e9:.0f}) error {err:.2e}"
        except RuntimeError as e:
            line += f" | 1x128/128x128: {str(e)[:120]}"
        print(line)


if __name__ == "__main__":
    main()
