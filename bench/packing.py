"""CPU packing throughput: pack a realistic window's samples (every field, vision rows included)
into one uint8 buffer per destination, vs a plain torch.cat of the same bytes; and unpack + take
(reassembly) vs torch.cat. Prints a table and writes bench/results/packing.json.

  python bench/packing.py [--reps 5]"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import torch

from reorder import packing
from reorder import synthetic as syn
from reorder.layout import describe


def median_ms(fn, reps):
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t) * 1e3)
    return float(np.median(ts))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--features", type=int, default=1176)
    p.add_argument("--json", default=os.path.join(os.path.dirname(__file__), "results", "packing.json"))
    args = p.parse_args()
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    batch = syn.make_global_batch(rng, args.samples, 4096, features=args.features, mix="large", text_only=0.0)
    layout, shard = describe(batch, args.samples, vision_start_token_id=syn.VISION_START)
    index = np.arange(args.samples)[::-1].copy()  # every sample, reversed
    rows, imgs = int(shard.row_counts.sum()), int(shard.image_counts.sum())
    size = packing.nbytes(layout, len(index), rows, imgs, 0)
    buf = torch.empty(size, dtype=torch.uint8)
    pack_ms = median_ms(lambda: packing.pack(layout, shard, index, buf), args.reps)
    parts = [t.contiguous().reshape(-1).view(torch.uint8) for t in list(shard.dense.values()) + list(shard.ragged.values())]
    cat_out = torch.empty(sum(x.numel() for x in parts), dtype=torch.uint8)
    cat_ms = median_ms(lambda: torch.cat(parts, out=cat_out), args.reps)  # preallocated, like pack
    cat_alloc_ms = median_ms(lambda: torch.cat(parts), args.reps)  # fresh output, like take
    back = packing.unpack(layout, buf, len(index), shard.row_counts[index], shard.image_counts[index], [])
    take_ms = median_ms(lambda: packing.take(layout, [back], index), args.reps)
    gb = size / 1e9
    result = dict(bytes=size, pack_ms=pack_ms, cat_ms=cat_ms, take_ms=take_ms, pack_gbps=gb / pack_ms * 1e3,
                  cat_gbps=gb / cat_ms * 1e3, cat_alloc_ms=cat_alloc_ms, cat_alloc_gbps=gb / cat_alloc_ms * 1e3,
                  take_gbps=gb / take_ms * 1e3, pack_over_cat=pack_ms / cat_ms,
                  threads=1, samples=args.samples, patch_rows=rows)
    print(f"{'op':28} {'ms':>8} {'GB/s':>7}   ({size / 2**20:.1f} MiB, {args.samples} samples, {rows} patch rows, 1 thread)")
    print(f"{'pack (runs, one cat for all fields)':28} {pack_ms:8.2f} {result['pack_gbps']:7.2f}")
    print(f"{'torch.cat, preallocated out':28} {cat_ms:8.2f} {result['cat_gbps']:7.2f}")
    print(f"{'torch.cat, fresh output':28} {cat_alloc_ms:8.2f} {result['cat_alloc_gbps']:7.2f}")
    print(f"{'unpack + take (reassembly)':28} {take_ms:8.2f} {result['take_gbps']:7.2f}")
    print(f"pack / cat (both preallocated) = {result['pack_over_cat']:.2f}; take / fresh cat = "
          f"{take_ms / cat_alloc_ms:.2f}")
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
