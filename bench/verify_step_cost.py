"""What the runtime self-check costs a training step: micro-batches served by a ReorderingBuffer (dp 1,
window W) to a loop whose every step runs a fixed GPU workload on them, with the check off and on every
window, with overlap on (the exchange in the background, the default) and off, side by side in one
process (the four rows take turns, a block of steps each, so drift hits all alike).

`bench/verify_cost.py` times one window alone on an idle GPU: its device time is then its host time,
the worst case. Here the window shares the step with the step's own work, as in training: its host
steps run while the GPU computes (overlap on: on the worker thread, competing for the GIL only; off:
the consumer's host runs ahead of the GPU unless the window waits for it), and its kernels share the
GPU with the step's. The step's work is bf16 matmuls (float32 on the CPU) sized to --step-ms per
micro-batch, reading the micro-batch (a sum of its input_ids), with nothing synchronizing the host.

  PYTHONPATH=. python bench/verify_step_cost.py [--device cuda] [--inputs pinned|device] [--early-copy]
                                                [--window 1] [--step-ms 10] [--steps 40] [--blocks 6] [--json F]

Prints one row per setting: median ms a step over the blocks (CUDA events around a block on the
consumer's stream, the host synchronized at block ends only; elsewhere host time), its ratio to the
same overlap's row without the check, and the windows the check verified; writes JSON.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import numpy as np
import torch

from bench.common import code_commit, cpu_name, synchronizer
from bench.verify_cost import add_input_args, inputs_of, micro_batches
from reorder import CostModel, Grid, WindowExchanger
from reorder.cli import synthetic as syn
from reorder.runtime.buffer import ReorderingBuffer

ROWS = (("overlap off, check off", False, 0), ("overlap off, every window", False, 1),
        ("overlap on, check off", True, 0), ("overlap on, every window", True, 1))


class Work:
    """The step's fixed GPU work: `n` square matmuls, `n` chosen for about `ms` a step."""

    def __init__(self, dev: torch.device, side: int, ms: float, sync):
        self.a = torch.randn(side, side, device=dev, dtype=torch.bfloat16 if dev.type == "cuda" else torch.float32)
        self.out = torch.empty_like(self.a)
        self.seen = torch.zeros((), device=dev, dtype=torch.int64)
        for _ in range(3):
            torch.matmul(self.a, self.a, out=self.out)
        sync()
        t0 = time.perf_counter()
        for _ in range(10):
            torch.matmul(self.a, self.a, out=self.out)
        sync()
        self.n = max(1, round(ms / ((time.perf_counter() - t0) * 100)))

    def step(self, mb: dict) -> None:
        self.seen += mb["input_ids"].sum()  # the step reads its micro-batch: it waits for the window's copies
        for _ in range(self.n):
            torch.matmul(self.a, self.a, out=self.out)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_input_args(p)
    p.add_argument("--window", type=int, default=1, help="micro-batches per window")
    p.add_argument("--step-ms", type=float, default=10.0, help="the step's own work a micro-batch, ms")
    p.add_argument("--matmul", type=int, default=4096, help="side of the step's square matmuls")
    p.add_argument("--steps", type=int, default=40, help="steps a block (a multiple of --window)")
    p.add_argument("--blocks", type=int, default=6, help="timed blocks a row, after one untimed")
    p.add_argument("--json")
    args = p.parse_args()
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    inputs = inputs_of(p, args, cuda)
    if args.steps % args.window:
        p.error(f"--steps {args.steps}: expected a multiple of --window {args.window}")
    sync = synchronizer(dev)
    batches = micro_batches(args, inputs, dev)
    cost = CostModel(image_token_id=syn.IMAGE_TOKEN, vision_start_token_id=syn.VISION_START)
    work = Work(dev, args.matmul, args.step_ms, sync)
    ex, bufs, its = {}, [], {}
    for name, overlap, verify in ROWS:
        ex[name] = WindowExchanger(grid=Grid(size=4, dp=1, rank=0), micro_batch_size=args.micro_batch, cost=cost,
                                   window_size=args.window, device=dev, verify=verify,
                                   early_copy=args.early_copy)
        bufs.append(ReorderingBuffer(itertools.cycle(batches), ex[name], overlap=overlap))
        its[name] = iter(bufs[-1])
    ms = {name: [] for name, _, _ in ROWS}
    try:
        for block in range(args.blocks + 1):
            for name, _, _ in ROWS:
                sync()
                if cuda:
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    work.step(next(its[name]))
                if cuda:
                    end.record()
                sync()
                if block:  # the first block of each row is untimed: compiles, captures, caches
                    ms[name].append((start.elapsed_time(end) if cuda else (time.perf_counter() - t0) * 1e3)
                                    / args.steps)
    finally:
        for buf in bufs:
            buf.close()
    rows = {}
    for name, overlap, verify in ROWS:
        base = float(np.median(ms[f"overlap {'on' if overlap else 'off'}, check off"]))
        m = float(np.median(ms[name]))
        rows[name] = dict(overlap=overlap, verify=verify, step_ms=m, ratio=m / base, blocks_ms=ms[name],
                          verified_windows=ex[name].verified_windows, early_copy=ex[name].early_copy)
    print(f"micro-batches: {inputs}{', copied early' if args.early_copy else ''}, {args.window} per window of "
          f"{args.micro_batch} samples; the step's own work "
          f"{work.n} matmuls of {args.matmul} (~{args.step_ms} ms a micro-batch); {args.blocks} blocks of "
          f"{args.steps} steps a row, {'device' if cuda else 'host'} time")
    print(f"{'setting':28} {'ms a step':>10} {'x check off':>12} {'windows verified':>17}")
    for name, r in rows.items():
        print(f"{name:28} {r['step_ms']:10.3f} {r['ratio']:12.3f} {r['verified_windows']:>17}")
    out = dict(device=torch.cuda.get_device_name(dev) if cuda else cpu_name(), commit=code_commit(), inputs=inputs,
               early_copy=args.early_copy, window=args.window, micro_batch=args.micro_batch, seq_len=args.seq_len,
               features=args.features, mix=args.mix, step_ms=args.step_ms, matmuls=work.n, matmul=args.matmul,
               steps=args.steps, blocks=args.blocks, settings=rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
