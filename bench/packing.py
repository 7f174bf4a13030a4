"""Packing throughput: pack a realistic window's samples (every field, vision rows included) into
one uint8 buffer, vs a plain torch.cat of the same bytes and one copy_ per field (memcpy); and
unpack + take (reassembly) vs torch.cat. With --device cuda (synchronized timings) also: take from
pinned host memory straight to the device vs `.to(device)` of every field. Prints a table and
writes bench/results/packing.json (packing_cuda.json on a GPU).

  python bench/packing.py [--reps 5] [--device cuda]"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import torch

from reorder.batch import packing
from reorder.cli import synthetic as syn
from reorder.batch.layout import describe


def median_ms(fn, reps):
    ts = []
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    fn()
    for _ in range(reps):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        ts.append((time.perf_counter() - t) * 1e3)
    return float(np.median(ts))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--features", type=int, default=1176)
    p.add_argument("--device", default="cpu")
    p.add_argument("--json")
    args = p.parse_args()
    dev = torch.device(args.device)
    name = "packing.json" if dev.type == "cpu" else f"packing_{dev.type}.json"
    args.json = args.json or os.path.join(os.path.dirname(__file__), "results", name)
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    host = syn.make_global_batch(rng, args.samples, 4096, features=args.features, mix="large", text_only=0.0)
    batch = syn.to_device(host, dev)
    layout, shard = describe(batch, args.samples, vision_start_token_id=syn.VISION_START)
    index = np.arange(args.samples)[::-1].copy()  # every sample, reversed
    rows, imgs = int(shard.row_counts.sum()), int(shard.image_counts.sum())
    size = packing.nbytes(layout, len(index), rows, imgs, 0)
    buf = torch.empty(size, dtype=torch.uint8, device=dev)
    pack_ms = median_ms(lambda: packing.pack(layout, shard, index, buf), args.reps)
    parts = [t.contiguous().reshape(-1).view(torch.uint8) for t in list(shard.dense.values()) + list(shard.ragged.values())]
    cat_out = torch.empty(sum(x.numel() for x in parts), dtype=torch.uint8, device=dev)
    cat_ms = median_ms(lambda: torch.cat(parts, out=cat_out), args.reps)  # preallocated, like pack
    dst = [cat_out[a - x.numel():a] for x, a in zip(parts, np.cumsum([x.numel() for x in parts]).tolist())]
    copy_ms = median_ms(lambda: [d.copy_(x) for d, x in zip(dst, parts)], args.reps)  # memcpy per field
    foreach_ms = median_ms(lambda: torch._foreach_copy_(dst, parts), args.reps)  # one fused multi-tensor copy
    cat_alloc_ms = median_ms(lambda: torch.cat(parts), args.reps)  # fresh output, like take
    back = packing.unpack(layout, buf, len(index), shard.row_counts[index], shard.image_counts[index], [])
    take_ms = median_ms(lambda: packing.take(layout, [back], index), args.reps)
    extra = {}
    if dev.type == "cuda":  # from pinned host memory (what a data loader delivers) to the device
        pinned = syn.pin(host)
        _, hshard = describe(pinned, args.samples, vision_start_token_id=syn.VISION_START)
        extra["take_from_pinned_ms"] = median_ms(lambda: packing.take(layout, [hshard], index, dev), args.reps)
        fields = list(hshard.dense.values()) + list(hshard.ragged.values())
        extra["to_device_ms"] = median_ms(lambda: [t.to(dev, non_blocking=True) for t in fields], args.reps)
    gb = size / 1e9
    result = dict(bytes=size, pack_ms=pack_ms, cat_ms=cat_ms, take_ms=take_ms, pack_gbps=gb / pack_ms * 1e3,
                  cat_gbps=gb / cat_ms * 1e3, cat_alloc_ms=cat_alloc_ms, cat_alloc_gbps=gb / cat_alloc_ms * 1e3,
                  take_gbps=gb / take_ms * 1e3, pack_over_cat=pack_ms / cat_ms, copy_ms=copy_ms,
                  copy_gbps=gb / copy_ms * 1e3, foreach_ms=foreach_ms, foreach_gbps=gb / foreach_ms * 1e3,
                  pack_over_copy=pack_ms / copy_ms, device=str(dev) if dev.type == "cpu"
                  else torch.cuda.get_device_name(dev), threads=1, samples=args.samples, patch_rows=rows, **extra)
    print(f"{'op':28} {'ms':>8} {'GB/s':>7}   ({size / 2**20:.1f} MiB, {args.samples} samples, {rows} patch rows, 1 thread)")
    print(f"{'pack (all fields, one buffer)':28} {pack_ms:8.2f} {result['pack_gbps']:7.2f}")
    print(f"{'torch.cat, preallocated out':28} {cat_ms:8.2f} {result['cat_gbps']:7.2f}")
    print(f"{'copy_ per field (memcpy)':28} {copy_ms:8.2f} {result['copy_gbps']:7.2f}")
    print(f"{'_foreach_copy_ of the fields':28} {foreach_ms:8.2f} {result['foreach_gbps']:7.2f}")
    print(f"{'torch.cat, fresh output':28} {cat_alloc_ms:8.2f} {result['cat_alloc_gbps']:7.2f}")
    print(f"{'unpack + take (reassembly)':28} {take_ms:8.2f} {result['take_gbps']:7.2f}")
    for k, v in extra.items():
        print(f"{k:28} {v:8.2f} {gb / v * 1e3:7.2f}")
    print(f"pack / cat (both preallocated) = {result['pack_over_cat']:.2f}; pack / memcpy = "
          f"{result['pack_over_copy']:.2f}; take / fresh cat = {take_ms / cat_alloc_ms:.2f}")
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
