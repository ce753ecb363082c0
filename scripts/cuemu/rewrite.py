#!/usr/bin/env python3
"""Rewrites a full CUDA module source (nvrtc_check --sources) into host C++ for cuemu:
every inline-PTX statement becomes a call into cuemu.h (an unknown one is an error that names
it), __shared__ arrays become static storage, the dynamic shared array points at the launch's
shared memory, and the kernels (no longer extern "C") go into `namespace NS`, so two versions
of one module can be linked into one checker.

Usage: rewrite.py IN.cu NS OUT.cpp
"""
import re
import sys

# template (whitespace-normalized prefix) -> (call, layout); layout maps the asm operands to
# the call's arguments: 'o' outputs (incl. "+" operands) in order, then 'i' inputs in order.
ASM = [
    ("cvt.rn.satfinite.e4m3x2.f32", "cuemu_ptx::cvt_rn_satfinite_e4m3x2_f32({o0}, {i0}, {i1})"),
    ("max.NaN.f32 %0, %1, %2;", "cuemu_ptx::max_nan_f32({o0}, {i0}, {i1})"),
    ("cvt.rn.f16x2.e4m3x2", "cuemu_ptx::cvt_rn_f16x2_e4m3x2({o0}, {i0})"),
    ("{ .reg .b16 l, u; mov.b32 {l, u}, %2; cvt.f32.f16 %0, l; cvt.f32.f16 %1, u;",
     "cuemu_ptx::f16x2_to_f32x2({o0}, {o1}, {i0})"),
    ("mul.rn.f16x2 %0, %1, %2;", "cuemu_ptx::mul_rn_f16x2({o0}, {i0}, {i1})"),
    ("fma.rn.bf16x2 %0, %1, %2, %3;", "cuemu_ptx::fma_rn_bf16x2({o0}, {i0}, {i1}, {i2})"),
    ("cvt.rn.bf16x2.f32 %0, %1, %2;", "cuemu_ptx::cvt_rn_bf16x2_f32({o0}, {i0}, {i1})"),
    ("cvt.rn.f16x2.f32 %0, %1, %2;", "cuemu_ptx::cvt_rn_f16x2_f32({o0}, {i0}, {i1})"),
    ("prmt.b32 %0, %1, 0, %2;", "cuemu_ptx::prmt_b32({o0}, {i0}, 0u, {i1})"),
    ("prmt.b32 %0, %1, %2, %3;", "cuemu_ptx::prmt_b32({o0}, {i0}, {i1}, {i2})"),
    ("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16",
     "cuemu_ptx::ldmatrix_x4({o0}, {o1}, {o2}, {o3}, {i0}, true)"),
    ("ldmatrix.sync.aligned.m8n8.x4.shared.b16",
     "cuemu_ptx::ldmatrix_x4({o0}, {o1}, {o2}, {o3}, {i0}, false)"),
    ("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32",
     "cuemu_ptx::mma(0, {o0}, {o1}, {o2}, {o3}, {i0}, {i1}, {i2}, {i3}, {i4}, {i5})"),
    ("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32",
     "cuemu_ptx::mma(1, {o0}, {o1}, {o2}, {o3}, {i0}, {i1}, {i2}, {i3}, {i4}, {i5})"),
    ("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32",
     "cuemu_ptx::mma(2, {o0}, {o1}, {o2}, {o3}, {i0}, {i1}, {i2}, {i3}, {i4}, {i5})"),
    ("cp.async.cg.shared.global [%0], [%1], 16, %2;", "cuemu_ptx::cp_async_16({i0}, {i1}, {i2})"),
    ("cp.async.ca.shared.global [%0], [%1], 4, %2;", "cuemu_ptx::cp_async_4({i0}, {i1}, {i2})"),
    ("cp.async.commit_group;", "cuemu_ptx::cp_async_commit()"),
    ("cp.async.wait_group %0;", "cuemu_ptx::cp_async_wait({i0})"),
    ("cp.async.wait_all;", "cuemu_ptx::cp_async_wait(0)"),
    ("griddepcontrol.wait;", "cuemu_ptx::grid_dependency()"),
    ("{ .reg .pred p; setp.ne.b32 p, %130, 0; wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16",
     "cuemu_ptx::wgmma_bf16_n({i0}, {i1}, {i2}, {i3}, {i4}, {oall})"),
    ("wgmma.fence.sync.aligned;", "cuemu_ptx::wgmma_nop()"),
    ("wgmma.commit_group.sync.aligned;", "cuemu_ptx::wgmma_nop()"),
    ("wgmma.wait_group.sync.aligned %0;", "cuemu_ptx::wgmma_nop()"),
    ("fence.proxy.async.shared::cta;", "cuemu_ptx::wgmma_nop()"),
    ("griddepcontrol.launch_dependents;", "cuemu_ptx::grid_dependency()"),
]


