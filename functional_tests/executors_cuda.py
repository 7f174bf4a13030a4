"""Both executors byte-exact on a GPU: random segment tables (device and pinned host sources, every
alignment) through the Triton executor and the torch executor against a host oracle, then whole
dp-1 windows through the exchanger with each executor against the spec's per-sample bytes; then
each Triton kernel (copy, counting) must have compiled once: a table offset that is a multiple of
16 or not, or another micro-batch, must not compile a new variant mid-run.

  python functional_tests/executors_cuda.py [--tables 200] [--windows 16]
Prints one line per check and a summary dict; exits 1 on any mismatch."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from reorder import CostModel, Grid, WindowExchanger  # noqa: E402
from reorder.batch.triton_count import count_rows  # noqa: E402
from reorder.cli import synthetic as syn  # noqa: E402
from reorder.exchange.executors import TorchExecutor, TritonExecutor, launch_table  # noqa: E402
from reorder.exchange.triton_copy import copy_segments  # noqa: E402
from reorder.plan.segments import Segments  # noqa: E402
from spec.samples import per_sample_bytes  # noqa: E402


def random_table(rng, n_src, n_dst):
    """Random source buffers (bytes) and a table writing disjoint destination ranges."""
    srcs = [rng.integers(0, 256, int(rng.integers(1, 1 << 16)), dtype=np.uint8) for _ in range(n_src)]
    dst_sizes = [int(rng.integers(1, 1 << 16)) for _ in range(n_dst)]
    rows = []
    for d, size in enumerate(dst_sizes):
        at = int(rng.integers(0, 32))
        while at < size:
            s = int(rng.integers(n_src))
            n = int(min(rng.integers(1, 1 << 12), size - at, len(srcs[s])))
            rows.append((s, int(rng.integers(0, len(srcs[s]) - n + 1)), d, at, n))
            at += n + int(rng.integers(0, 64))
    return srcs, dst_sizes, Segments.of(*zip(*rows)) if rows else Segments.empty()


def oracle(srcs, dst_sizes, table):
    out = [bytearray(b"\x5a" * n) for n in dst_sizes]
    for s, so, d, do, n in zip(*(a.tolist() for a in (table.src_buf, table.src_off, table.dst_buf, table.dst_off,
                                                       table.nbytes))):
        out[d][do:do + n] = bytes(srcs[s][so:so + n])
    return [bytes(b) for b in out]


def check_tables(args, dev, offsets: set) -> int:
    """Mismatches over random tables; `offsets` collects whether each table's offset of its segment
    rows in the launch table (twice its block count) was a multiple of 16."""
    rng, bad = np.random.default_rng(0), 0
    executors = (TritonExecutor(), TorchExecutor())
    for k in range(args.tables):
        srcs, dst_sizes, table = random_table(rng, int(rng.integers(1, 5)), int(rng.integers(1, 4)))
        blocks = launch_table(table, np.zeros(len(srcs), np.int64), np.zeros(len(dst_sizes), np.int64),
                              executors[0].block_bytes)[2]
        offsets.add(2 * blocks % 16 == 0)
        want = oracle(srcs, dst_sizes, table)
        pinned = k % 2 == 1
        for ex in executors:
            sources = [torch.from_numpy(s.copy()) for s in srcs]
            sources = [t.pin_memory() if pinned else t.to(dev) for t in sources]
            if pinned and not ex.reads_pinned_host:
                sources = [t.to(dev) for t in sources]
            dsts = [torch.full((n,), 0x5A, dtype=torch.uint8, device=dev) for n in dst_sizes]
            ex.run(table, sources, dsts)
            torch.cuda.synchronize(dev)
            if [bytes(d.cpu().numpy()) for d in dsts] != want:
                bad += 1
                print(f"table {k} ({'pinned' if pinned else 'device'} sources): {ex.name} differs", flush=True)
    print(f"tables: {args.tables} x 2 executors, {bad} mismatches", flush=True)
    return bad


def check_windows(args, dev) -> int:
    cost = CostModel(image_token_id=syn.IMAGE_TOKEN, vision_start_token_id=syn.VISION_START)
    rng, bad = np.random.default_rng(1), 0
    for k in range(args.windows):
        g = syn.make_global_batch(rng, 8, 512, features=24, mix="small", text_only=0.2)
        g["note"] = [f"n{i}" * i for i in range(8)]
        src = syn.pin(g) if k % 2 else syn.to_device(g, dev)
        outs = []
        for ex_ in (TritonExecutor(), TorchExecutor()):
            ex = WindowExchanger(grid=Grid(size=4, dp=1, rank=0), micro_batch_size=8, cost=cost, device=dev,
                                 window_size=2)
            ex.round._executors[torch.device("cuda", dev.index or 0)] = ex_
            (a, b), rep = ex.exchange([src, src])
            outs.append((a, rep.orders[0]))
        want = per_sample_bytes(g, vision_start_token_id=syn.VISION_START)
        for (out, order), name in zip(outs, ("triton", "torch")):
            got = per_sample_bytes(syn.to_device(out, "cpu"), vision_start_token_id=syn.VISION_START)
            if got != [want[i] for i in order]:
                bad += 1
                print(f"window {k}: {name} executor output differs from the spec's bytes", flush=True)
    print(f"windows: {args.windows} x 2 executors, {bad} mismatches", flush=True)
    return bad


def compiled_variants(kernel) -> int:
    """Variants of a Triton kernel compiled in this process, over all devices (Triton 3.x keeps, per
    device, a tuple whose first entry is the dict of compiled variants)."""
    return sum(len(cache[0]) for cache in kernel.device_caches.values())


def check_compiles(offsets: set) -> int:
    """1 per kernel compiled more than once; 1 more when the tables did not cover table offsets both
    multiples of 16 and not (the case that compiled twice)."""
    copy, count = compiled_variants(copy_segments), compiled_variants(count_rows)
    print(f"compiled variants: copy kernel {copy} (table offsets multiples of 16: {sorted(offsets)}), "
          f"counting kernel {count}", flush=True)
    return int(copy != 1) + int(count != 1) + int(len(offsets) != 2)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--tables", type=int, default=200)
    p.add_argument("--windows", type=int, default=16)
    args = p.parse_args()
    dev = torch.device("cuda", torch.cuda.current_device())
    offsets = set()
    bad = check_tables(args, dev, offsets) + check_windows(args, dev)
    recompiled = check_compiles(offsets)
    print({"ok": bad + recompiled == 0, "tables": args.tables, "windows": args.windows,
           "compiled_once": recompiled == 0})
    bad += recompiled
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
