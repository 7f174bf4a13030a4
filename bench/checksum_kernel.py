"""The self-check's checksum kernel alone, over its lanes a program (BLOCK), words a program (CHUNK)
and the grid a launch strides with (4 or 16 programs a multiprocessor, the captured launch's; or one
program each): device ms a window and GB/s of the buffers summed, on the window the round sums on
CUDA (what a dp-1 rank read and what it assembled, W realistic Qwen-VL micro-batches on the GPU).
Every variant's sums must equal the first's. CUDA only; it picks `checksum.BLOCK` and the grid of
`checksum.Graphs`.

  PYTHONPATH=. python bench/checksum_kernel.py [--window 8] [--blocks 256,512,1024,2048]
                                               [--chunks 4096,16384,65536] [--reps 20] [--json F]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import numpy as np
import torch

from bench.common import code_commit, synchronizer
from reorder import CostModel, Grid, WindowExchanger
from reorder.batch import checksum
from reorder.cli import synthetic as syn
from reorder.exchange import round as round_module


def window_parts(dev: torch.device, window: int) -> tuple:
    """(parts, fields) of the round's launch after the assembly of a checked window (every window of
    the same micro-batches alike)."""
    rng = np.random.default_rng(0)
    batches = [syn.to_device(syn.make_global_batch(rng, 16, 4096, features=1176, mix="realistic",
                                                   first_id=16 * k), dev) for k in range(window)]
    cost = CostModel(image_token_id=syn.IMAGE_TOKEN, vision_start_token_id=syn.VISION_START)
    given, real = [], round_module.window_checksums

    def keep(parts, fields, device, **kw):
        given.append((parts, fields))
        return real(parts, fields, device, **kw)

    round_module.window_checksums = keep
    try:
        ex = WindowExchanger(grid=Grid(size=4, dp=1, rank=0), micro_batch_size=16, cost=cost, window_size=window,
                             device=dev, verify=1)
        ex.exchange(batches)
    finally:
        round_module.window_checksums = real
    synchronizer(dev)()
    return given[-1]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--window", type=int, default=8, help="micro-batches per window")
    p.add_argument("--blocks", default="256,512,1024,2048")
    p.add_argument("--chunks", default="4096,16384,65536")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--json")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/checksum_kernel.py times the Triton kernel on a CUDA device: none is available")
    dev = torch.device("cuda", torch.cuda.current_device())
    parts, fields = window_parts(dev, args.window)
    nbytes = sum(t.nbytes for bufs, _ in parts for t in bufs if t is not None)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    kernel = checksum._kernel()
    rows, want = [], None
    print(f"window of {args.window} micro-batches: {len(parts)} parts, {nbytes / 1e6:.1f} MB summed; "
          f"{sms} multiprocessors")
    print(f"{'BLOCK':>6} {'CHUNK':>6} {'grid':>12} {'programs':>8} {'ms':>7} {'GB/s':>6}  same sums")
    for block, chunk in itertools.product(map(int, args.blocks.split(",")), map(int, args.chunks.split(","))):
        if chunk % block:
            continue
        words, programs, at = checksum.launch_block(parts, fields, None, chunk)
        data = torch.from_numpy(words.copy()).to(dev)
        consts = dict(SLOTS=checksum.CHECKED_FIELDS, CHUNK=chunk, BLOCK=block, SAMPLES=at["samples"])
        compiled = kernel.warmup(data, **consts, grid=(programs,), num_warps=4)
        for name, grid in (("4 a SM", 4 * sms), ("16 a SM", 16 * sms), ("one each", programs)):
            def launch():
                data[at["out_at"]:] = 0
                compiled[(grid, 1, 1)](data, *consts.values())

            launch()
            torch.cuda.synchronize(dev)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(args.reps):
                launch()
            end.record()
            torch.cuda.synchronize(dev)
            ms = start.elapsed_time(end) / args.reps
            sums = data[at["out_at"]:].cpu()
            want = sums if want is None else want
            same = torch.equal(sums, want)
            rows.append(dict(block=block, chunk=chunk, grid=name, programs=programs, launched=grid, ms=ms,
                             gb_per_s=nbytes / ms / 1e6, same=same))
            print(f"{block:6} {chunk:6} {name:>12} {programs:8} {ms:7.3f} {nbytes / ms / 1e6:6.0f}  {same}")
    best = min(rows, key=lambda r: r["ms"])
    print(f"fastest: BLOCK {best['block']}, CHUNK {best['chunk']}, {best['grid']}: {best['ms']:.3f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(dev), commit=code_commit(), window=args.window,
                           bytes=nbytes, rows=rows), f, indent=1)
    if not all(r["same"] for r in rows):
        sys.exit("some variant's sums differ")


if __name__ == "__main__":
    main()
