#!/usr/bin/env python3
"""Static SASS profile of the engine's tensor-core loops, no GPU needed.

Reads a cubin (ptxas output of the PTX that `nvrtc_check --out` writes), disassembles every
kernel whose name matches a regular expression with `cuobjdump -sass`, and prints per kernel
its registers and spills (from the ptxas log, when given) and, for each innermost loop that
issues `mma` (HMMA) instructions, its instruction count, its HMMA count, the instructions of
any loops nested in it (they run once per trip, so the static count undercounts them) and the
most frequent opcodes. A staged kernel's innermost `mma` loop is one super-step of a pass.

Usage: sass_loops.py CUBIN REGEX [PTXAS_LOG]
"""

import collections
import re
import shutil
import subprocess
import sys


def sass(cubin):
    """Every kernel of the cubin and its instructions: {name: [(address, text)]}, from one
    disassembly."""
    exe = shutil.which("cuobjdump")
    if exe is None:
        sys.exit("sass_loops.py: cuobjdump not on PATH (scripts/sass_profile.sh sets it up)")
    out = subprocess.run([exe, "-sass", cubin], capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"sass_loops.py: cuobjdump failed on {cubin}: {out.stderr.strip()}")
    kernels, ins = {}, None
    for line in out.stdout.splitlines():
        m = re.search(r"Function : (\S+)", line)
        if m:
            ins = kernels.setdefault(m.group(1), [])
            continue
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if m and ins is not None:
            ins.append((int(m.group(1), 16), m.group(2)))
    return kernels


def loops(ins):
    """(first, last) instruction indices of every backward branch's loop."""
    at = {a: i for i, (a, _) in enumerate(ins)}
    found = []
    for i, (a, text) in enumerate(ins):
        m = re.search(r"BRA (0x[0-9a-f]+)", text)
        if m:
            target = int(m.group(1), 16)
            if target < a and target in at:
                found.append((at[target], i))
    return found


def opcode(text):
    return re.sub(r"^@!?U?P\S+\s+", "", text).split()[0].split(".")[0]


def ptxas_regs(log):
    regs, spills, name = {}, {}, None
    for line in open(log):
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if m:
            name = m.group(1)
        m = re.search(r"Used (\d+) registers", line)
        if m and name:
            regs[name] = int(m.group(1))
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and name:
            spills[name] = (int(m.group(1)), int(m.group(2)))
    return regs, spills


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    cubin, pattern = sys.argv[1], re.compile(sys.argv[2])
    regs, spills = ptxas_regs(sys.argv[3]) if len(sys.argv) > 3 else ({}, {})
    for k, ins in sorted(sass(cubin).items()):
        if not pattern.search(k):
            continue
        all_loops = loops(ins)
        mma = [lp for lp in all_loops if any("HMMA" in ins[j][1] for j in range(lp[0], lp[1] + 1))]
        inner = [lp for lp in mma if not any(o != lp and o[0] >= lp[0] and o[1] <= lp[1] for o in mma)]
        head = f"{k}: {len(ins)} instructions"
        if k in regs:
            st, ld = spills.get(k, (0, 0))
            head += f", {regs[k]} registers" + (f", spills {st}/{ld} bytes" if st or ld else "")
        print(head)
        for lo, hi in inner:
            body = ins[lo : hi + 1]
            nested = [o for o in all_loops if o != (lo, hi) and o[0] >= lo and o[1] <= hi]
            hmma = sum("HMMA" in t for _, t in body)
            ops = collections.Counter(opcode(t) for _, t in body).most_common(8)
            nest = f", nested loops {sum(o[1] - o[0] + 1 for o in nested)} instr" if nested else ""
            print(
                f"  loop {ins[lo][0]:#06x}: {len(body)} instr, {hmma} HMMA{nest} | "
                + ", ".join(f"{o} {n}" for o, n in ops)
            )


if __name__ == "__main__":
    main()