def skip_string(s, i):
    """Index just past the string or char literal starting at s[i]."""
    q = s[i]
    i += 1
    while s[i] != q:
        i += 2 if s[i] == "\\" else 1
    return i + 1


def matching_paren(s, i):
    """Index of the ')' matching the '(' at s[i]."""
    depth = 0
    while True:
        c = s[i]
        if c in "\"'":
            i = skip_string(s, i)
            continue
        if c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
            if depth == 0:
                return i
        i += 1


def split_top(s, sep):
    parts, depth, cur, i = [], 0, "", 0
    while i < len(s):
        c = s[i]
        if c in "\"'":
            j = skip_string(s, i)
            cur += s[i:j]
            i = j
            continue
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        if c == sep and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += c
        i += 1
    parts.append(cur)
    return parts


def operands(section):
    out = []
    for op in split_top(section, ","):
        op = op.strip()
        if not op:
            continue
        m = re.match(r'^"([^"]*)"\s*\((.*)\)$', op, re.S)
        if not m:
            raise SystemExit(f"cannot parse asm operand {op!r}")
        out.append((m.group(1), m.group(2).strip()))
    return out


def rewrite_asm(body, where):
    # Template: the leading string literals.
    i, tmpl = 0, ""
    while True:
        while body[i].isspace():
            i += 1
        if body[i] != '"':
            break
        j = skip_string(body, i)
        tmpl += bytes(body[i + 1 : j - 1], "utf-8").decode("unicode_escape")
        i = j
    rest = body[i:]
    secs = split_top(rest, ":")[1:] if rest.strip() else []
    outs = operands(secs[0]) if len(secs) > 0 else []
    ins = operands(secs[1]) if len(secs) > 1 else []
    norm = " ".join(tmpl.split())
    for key, call in ASM:
        if norm.startswith(key) or norm == key:
            args = {f"o{k}": e for k, (_, e) in enumerate(outs)}
            args.update({f"i{k}": e for k, (_, e) in enumerate(ins)})
            args["oall"] = ", ".join(e for _, e in outs)
            try:
                return call.format(**args)
            except KeyError as e:
                raise SystemExit(f"{where}: asm {norm!r}: operand {e} missing")
    raise SystemExit(f"{where}: no host model for inline PTX {norm!r} (add it to cuemu)")


def rewrite(src, ns):
    out, i = [], 0
    pat = re.compile(r"\basm\b(\s+volatile\b)?\s*\(")
    while True:
        m = pat.search(src, i)
        if not m:
            out.append(src[i:])
            break
        out.append(src[i : m.start()])
        open_i = m.end() - 1
        close_i = matching_paren(src, open_i)
        line = src.count("\n", 0, m.start()) + 1
        out.append(rewrite_asm(src[open_i + 1 : close_i], f"line {line}"))
        i = close_i + 1
    s = "".join(out)
    s = re.sub(
        r"extern\s+__shared__\s+(?:__align__\(\d+\)\s+)?([\w:]+)\s+(\w+)\s*\[\s*\]\s*;",
        r"\1* \2 = (\1*)cuemu::dyn_smem();",
        s,
    )
    s = re.sub(r"\b__shared__\b", "static", s)
    s = re.sub(r'\bextern\s+"C"\s*', "", s)
    if re.search(r"^\s*#\s*include", s, re.M):
        raise SystemExit("the module source includes a header; cuemu expects a self-contained source")
    return f'#include "cuemu.h"\nnamespace {ns} {{\n{s}\n}}  // namespace {ns}\n'


if __name__ == "__main__":
    src_path, ns, out_path = sys.argv[1:4]
    with open(src_path) as f:
        src = f.read()
    with open(out_path, "w") as f:
        f.write(rewrite(src, ns))
