"""dp-1 reordering on one GPU, byte-exact: a dp-1 module (one process, no collective) permutes
realistic micro-batches that come (a) from pinned host memory, with and without `early_copy`,
(b) device-resident, (c) with grid_thw left on the host and `device=None`; every output sample must
equal the input sample the report's canonical order names, bit for bit (spec.samples), on
`--device`. Counting on the device (the Triton kernel where triton imports, else torch ops) must
give the host's counts and grid_thw. Also times (a), both ways, against what reorder off does with the same batch (every
tensor `.to(device)`).

  python functional_tests/dp1_cuda.py [--device cuda] [--features 1176] [--mix realistic]

Prints one RESULT line (ok, and the timings); exits 1 on any mismatch.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import torch

from bench.common import median_ms, synchronizer
from reorder import CostModel, WindowExchanger
from reorder.batch import counting
from reorder.cli import synthetic as syn
from reorder.plan.grid import Grid
from reorder.batch.layout import field_at, tensors
from reorder.batch.blocks import resolved
from spec.samples import per_sample_bytes
from reorder.batch.counting import count_samples


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--features", type=int, default=1176)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--mix", default="realistic")
    p.add_argument("--reps", type=int, default=16)
    args = p.parse_args()
    dev = torch.device(args.device)
    sync = synchronizer(dev)
    pin = syn.pin if dev.type == "cuda" else (lambda b: b)
    cost = CostModel(image_token_id=syn.IMAGE_TOKEN, vision_start_token_id=syn.VISION_START)
    bad, checked, counted, timings = [], 0, 0, {}
    for mb in (4, 32):
        rng = np.random.default_rng(mb)
        host = [syn.make_global_batch(rng, mb, args.seq_len, features=args.features, mix=args.mix, first_id=k * mb)
                for k in range(4)]
        want = [per_sample_bytes(g, vision_start_token_id=syn.VISION_START) for g in host]
        on_dev = [syn.to_device(g, dev) for g in host]
        mixed = [dict(d, modality_inputs={"images": {"vit": dict(
            d["modality_inputs"]["images"]["vit"], grid_thw=g["modality_inputs"]["images"]["vit"]["grid_thw"])}})
            for d, g in zip(on_dev, host)]
        pinned = [pin(g) for g in host]
        for k, (g, d) in enumerate(zip(host, on_dev)):
            thw = "modality_inputs", "images", "vit", "grid_thw"
            on_host = count_samples(cost, g["input_ids"], g["attention_mask"], grid_thw=field_at(g, thw))
            on_device = count_samples(cost, d["input_ids"], d["attention_mask"], grid_thw=field_at(d, thw))
            counted += 1
            if not all(np.array_equal(a, b) for a, b in zip(on_host, on_device)):
                bad.append(f"mb {mb} batch {k}: counts on {dev} differ from the host's")
        cases = {"pinned host -> device": (pinned, dev, False), "pinned host -> device, early_copy": (pinned, dev, True),
                 "device-resident": (on_dev, dev, False), "grid_thw on host, device None": (mixed, None, False)}
        for name, (batches, target, early) in cases.items():
            ex = WindowExchanger(grid=Grid(size=2, dp=1, rank=0), micro_batch_size=mb, cost=cost, device=target,
                                 early_copy=early)
            for k, batch in enumerate(batches):
                (out,), rep = ex.exchange([batch])
                got = per_sample_bytes(syn.to_device(out, "cpu"), vision_start_token_id=syn.VISION_START)
                checked += 1
                if got != [want[k][i] for i in rep.orders[0].tolist()]:
                    bad.append(f"mb {mb} batch {k} {name}")
                if target is not None and any(t.device != resolved(target) for t in tensors(out)):
                    bad.append(f"mb {mb} batch {k} {name}: a tensor is not on {target}")
        ex = WindowExchanger(grid=Grid(size=2, dp=1, rank=0), micro_batch_size=mb, cost=cost, device=dev)
        k = iter(range(10**9))
        timings[f"mb{mb}_from_pinned_ms"] = median_ms(lambda: ex.exchange([pinned[next(k) % 4]]), args.reps, sync)
        early = WindowExchanger(grid=Grid(size=2, dp=1, rank=0), micro_batch_size=mb, cost=cost, device=dev,
                                early_copy=True)
        timings[f"mb{mb}_from_pinned_early_copy_ms"] = median_ms(lambda: early.exchange([pinned[next(k) % 4]]),
                                                                 args.reps, sync)
        timings[f"mb{mb}_to_device_ms"] = median_ms(lambda: syn.to_device(pinned[next(k) % 4], dev, non_blocking=True),
                                                    args.reps, sync)
    ok = not bad and checked == 32 and counted == 8
    kernel = counting._KERNEL[0] is not None if counting._KERNEL else False
    print("RESULT", dict(ok=ok, checked=checked, counted=counted, counting_kernel=kernel, mismatches=bad, **{k: round(v, 3) for k, v in timings.items()}))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
