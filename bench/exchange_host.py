"""Host time of one window exchange, without the wire: rank 0 of a dp-2 exchange replays the
collectives' results recorded from a real (emulated, two-thread) run, so what is timed is only
reorder's own Python/numpy/dispatch work per window. CPU only; toy payloads by default (host work
does not depend on the payload size).

  PYTHONPATH=. python bench/exchange_host.py [--per-rank 8] [--windows 1] [--reps 200] [--profile]

Prints per-stage medians (µs), aten ops dispatched per exchange by kind, and with --profile the
cProfile top entries; writes JSON (--json)."""

from __future__ import annotations

import argparse
import collections
import json
import time

import numpy as np
import torch

from bench.common import Count, code_commit, cpu_name
from reorder import CostModel, WindowExchanger
from reorder.cli import synthetic as syn
from reorder.exchange.collectives import run_emulated
from reorder.plan.grid import Grid


class Replay:
    """Collectives that return recorded results in order: no wire, no waiting. The first `once`
    results (the config frame, gathered before the first window only) are returned once, the rest
    cycle (one window's metadata and data)."""

    def __init__(self, rank, size, results, once=1):
        self.rank, self.size, self.results, self.once, self.k = rank, size, results, once, 0

    def _next(self):
        k = self.k if self.k < self.once else self.once + (self.k - self.once) % (len(self.results) - self.once)
        self.k += 1
        return self.results[k]

    def all_gather(self, t):
        return self._next()

    def all_to_all(self, send, send_splits, recv_splits):
        return self._next()


class Record:
    """Collectives that pass through to `inner` and keep every result."""

    def __init__(self, inner):
        self.inner, self.rank, self.size, self.results = inner, inner.rank, inner.size, []

    def all_gather(self, t):
        self.results.append(self.inner.all_gather(t))
        return self.results[-1]

    def all_to_all(self, send, send_splits, recv_splits):
        self.results.append(self.inner.all_to_all(send, send_splits, recv_splits))
        return self.results[-1]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--per-rank", type=int, default=8)
    p.add_argument("--windows", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--features", type=int, default=8)
    p.add_argument("--mix", default="small")
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--min-saving", type=float, default=None, help="gate threshold (1e18: every slot gated)")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--sort", default="tottime", help="cProfile sort key (tottime, cumulative)")
    p.add_argument("--json")
    args = p.parse_args()
    torch.set_num_threads(1)
    dp, b, w = 2, args.per_rank, args.windows
    B = dp * b
    rng = np.random.default_rng(3)
    globals_ = [syn.make_global_batch(rng, B, args.seq_len, features=args.features, mix=args.mix, first_id=k * B)
                for k in range(w)]
    shares = [[syn.rank_share(g, dp, r) for g in globals_] for r in range(dp)]
    cost = CostModel(image_token_id=syn.IMAGE_TOKEN, vision_start_token_id=syn.VISION_START)

    def make(rank, coll, profile=False):
        return WindowExchanger(grid=Grid(size=dp, dp=dp, rank=rank), micro_batch_size=B, cost=cost, window_size=w,
                               collectives=coll, profile_stages=profile, min_saving=args.min_saving)

    def record(rank, coll):  # one real exchange per rank (two threads); keep what the collectives returned
        rec = Record(coll)
        make(rank, rec).exchange(shares[rank])
        return rec.results

    recorded = run_emulated(dp, record)
    ex = make(0, Replay(0, dp, recorded[0]))
    _, rep = ex.exchange(shares[0])
    stages, totals = collections.defaultdict(list), []
    for _ in range(args.reps):
        t = time.perf_counter()
        _, rep = ex.exchange(shares[0])
        totals.append((time.perf_counter() - t) * 1e6)
        for k, v in rep.stage_ms.items():
            stages[k].append(v * 1e3)
    with Count() as c:
        ex.exchange(shares[0])
    kinds = collections.Counter()
    for op, n in c.ops.items():
        kinds[op.split(".")[1] if op.startswith("aten.") else op] += n
    out = dict(per_rank=b, windows=w, moved_samples=rep.moved_samples, exchange_us=float(np.median(totals)),
               stage_us={k: float(np.median(v)) for k, v in stages.items()},
               aten_ops=sum(c.ops.values()), ops_by_kind=dict(kinds.most_common()))
    print(f"host time of one exchange (rank 0 of dp 2, {b} per rank, W {w}, {rep.moved_samples} of "
          f"{rep.total_samples} samples move): {out['exchange_us']:.0f} µs")
    print("  stages (µs):", {k: round(v) for k, v in out["stage_us"].items()})
    print(f"  aten ops per exchange: {out['aten_ops']}:", dict(kinds.most_common(12)))
    if args.profile:
        import cProfile
        import pstats
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(args.reps):
            ex.exchange(shares[0])
        pr.disable()
        pstats.Stats(pr).sort_stats(args.sort).print_stats(30)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(out, device=cpu_name(), commit=code_commit()), f, indent=2)


if __name__ == "__main__":
    main()
