#!/usr/bin/env python3
"""Independent generator of mxrl quantizer vectors (quant-contract.md v1, section 6 layout).

Written from the contract text only, with numpy float32 arithmetic (IEEE binary32, round to
nearest even, no FMA for elementwise ops): E4M3 by enumerating its representable values and
choosing the nearest with ties to the even code; E2M1 by the contract's threshold table;
UE8M0 round-up by the contract's bit rules. It shares no code with the Rust crate.

Writes a safetensors file (header written directly: 8-byte little-endian length + JSON) with
the same tensor names as vectors/quant-public.safetensors, but other shapes, seeds and
families. Metadata: `manifest` (JSON list of cases), `generator`, `generator_format_version`.

Regenerate (numpy 2.x; output is deterministic):
    python3 crates/mxrl-formats/tests/gen/gen_vectors.py crates/mxrl-formats/tests/data/quant-gen.safetensors
"""
import json
import struct
import sys

import numpy as np

FORMAT_VERSION = 1
F32 = np.float32
F32_MAX = F32(np.finfo(np.float32).max)
R448 = np.array([0x3B124925], dtype=np.uint32).view(np.float32)[0]
R6 = np.array([0x3E2AAAAB], dtype=np.uint32).view(np.float32)[0]


def bits_to_f32(b):
    return np.asarray(b, dtype=np.uint32).view(np.float32)


# ---------------------------------------------------------------- element conversions (§1)

def e4m3_grid():
    """(code, value) of every finite non-negative E4M3 (e4m3fn, bias 7) code."""
    codes, vals = [], []
    for e in range(16):
        for m in range(8):
            if e == 15 and m == 7:
                continue  # NaN
            v = (m / 8.0) * 2.0 ** (1 - 7) if e == 0 else (1 + m / 8.0) * 2.0 ** (e - 7)
            codes.append((e << 3) | m)
            vals.append(v)
    return np.array(codes, dtype=np.int64), np.array(vals, dtype=np.float64)


E4M3_CODES, E4M3_VALS = e4m3_grid()


def e4m3(x):
    """f32 array -> E4M3 bytes: nearest, ties to even code, satfinite 448, NaN -> 0x7F."""
    x = np.asarray(x, dtype=np.float32)
    flat = x.reshape(-1)
    a = np.abs(flat.astype(np.float64))
    nan = np.isnan(a)
    a = np.where(nan, 0.0, np.minimum(a, 448.0))  # beyond 448 (incl. Inf) the nearest is 448
    d = np.abs(a[:, None] - E4M3_VALS[None, :])
    dmin = d.min(axis=1, keepdims=True)
    cand = d == dmin
    even = cand & (E4M3_CODES[None, :] % 2 == 0)
    pick = np.where(even.any(axis=1), even.argmax(axis=1), cand.argmax(axis=1))
    code = E4M3_CODES[pick]
    code = np.where(np.signbit(flat), code | 0x80, code)
    code = np.where(nan, 0x7F, code)
    return code.astype(np.uint8).reshape(x.shape)


def e4m3_value(code):
    code = np.asarray(code, dtype=np.int64)
    mag = code & 0x7F
    v = np.zeros(code.shape, dtype=np.float64)
    for c, val in zip(E4M3_CODES, E4M3_VALS):
        v = np.where(mag == c, val, v)
    v = np.where(code & 0x80, -v, v)
    return v.astype(np.float32)


def e2m1(x):
    """f32 array -> E2M1 nibbles by the contract's threshold table."""
    x = np.asarray(x, dtype=np.float32)
    a = np.abs(x)
    c = np.select(
        [a <= 0.25, a < 0.75, a <= 1.25, a < 1.75, a <= 2.5, a < 3.5, a <= 5.0],
        [0, 1, 2, 3, 4, 5, 6],
        default=7,
    )
    c = np.where(np.signbit(x), c | 8, c)
    c = np.where(np.isnan(x), 7, c)
    return c.astype(np.uint8)


def ue8m0_round_up(v):
    """f32 v >= 0 -> UE8M0 by the contract's bit rules."""
    v = np.asarray(v, dtype=np.float32)
    b = v.view(np.uint32).astype(np.int64)
    e = b >> 23
    m = b & 0x7FFFFF
    out = np.where(e == 0, (m > 0x400000).astype(np.int64), np.where(m == 0, e, np.where(e == 0xFE, 0xFE, e + 1)))
    out = np.where(b == 0x7F800000, 0xFE, out)
    out = np.where(np.isnan(v), 0xFF, out)
    return out.astype(np.uint8)


