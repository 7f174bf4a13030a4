"""The checksum kernel's word loops as the GPU runs them, counted without a GPU: each path that sums
a piece of 8-byte words (`triton_checksum`: the library's `_piece_sum`, and the candidate's
`_entry_sum` and `_tile_sum`) is compiled alone for an NVIDIA target by Triton's compiler (its
bundled ptxas and nvdisasm), and its innermost loop that loads the words is read off the machine
code: instructions a word (the loop's instructions over its 64-bit loads, one word each), and how
many are integer multiplies (IMAD and its forms but IMAD.MOV, a move; a 64-bit multiply takes three
or four).

Then each whole kernel (the library's `checksum_window`, the candidate `checksum_window_shaped`):
its registers a lane, and how many of its programs fit on a multiprocessor by registers (65,536 of
them; at most 64 warps). A lane holds one step's words in flight (the library's), or two (the
candidate's paths load the next step's before summing this one): the programs a multiprocessor
holds times their lanes times that is what keeps memory busy, and a kernel that holds too little
waits on memory more than it computes. Static figures: they say nothing of stalls or clocks, and a
path runs only on the pieces it is chosen for (`_shaped_sum`); the GPU's own timing is
`bench/checksum_kernel.py`.

  PYTHONPATH=. python bench/checksum_sass.py [--arch 90] [--block 512] [--warps 4] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from bench.common import code_commit
from reorder.batch import triton_checksum as tc
from reorder.batch.checksum import BLOCK, CHECKED_FIELDS, CHUNK

PATHS = {0: "_piece_sum (library)", 1: "_entry_sum (shaped: one entry)", 2: "_tile_sum (shaped: many entries)"}


@triton.jit
def path_alone(args, PATH: tl.constexpr, BLOCK: tl.constexpr, COLS: tl.constexpr):
    """One path of the kernel over int64 words, its arguments read from `args` (runtime values, as
    in the kernel), its sum stored after them."""
    addr, stride, wpe = tl.load(args), tl.load(args + 1), tl.load(args + 2)
    salt, first, count = tl.load(args + 3), tl.load(args + 4), tl.load(args + 5)
    if PATH == 0:
        s = tc._piece_sum(addr, stride, wpe, salt, first, count, tl.int64, 8, BLOCK)
    elif PATH == 1:
        s = tc._entry_sum(addr, stride, wpe, salt, first, count, tl.int64, 8, BLOCK)
    else:
        s = tc._tile_sum(addr, stride, wpe, salt, first, count, tl.int64, 8, BLOCK, COLS)
    tl.store(args + 6, s)


def cubin(fn, constexprs: dict, arch: int, warps: int) -> bytes:
    """`fn` (one pointer argument, then `constexprs` by name) compiled for sm_`arch`."""
    src = ASTSource(fn=fn, signature={fn.arg_names[0]: "*i64", **{k: "constexpr" for k in constexprs}},
                    constexprs={(i + 1,): v for i, v in enumerate(constexprs.values())})
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps}).asm["cubin"]


def tool(name: str, binary: bytes, *args) -> str:
    """The output of Triton's bundled CUDA binary tool `name` on `binary`."""
    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(binary)
        f.flush()
        return subprocess.run([path, *args, f.name], capture_output=True, text=True, check=True).stdout


def sass_of(path: int, arch: int, block: int, warps: int) -> str:
    """`path_alone` for `path`, compiled for sm_`arch`, disassembled."""
    cols = 64 if block >= 256 else block // 4  # as `_shaped_sum` picks them
    return tool("nvdisasm", cubin(path_alone, dict(PATH=path, BLOCK=block, COLS=cols), arch, warps), "-c")


def registers(kernel, arch: int, block: int, warps: int) -> int:
    """Registers a lane of `kernel` (a `triton_checksum.KERNELS` entry) at the library's CHUNK."""
    usage = tool("cuobjdump", cubin(kernel, dict(SLOTS=CHECKED_FIELDS, CHUNK=CHUNK, BLOCK=block, SAMPLES=16),
                                    arch, warps), "--dump-resource-usage")
    return int(re.search(r"REG:(\d+)", usage).group(1))


def word_loop(sass: str) -> dict:
    """The innermost loop (a backward branch's span with no loop inside) that loads 64-bit words, as
    aligned words run it: its blocks (from label to label) that load bytes one by one (the path off
    the word alignment) left out. Its instructions, loads, instructions a word and multiplies a word."""
    code, labels = [], []
    for line in sass.splitlines():
        label = re.match(r"^(\.L_x_\d+):", line)
        if label:
            labels.append((label.group(1), len(code)))
        op = re.match(r"\s*/\*[0-9a-f]+\*/\s+(.*?)\s*;", line)
        if op:
            code.append(re.sub(r"^@!?U?P\w+\s+", "", op.group(1)))  # without its predicate
    at = dict(labels)
    loops = []
    for end, op in enumerate(code):
        target = re.search(r"BRA\s+`?\(?(\.L_x_\d+)", op)
        if target and at.get(target.group(1), end + 1) <= end:
            loops.append((at[target.group(1)], end + 1))
    found = []
    for a, b in loops:
        if any(a <= c and d <= b and (c, d) != (a, b) for c, d in loops):
            continue  # a loop inside: not the innermost
        cuts = sorted({a, b, *(i for _, i in labels if a < i < b)})
        body = [op for lo, hi in zip(cuts, cuts[1:]) for op in code[lo:hi]
                if not any(x.startswith("LDG") and not x.startswith("LDG.E.64") for x in code[lo:hi])]
        loads = sum(op.startswith("LDG.E.64") for op in body)
        if loads:
            multiplies = sum(op.startswith("IMAD") and not op.startswith("IMAD.MOV") for op in body)
            found.append(dict(instructions=len(body), loads=loads, per_word=len(body) / loads,
                              multiplies_per_word=multiplies / loads))
    if not found:
        raise ValueError("no loop of 64-bit loads in the machine code")
    return min(found, key=lambda r: r["instructions"])


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: H100, H200)")
    p.add_argument("--block", type=int, default=BLOCK, help="lanes a program (the kernel's BLOCK)")
    p.add_argument("--warps", type=int, default=4)
    p.add_argument("--json")
    args = p.parse_args()
    rows = {}
    print(f"sm_{args.arch}, BLOCK {args.block}, {args.warps} warps (Triton {triton.__version__})")
    print(f"{'path':34} {'loop':>5} {'loads':>5} {'a word':>7} {'IMAD a word':>11}")
    for path, name in PATHS.items():
        rows[name] = r = word_loop(sass_of(path, args.arch, args.block, args.warps))
        print(f"{name:34} {r['instructions']:5} {r['loads']:5} {r['per_word']:7.1f} {r['multiplies_per_word']:11.1f}")
    kernels = {}
    print(f"\n{'kernel':24} {'registers':>9} {'programs a multiprocessor':>26}")
    for name, kernel in tc.KERNELS.items():
        regs = registers(kernel, args.arch, args.block, args.warps)
        warps = min(64, 65536 // (-(-regs // 8) * 8 * 32))  # registers are given out 8 at a time, per warp
        kernels[name] = dict(registers=regs, programs_per_multiprocessor=warps // args.warps)
        print(f"{kernel.__name__:24} {regs:9} {warps // args.warps:26}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(arch=args.arch, block=args.block, warps=args.warps, triton=triton.__version__,
                           commit=code_commit(), paths=rows, kernels=kernels), f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
