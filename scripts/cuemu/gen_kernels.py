#!/usr/bin/env python3
"""Writes fake_kernels.inc for fakecuda.cpp: for every kernel of every rewritten module (the
functions its object defines in the module's namespace, from `nm -C`), a declaration, a
trampoline that unpacks cuLaunchKernel's argument pointers, and the argument sizes; and each
module's source hash (FNV-1a 64 of the exact source NVRTC is given), which maps a "compile"
to its module.

Usage: gen_kernels.py OUT.inc MODULE.cu:MODULE.o ...
"""
import re
import subprocess
import sys


def fnv(data):
    h = 1469598103934665603
    for b in data:
        h = ((h ^ b) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return h


def split_params(s):
    return [p.strip() for p in s.split(",")] if s.strip() else []


out_path, pairs = sys.argv[1], sys.argv[2:]
decls, tramps, table, hashes = [], [], [], []
n = 0
for pair in pairs:
    src, obj = pair.split(":")
    mod = re.sub(r"\.cu$", "", src.split("/")[-1])
    with open(src, "rb") as f:
        hashes.append(f'    {{"{mod}", "{fnv(f.read())}"}},')
    nm = subprocess.run(["nm", "-C", "--defined-only", obj], check=True, capture_output=True, text=True).stdout
    for line in nm.splitlines():
        parts = line.split(" ", 2)
        if len(parts) < 3 or parts[1] != "T":
            continue
        m = re.match(rf"^{mod}::(\w+)\((.*)\)$", parts[2])
        if not m:
            continue
        name, params = m.group(1), split_params(m.group(2))
        decls.append(f"namespace {mod} {{ void {name}({', '.join(params)}); }}")
        args = ", ".join(f"*({t}*)a[{i}]" for i, t in enumerate(params))
        tramps.append(f"static void tr{n}(void** a) {{ {mod}::{name}({args}); }}")
        sizes = ", ".join(f"sizeof({t})" for t in params)
        table.append(f'    {{"{mod}", "{name}", {{{sizes}}}, tr{n}}},')
        n += 1
with open(out_path, "w") as f:
    f.write("\n".join(decls) + "\n\n" + "\n".join(tramps) + "\n\n")
    f.write("const Kernel KERNELS[] = {\n" + "\n".join(table) + "\n};\n")
    f.write("const char* const MODULE_HASHES[][2] = {\n" + "\n".join(hashes) + "\n};\n")
print(f"{n} kernels in {len(pairs)} modules")
