"""What reordering costs a launch-bound training loop on the host (CPU, no GPU needed).

The consumer runs a "step" of many tiny torch ops (the training thread busy in Python and dispatch,
as in a launch-bound model), pulling micro-batches from a dp-1 `ReorderingBuffer` whose cost-benefit
gate keeps every window, in each mode side by side in one process (modes interleaved over rounds):
reorder off, synchronous, synchronous + gate, synchronous + gate + backoff, and the same three with
overlap. Reported: median ms per step and the overhead against off (what the per-window host work
and, with overlap, the worker thread's share of the GIL cost the loop); per mode, the mean of its
per-round difference to off (rounds pair the modes) with a 95 % bootstrap interval; and the best
mode: the lowest mean difference, "slower beyond noise" when its whole interval lies above 0.

  PYTHONPATH=. python bench/launch_bound.py [--steps 120] [--rounds 7] [--ops 800] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from bench.common import code_commit, cpu_name
from reorder import CostModel, WindowExchanger
from reorder.cli import synthetic as syn
from reorder.runtime.buffer import ReorderingBuffer
from reorder.plan.grid import Grid

MODES = ("off", "sync", "sync+gate", "sync+gate+backoff", "overlap", "overlap+gate", "overlap+gate+backoff")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--ops", type=int, default=800, help="tiny torch ops per step (sets the step time)")
    p.add_argument("--gate-backoff", type=int, default=8)
    p.add_argument("--resamples", type=int, default=10000, help="bootstrap resamples of the 95 %% interval")
    p.add_argument("--json")
    args = p.parse_args()
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    batches = [syn.make_global_batch(rng, 4, 256, features=8, mix="small", first_id=4 * k) for k in range(args.steps)]
    cost = CostModel(image_token_id=syn.IMAGE_TOKEN, vision_start_token_id=syn.VISION_START)
    x = torch.randn(32, 32)

    def step():
        y = x
        for _ in range(args.ops):
            y = y * 1.0001 + 0.0

    def per_step_ms(mode):
        if mode == "off":
            it = iter(batches)
        else:
            gate = "+gate" in mode
            ex = WindowExchanger(grid=Grid(size=2, dp=1, rank=0), micro_batch_size=4, cost=cost,
                                 min_saving=1e18 if gate else None,
                                 gate_backoff=args.gate_backoff if mode.endswith("+backoff") else 0)
            it = ReorderingBuffer(iter(batches), ex, overlap=mode.startswith("overlap"))
        t = time.perf_counter()
        n = 0
        for _ in it:
            step()
            n += 1
        if n != len(batches):
            raise RuntimeError(f"{mode}: {n} of {len(batches)} micro-batches")
        if mode != "off":
            it.close()
        return (time.perf_counter() - t) / n * 1e3

    runs = {m: [] for m in MODES}
    for r in range(args.rounds):  # interleaved, alternating direction: drift hits every mode alike
        for m in (MODES if r % 2 == 0 else MODES[::-1]):
            runs[m].append(per_step_ms(m))
    off = float(np.median(runs["off"]))
    rows = {}
    for m, v in runs.items():
        d = np.array(v) - np.array(runs["off"])
        lo, hi = bootstrap_interval(d, args.resamples)
        rows[m] = dict(ms_per_step=float(np.median(v)), overhead_ms=float(np.median(v)) - off,
                       overhead_paired_ms=float(np.median(d)), paired_mean_ms=float(d.mean()),
                       paired_ci95_ms=[lo, hi])
    best = min((m for m in MODES if m != "off"), key=lambda m: rows[m]["paired_mean_ms"])
    verdict = dict(mode=best, paired_mean_ms=rows[best]["paired_mean_ms"], paired_ci95_ms=rows[best]["paired_ci95_ms"],
                   slower_beyond_noise=rows[best]["paired_ci95_ms"][0] > 0)
    print(f"{'mode':22} {'ms/step':>8} {'overhead ms':>12} {'paired':>8} {'paired mean [95 % interval]':>30}")
    for m, r in rows.items():
        lo, hi = r["paired_ci95_ms"]
        print(f"{m:22} {r['ms_per_step']:8.3f} {r['overhead_ms']:+12.3f} {r['overhead_paired_ms']:+8.3f} "
              f"{r['paired_mean_ms']:+12.3f} [{lo:+.3f}, {hi:+.3f}]")
    print(f"best mode vs off: {best} {verdict['paired_mean_ms']:+.3f} ms per step, 95 % interval "
          f"[{verdict['paired_ci95_ms'][0]:+.3f}, {verdict['paired_ci95_ms'][1]:+.3f}]: "
          f"{'slower beyond noise' if verdict['slower_beyond_noise'] else 'not slower beyond noise'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=cpu_name(), commit=code_commit(), steps=args.steps, rounds=args.rounds, ops=args.ops,
                           modes=rows, best=verdict), f, indent=2)


def bootstrap_interval(d, resamples: int, level: float = 0.95, seed: int = 0) -> list:
    """[low, high]: the percentile bootstrap interval of the mean of `d` (seeded, so a rerun on the
    same figures gives the same interval); [nan, nan] for fewer than two figures."""
    d = np.asarray(d, dtype=np.float64)
    if len(d) < 2:
        return [float("nan"), float("nan")]
    means = d[np.random.default_rng(seed).integers(0, len(d), size=(resamples, len(d)))].mean(axis=1)
    return [float(q) for q in np.percentile(means, [50 * (1 - level), 50 * (1 + level)])]


if __name__ == "__main__":
    main()