def ue8m0_reciprocal(b):
    b = np.asarray(b, dtype=np.uint32)
    bits = np.where(b == 254, 0x00400000, (254 - b.astype(np.int64)).clip(0) << 23)
    return bits_to_f32(bits.astype(np.uint32))


def amax_of(x, axis):
    a = np.abs(x)
    a = np.where(np.isnan(a), F32(0), a)
    return np.maximum(a.max(axis=axis), F32(0)).astype(np.float32)


# ---------------------------------------------------------------- MXFP8 (§2)

def mxfp8_row(x):
    m, k = x.shape
    blocks = x.reshape(m, k // 32, 32)
    amax = amax_of(blocks, axis=2)
    scale = ue8m0_round_up((amax * R448).astype(np.float32))
    inv = ue8m0_reciprocal(scale)
    q = e4m3((blocks * inv[:, :, None]).astype(np.float32))
    return q.reshape(m, k), scale


def mxfp8_col(x):
    m, k = x.shape
    blocks = x.reshape(m // 32, 32, k)
    amax = amax_of(blocks, axis=1)
    scale = ue8m0_round_up((amax * R448).astype(np.float32))
    inv = ue8m0_reciprocal(scale)
    q = e4m3((blocks * inv[:, None, :]).astype(np.float32))
    return q.reshape(m, k), scale


# ---------------------------------------------------------------- NVFP4 (§3)

def nvfp4_globals(amax):
    amax = np.asarray(amax, dtype=np.float32)
    with np.errstate(divide="ignore", over="ignore"):
        s = (F32(2688.0) / amax).astype(np.float32)
    s = np.minimum(s, F32_MAX)
    s = np.where((amax == 0) | (s == 0), F32(1.0), s).astype(np.float32)
    s_dec = (F32(1.0) / s).astype(np.float32)
    mult = (s * R6).astype(np.float32)
    return s_dec, mult


def nvfp4(x, scope, tile):
    m, k = x.shape
    if scope == "tensor":
        amax = np.array([amax_of(x.reshape(-1), axis=0)], dtype=np.float32)
        row_amax = np.repeat(amax, m)
    else:
        amax = amax_of(x, axis=1)
        row_amax = amax
    s_dec, mult = nvfp4_globals(row_amax)
    blocks = x.reshape(m, k // 16, 16)
    if tile:
        t = x.reshape(m // 16, 16, k // 16, 16)
        tmax = amax_of(t, axis=(1, 3))  # [m/16, k/16]
        bmax = np.repeat(tmax, 16, axis=0)
    else:
        bmax = amax_of(blocks, axis=2)
    with np.errstate(over="ignore"):
        sdec = np.minimum((bmax * mult[:, None]).astype(np.float32), F32_MAX)
    scale = e4m3(sdec)  # sdec >= 0, so this is the UE4M3 byte
    sf = e4m3_value(scale)
    with np.errstate(divide="ignore", over="ignore"):
        enc = np.minimum((F32(1.0) / (sf * s_dec[:, None]).astype(np.float32)).astype(np.float32), F32_MAX)
    with np.errstate(over="ignore"):
        codes = e2m1((blocks * enc[:, :, None]).astype(np.float32)).reshape(m, k)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    return packed, scale, amax.astype(np.float32)


# ---------------------------------------------------------------- inputs

def to_bf16_bits(x):
    """f32 -> bf16 bits, round to nearest even (NaN kept quiet)."""
    b = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    r = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)
    r = np.where(np.isnan(x), ((b >> 16) | 0x40).astype(np.uint16), r)
    return r


def bf16_bits_to_f32(h):
    return (h.astype(np.uint32) << 16).view(np.float32)


def family_values(family, m, k, rng):
    if family == "magnitudes":  # rows of wildly different magnitude
        exps = rng.integers(-60, 60, size=(m, 1))
        return (rng.standard_normal((m, k)) * np.exp2(exps)).astype(np.float32)
    if family == "outliers":
        x = rng.standard_normal((m, k))
        mask = rng.random((m, k)) < 0.01
        return np.where(mask, x * 3e3, x).astype(np.float32)
    if family == "tiny":  # tiny normals and f32 subnormals, a few ordinary blocks
        x = rng.standard_normal((m, k)) * np.exp2(rng.integers(-140, -100, size=(m, k)).astype(np.float64))
        x[:, :16] = rng.standard_normal((m, 16)) * 1e-3
        return x.astype(np.float32)
    if family == "grid":  # values on and between E4M3 / E2M1 grid points, several scales
        pts = np.array([0, 0.25, 0.5, 0.75, 1, 1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4, 5, 6, 448, 449, 464, 465, 480])
        x = rng.choice(pts, size=(m, k)) * rng.choice([1.0, -1.0], size=(m, k))
        x *= np.exp2(rng.integers(-3, 4, size=(m, 1)).astype(np.float64))
        return x.astype(np.float32)
    if family == "negzero":  # -0.0, +0.0 and whole blocks of -0.0 among small values
        x = rng.standard_normal((m, k)) * 0.01
        x = np.where(rng.random((m, k)) < 0.5, -0.0, x)
        x[:, 16:32] = -0.0
        return x.astype(np.float32)
    if family == "specials":  # NaN and ±Inf among ordinary values
        x = rng.standard_normal((m, k)).astype(np.float32)
        r = rng.random((m, k))
        x = np.where(r < 0.02, np.nan, x)
        x = np.where((r >= 0.02) & (r < 0.03), np.inf, x)
        x = np.where((r >= 0.03) & (r < 0.04), -np.inf, x)
        return x.astype(np.float32)
    raise ValueError(family)


# ---------------------------------------------------------------- file

def write_safetensors(path, tensors, metadata):
    header = {"__metadata__": metadata}
    blobs, off = [], 0
    for name, (dtype, shape, data) in tensors.items():
        raw = data.tobytes()
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


def main(out):
    shapes = [(2, 32), (5, 96), (16, 128), (32, 64), (48, 96), (64, 32)]
    families = ["magnitudes", "outliers", "tiny", "grid", "negzero", "specials"]
    tensors, manifest, n = {}, [], 0
    for si, (m, k) in enumerate(shapes):
        for fi, fam in enumerate(families):
            for dtype in ["bfloat16", "float32"]:
                n += 1
                case = f"g{n:03d}"
                rng = np.random.default_rng(1000 + 97 * si + 13 * fi + (dtype == "float32"))
                x = family_values(fam, m, k, rng)
                if dtype == "bfloat16":
                    h = to_bf16_bits(x)
                    tensors[f"{case}/x"] = ("BF16", (m, k), h)
                    x = bf16_bits_to_f32(h)
                else:
                    tensors[f"{case}/x"] = ("F32", (m, k), x)
                outputs = ["mxfp8.row"]
                q, s = mxfp8_row(x)
                tensors[f"{case}/mxfp8.row.data"] = ("U8", q.shape, q)
                tensors[f"{case}/mxfp8.row.scale"] = ("U8", s.shape, s)
                if m % 32 == 0:
                    outputs.append("mxfp8.col")
                    q, s = mxfp8_col(x)
                    tensors[f"{case}/mxfp8.col.data"] = ("U8", q.shape, q)
                    tensors[f"{case}/mxfp8.col.scale"] = ("U8", s.shape, s)
                variants = [("nvfp4.tensor", "tensor", False), ("nvfp4.row", "row", False)]
                if m % 16 == 0:
                    variants.append(("nvfp4.2d", "tensor", True))
                for name, scope, tile in variants:
                    outputs.append(name)
                    d, s, a = nvfp4(x, scope, tile)
                    tensors[f"{case}/{name}.data"] = ("U8", d.shape, d)
                    tensors[f"{case}/{name}.scale"] = ("U8", s.shape, s)
                    tensors[f"{case}/{name}.amax"] = ("F32", a.shape, a)
                manifest.append({"case": case, "shape": [m, k], "family": fam, "dtype": dtype, "outputs": outputs})
    meta = {
        "manifest": json.dumps(manifest),
        "generator": "crates/mxrl-formats/tests/gen/gen_vectors.py",
        "generator_format_version": str(FORMAT_VERSION),
        "numpy": np.__version__,
    }
    write_safetensors(out, tensors, meta)
    print(f"wrote {out}: {len(manifest)} cases, {len(tensors)} tensors")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
