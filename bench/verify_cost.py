"""What the runtime self-check costs: a window's host time (and, on CUDA, its device time) with the
check off, on every 100th window and on every window, side by side in one process (the settings
alternate window by window, so drift hits all alike). A dp-1 module: its window runs every step
of the check (checksums where the samples are read, the frame, the comparison on what was
assembled) without a collective; the micro-batches are realistic Qwen-VL ones from pinned host
memory (on CUDA) or the host.

  PYTHONPATH=. python bench/verify_cost.py [--device cuda] [--micro-batch 16] [--windows 200] [--json F]

Prints one row per setting: median host ms per window, mean device ms per window (CUDA events),
and the ratio to off; writes JSON."""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from bench.common import code_commit, cpu_name
from reorder import CostModel, Grid, WindowExchanger
from reorder.cli import synthetic as syn

SETTINGS = {"off": 0, "every 100th": 100, "every window": 1}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--features", type=int, default=1176)
    p.add_argument("--mix", default="realistic")
    p.add_argument("--windows", type=int, default=200, help="timed windows per setting")
    p.add_argument("--json")
    args = p.parse_args()
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    rng = np.random.default_rng(0)
    batches = [syn.make_global_batch(rng, args.micro_batch, args.seq_len, features=args.features, mix=args.mix,
                                     first_id=k * args.micro_batch) for k in range(8)]
    if cuda:
        batches = [syn.pin(b) for b in batches]
    cost = CostModel(image_token_id=syn.IMAGE_TOKEN, vision_start_token_id=syn.VISION_START)
    ex = {name: WindowExchanger(grid=Grid(size=4, dp=1, rank=0), micro_batch_size=args.micro_batch, cost=cost,
                                device=dev, verify=n) for name, n in SETTINGS.items()}
    host = {name: [] for name in SETTINGS}
    device = {name: [] for name in SETTINGS}
    for k in range(args.windows + 10):  # 10 untimed rounds first (Triton compiles, caches fill)
        for name, e in ex.items():
            b = batches[k % len(batches)]
            if cuda:
                torch.cuda.synchronize(dev)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            t0 = time.perf_counter()
            e.exchange([b])
            t1 = time.perf_counter()
            if cuda:
                end.record()
                torch.cuda.synchronize(dev)
            if k >= 10:
                host[name].append((t1 - t0) * 1e3)
                if cuda:
                    device[name].append(start.elapsed_time(end))
    rows = {}
    for name in SETTINGS:
        h = float(np.median(host[name]))
        d = float(np.mean(device[name])) if cuda else None
        rows[name] = dict(host_ms=h, host_ratio=h / float(np.median(host["off"])),
                          device_ms=d, device_ratio=None if d is None else d / float(np.mean(device["off"])))
    print(f"{'self-check':14} {'host ms':>9} {'x off':>7} {'device ms':>10} {'x off':>7}")
    for name, r in rows.items():
        dms = "-" if r["device_ms"] is None else f"{r['device_ms']:.3f}"
        dra = "-" if r["device_ratio"] is None else f"{r['device_ratio']:.3f}"
        print(f"{name:14} {r['host_ms']:9.3f} {r['host_ratio']:7.3f} {dms:>10} {dra:>7}")
    out = dict(device=torch.cuda.get_device_name(dev) if cuda else cpu_name(), commit=code_commit(),
               micro_batch=args.micro_batch, seq_len=args.seq_len, features=args.features, mix=args.mix,
               windows=args.windows, settings=rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
