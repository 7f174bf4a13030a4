"""GPU exchange benchmark (torchrun --nproc-per-node 2 bench/exchange_gpu.py): realistic windows
(seq 4096, 0-4 images of 1k-16k patches x 1176 bf16 features, MRoPE) on dp 2; the whole synchronous
exchange next to a bare all_to_all_single of exactly the bytes it moved, in the same run; then the
exposed (consumer-side) time per micro-batch with overlap while a fake compute step runs.
Prints a table on rank 0 and writes JSON (--json)."""

from __future__ import annotations

import argparse
import functools
import json
import time

import numpy as np
import torch
import torch.distributed as dist

from bench.common import Count, init_torchrun, median_ms, synchronizer
from reorder import CostModel, Grid, WindowExchanger

from reorder.cli.synthetic import take
from reorder.plan.window import plan_window
from reorder.cli import synthetic as syn
from reorder.runtime.buffer import ReorderingBuffer
from reorder.exchange.dist import build_groups
from reorder.plan import wire
from reorder.plan.counts import COLUMNS
from reorder.batch.layout import grid_thw_of, tensors
from reorder.batch.counting import count_samples


_sync = synchronizer()  # the current GPU's, when there is one
timed = functools.partial(median_ms, sync=_sync)  # median ms of synchronized calls


def host_costs(dev, exchange_once):
    """What one exchange costs the host CPU: aten ops it dispatches (counted once) and the time of a
    view op, of a kernel launch (no sync) and of a small numpy op on this machine, in microseconds."""
    with Count() as c:
        exchange_once()
    x = torch.zeros(64, 8, device=dev)
    arr = np.arange(64)

    def per_call_us(fn, n=2000):
        fn()
        _sync()
        t = time.perf_counter()
        for _ in range(n):
            fn()
        us = (time.perf_counter() - t) / n * 1e6
        _sync()
        return us
    return dict(aten_ops_per_exchange=sum(c.ops.values()),
                kernel_ops_per_exchange=sum(v for k, v in c.ops.items() if not any(
                    w in k for w in ("view", "slice", "select", "alias", "detach", "squeeze", "unsqueeze",
                                     "_local_scalar", "lift_fresh", "permute", "expand", "split"))),
                view_op_us=per_call_us(lambda: x.narrow(0, 1, 2)),
                launch_us=per_call_us(lambda: torch.cat([x, x])),
                numpy_op_us=per_call_us(lambda: (arr == 3).sum()))


def live_at_peak(dev) -> tuple:
    """From the allocator's recorded history (allocations made while it was on): the peak of their
    live bytes, and what was alive then, grouped by where it was made (innermost reorder/bench
    frames) and by whether Python had already freed it (the allocator still waits for a stream that
    used it): (peak bytes, [(MiB, count, freed-but-pending, where)])."""
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    live, pending, total, best, best_live = {}, set(), 0, -1, {}
    for e in snap["device_traces"][dev.index]:
        if e["action"] == "alloc":
            live[e["addr"]] = e
            pending.discard(e["addr"])
            total += e["size"]
            if total > best:
                best, best_live = total, {a: (x, a in pending) for a, x in live.items()}
        elif e["action"] == "free_requested" and e["addr"] in live:
            pending.add(e["addr"])
        elif e["action"] == "free_completed" and e["addr"] in live:
            total -= live.pop(e["addr"])["size"]
            pending.discard(e["addr"])
    groups = {}
    for e, freed in best_live.values():
        frames = [f for f in e.get("frames", []) if "/reorder/" in f["filename"] or "/bench/" in f["filename"]]
        where = " < ".join(f"{f['filename'].rsplit('/', 1)[-1]}:{f['line']} {f['name']}" for f in frames[:3]) or "?"
        mib, n = groups.get((where, freed), (0.0, 0))
        groups[where, freed] = (mib + e["size"] / 2**20, n + 1)
    return best, sorted(((round(m, 1), n, freed, w) for (w, freed), (m, n) in groups.items()), reverse=True)[:12]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--per-rank", type=int, nargs="+", default=[8])
    p.add_argument("--windows", type=int, nargs="+", default=[1, 4])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--compute-ms", type=float, default=200.0, help="fake step time for the overlap run")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--features", type=int, default=1176, help="vision features per patch row (bf16)")
    p.add_argument("--mix", default="large", help="image-size mix (reorder.cli.synthetic.SIZE_MIXES)")
    p.add_argument("--matmul", type=int, default=8192, help="side of the fake compute step's square matmul")
    p.add_argument("--dp1-sizes", type=int, nargs="+", default=[4, 32], help="micro-batch sizes of the dp-1 run")
    p.add_argument("--profile", action="store_true", help="cProfile 20 synchronous exchanges from pinned host")
    p.add_argument("--json")
    args = p.parse_args()
    me, world, dev = init_torchrun()  # without a GPU: a CPU/Gloo smoke run of the same code (tests)
    cuda = dev.type == "cuda"
    pin = syn.pin if cuda else (lambda b: b)
    S, F = args.seq_len, args.features
    groups = build_groups({"language": [list(range(world))]}, device=dev, overlap=True)
    cost = CostModel()
    rows = []
    for per in args.per_rank:
        for w in args.windows:
            B = per * world
            rng = np.random.default_rng(1234)
            gl = [syn.make_global_batch(rng, B, S, features=F, mix=args.mix, first_id=k * B) for k in range(w)]
            mine = [{k: v for k, v in syn.rank_share(g, world, me).items()} for g in gl]
            on_dev = [syn.to_device(m, dev) for m in mine]
            ex = WindowExchanger(grid=groups.grid, micro_batch_size=B, cost=cost, window_size=w,
                                 collectives=groups.main, device=dev)
            _, rep = ex.exchange(on_dev)
            pinned = [pin(m) for m in mine]
            send_bytes = rep.sent_bytes
            counts = torch.tensor([send_bytes], dtype=torch.int64)
            allc = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
            dist.all_gather(allc, counts, group=groups.main.meta_group)
            # bare a2a of about the moved bytes: at dp 2 exactly this rank's send to its peer; beyond,
            # the largest rank's send spread evenly over its peers, from every rank (sizes must pair up)
            if world == 2:
                ins = [send_bytes if q != me else 0 for q in range(world)]
                outs = [int(allc[q]) if q != me else 0 for q in range(world)]
            else:
                chunk = -(-max(int(c) for c in allc) // (world - 1))
                ins = outs = [chunk if q != me else 0 for q in range(world)]
            send = torch.randint(0, 255, (sum(ins),), dtype=torch.uint8, device=dev)
            recv = torch.empty(sum(outs), dtype=torch.uint8, device=dev)

            def bare():
                dist.all_to_all_single(recv, send, outs, ins, group=groups.main.data_group)

            exch_ms = timed(lambda: ex.exchange(on_dev), args.reps)
            prof = WindowExchanger(grid=groups.grid, micro_batch_size=B, cost=cost, window_size=w,
                                   collectives=groups.main, device=dev, profile_stages=True)
            stages = [prof.exchange(on_dev)[1].stage_ms for _ in range(args.reps)]
            stage_ms = {k: float(np.median([st[k] for st in stages])) for k in stages[0]}
            a2a_ms = timed(bare, args.reps)
            t_host = timed(lambda: ex.exchange(pinned), args.reps)  # from pinned host batches (H2D inside)
            early = WindowExchanger(grid=groups.grid, micro_batch_size=B, cost=cost, window_size=w,
                                    collectives=groups.main, device=dev, early_copy=True)
            t_early = timed(lambda: early.exchange(pinned), args.reps)  # copy to the device while planning
            if per == args.per_rank[0] and w == args.windows[0]:
                host = host_costs(dev, lambda: ex.exchange(on_dev))
                if args.profile:  # where the host time of a synchronous exchange goes (rank 0 prints)
                    import cProfile
                    import io
                    import pstats
                    pr = cProfile.Profile()
                    pr.enable()
                    for _ in range(20):
                        ex.exchange(pinned)
                    _sync()
                    pr.disable()
                    text = io.StringIO()
                    pstats.Stats(pr, stream=text).sort_stats("tottime").print_stats(25)
                    profile_text = text.getvalue()
            meta = torch.zeros(wire.window_words(w, per, len(COLUMNS)), dtype=torch.int64)
            gloo_out = [torch.empty_like(meta) for _ in range(world)]
            gloo_ms = timed(lambda: dist.all_gather(gloo_out, meta, group=groups.main.meta_group), args.reps * 4)
            meta_ms = timed(lambda: groups.main.all_gather(meta), args.reps * 4)  # the metadata step's floor
            rows.append(dict(per_rank=per, window=w, moved_mib=rep.moved_bytes / 2**20, sent_mib=send_bytes / 2**20,
                             exchange_ms=exch_ms, a2a_ms=a2a_ms, ratio=exch_ms / a2a_ms if a2a_ms else None,
                             target_ms=1.3 * a2a_ms + 1.0, gloo_all_gather_ms=gloo_ms, meta_all_gather_ms=meta_ms,
                             exchange_from_host_ms=t_host, exchange_from_host_early_copy_ms=t_early,
                             plan_ms=rep.plan_ms, stage_ms=stage_ms))
    # dp-1 local permutation (no communication) on device-resident micro-batches: 8 different
    # micro-batches in turn (the plan permutes some, keeps others in natural order: both are timed)
    perm, permuted, perm_split, dp1_parts, dp1_host = {}, {}, {}, {}, {}
    for mb in args.dp1_sizes:
        rng = np.random.default_rng(7)
        gs = [syn.to_device(syn.make_global_batch(rng, mb, S, features=F, mix=args.mix), dev) for _ in range(8)]
        loc = WindowExchanger(grid=Grid(size=2, dp=1, rank=0), micro_batch_size=mb, cost=cost,
                              device=dev)
        reps = [loc.exchange([g])[1] for g in gs]
        permuted[mb] = sum(bool((r.orders != np.arange(mb)).any()) for r in reps)
        k = iter(range(10**9))
        perm[mb] = timed(lambda: loc.exchange([gs[next(k) % 8]]), args.reps * 8)
        for kind, keep in (("permuted", True), ("natural", False)):  # the two kinds of micro-batch apart
            mine = [g for g, r in zip(gs, reps) if bool((r.orders != np.arange(mb)).any()) == keep]
            if mine:
                k = iter(range(10**9))
                perm_split[mb, kind] = timed(lambda: loc.exchange([mine[next(k) % len(mine)]]), args.reps * 8)
        g = gs[next(i for i, r in enumerate(reps) if (r.orders != np.arange(mb)).any())]
        win = loc.round._prepare([g])
        plan_args = (win.counts, cost, loc.grid, loc.round.settings)
        order = plan_window(*plan_args).orders[0]
        dp1_parts[mb] = dict(
            prepare=timed(lambda: loc.round._prepare([g]), args.reps * 4),
            counts=timed(lambda: count_samples(cost, g["input_ids"], g.get("attention_mask"), grid_thw=grid_thw_of(g)), args.reps * 4),
            plan=timed(lambda: plan_window(*plan_args), args.reps * 4),
            take=timed(lambda: take(win.layout, [win.shards[0]], order, dev), args.reps * 4))
        # from pinned host memory (a data loader's batch): the whole dp-1 exchange, which lands on the
        # device in canonical order, against what reorder off does (every tensor .to(device))
        hs = [pin(syn.make_global_batch(np.random.default_rng(7 + i), mb, S, features=F, mix=args.mix))
              for i in range(8)]
        k = iter(range(10**9))
        early = WindowExchanger(grid=Grid(size=2, dp=1, rank=0), micro_batch_size=mb, cost=cost,
                                device=dev, early_copy=True)
        dp1_host[mb] = dict(exchange=timed(lambda: loc.exchange([hs[next(k) % 8]]), args.reps * 8),
                            early_copy=timed(lambda: early.exchange([hs[next(k) % 8]]), args.reps * 8),
                            to_device=timed(lambda: syn.to_device(hs[next(k) % 8], dev, non_blocking=True),
                                            args.reps * 8))
    # overlap: exposed time per next() while a fake compute step of compute_ms runs on the GPU
    w, per = 2, args.per_rank[0]
    B = per * world
    rng = np.random.default_rng(99)
    stream_src = [syn.rank_share(syn.make_global_batch(rng, B, S, features=F, mix=args.mix, first_id=k * B),
                                 world, me) for k in range(8)]
    stream_src = [pin(m) for m in stream_src]
    a = torch.randn(args.matmul, args.matmul, device=dev, dtype=torch.bfloat16 if cuda else torch.float32)
    prod = torch.empty_like(a)  # preallocated: the fake step allocates nothing, so the peak below is reorder's
    for _ in range(5):
        torch.matmul(a, a, out=prod)
    _sync()
    t = time.perf_counter()
    for _ in range(10):
        torch.matmul(a, a, out=prod)
    _sync()
    mm_ms = (time.perf_counter() - t) * 100
    n_mm = max(1, int(args.compute_ms / mm_ms))
    ex = WindowExchanger(grid=groups.grid, micro_batch_size=B, cost=cost, window_size=w, collectives=groups.side,
                         device=dev)
    exposed, steps = [], []
    window_bytes = max(sum(t.numel() * t.element_size() for k in range(j, j + w) for t in tensors(stream_src[k]))
                       for j in range(0, len(stream_src), w))
    rep = on_dev = gs = None  # nothing of the earlier measurements stays on the device
    _sync()
    if cuda:
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        torch.cuda.memory._record_memory_history(stacks="python", max_entries=200000)
    with ReorderingBuffer(iter(stream_src), ex, overlap=True) as buf:
        it = iter(buf)
        next(it)
        for _ in range(6):
            _sync()
            t0 = time.perf_counter()
            for _ in range(n_mm):
                torch.matmul(a, a, out=prod)
            _sync()
            t1 = time.perf_counter()
            mb = next(it)
            mb["input_ids"].sum().item()
            t2 = time.perf_counter()
            exposed.append((t2 - t1) * 1e3)
            steps.append((t2 - t0) * 1e3)
        alive = buf.worker_alive
    _sync()
    peak = torch.cuda.max_memory_allocated(dev) - base if cuda else float("nan")  # windows + buffers in flight
    try:
        stream_peak, at_peak = live_at_peak(dev) if cuda else (float("nan"), [])
    except Exception as e:  # noqa: BLE001 - a diagnostic only: never lose the run over it
        stream_peak, at_peak = float("nan"), [f"memory history unavailable: {type(e).__name__}: {e}"]
    overlap = dict(exposed_ms_median=float(np.median(exposed)), step_ms_median=float(np.median(steps)),
                   overlap_exposed_fraction=float(np.median(exposed) / np.median(steps)),
                   gpu_peak_mib=peak / 2**20, window_mib=window_bytes / 2**20,
                   gpu_peak_in_windows=peak / window_bytes, stream_peak_mib=stream_peak / 2**20,
                   stream_peak_in_windows=stream_peak / window_bytes, live_at_peak=at_peak)
    if me == 0:
        print(f"{'per rank':>8} {'W':>2} {'moved MiB':>10} {'exchange ms':>12} {'bare a2a ms':>12} {'ratio':>7} "
              f"{'target ms':>10} {'gloo ms':>8} {'meta ms':>8} {'from host ms':>13} {'early copy ms':>14} "
              f"{'plan ms':>8}")
        for r in rows:
            print(f"{r['per_rank']:8d} {r['window']:2d} {r['moved_mib']:10.1f} {r['exchange_ms']:12.2f} "
                  f"{r['a2a_ms']:12.2f} {r['ratio']:7.2f} {r['target_ms']:10.2f} {r['gloo_all_gather_ms']:8.3f} "
                  f"{r['meta_all_gather_ms']:8.3f} {r['exchange_from_host_ms']:13.2f} "
                  f"{r['exchange_from_host_early_copy_ms']:14.2f} {r['plan_ms']:8.3f}")
            print("         stages (ms, synchronized):", {k: round(v, 3) for k, v in r["stage_ms"].items()})
        print("dp-1 local permutation ms:", perm, "micro-batches permuted of 8:", permuted)
        print("  dp-1 by kind ms:", {f"{mb}/{kind}": round(v, 3) for (mb, kind), v in perm_split.items()},
              "parts ms:", {mb: {k: round(v, 3) for k, v in d.items()} for mb, d in dp1_parts.items()})
        print("  dp-1 from pinned host ms (exchange, against .to(device) of every tensor):",
              {mb: {k: round(v, 3) for k, v in d.items()} for mb, d in dp1_host.items()})
        print("host cost of one exchange (first row):", {k: round(v, 2) for k, v in host.items()})
        if args.profile:
            print(profile_text)
        print("overlap (W=2):", {k: v for k, v in overlap.items() if k != "live_at_peak"},
              "worker alive during stream:", alive)
        print("alive at the peak of the stream's own allocations (MiB, allocations, freed by Python but "
              "pending, made at):")
        for row in overlap["live_at_peak"]:
            print("  ", row)
        if args.json:
            real = next(r for r in rows if r["per_rank"] == 8 and r["window"] == 1) if any(
                r["per_rank"] == 8 and r["window"] == 1 for r in rows) else rows[0]
            with open(args.json, "w") as f:
                json.dump(dict(device=(torch.cuda.get_device_name(0) if cuda else "cpu") + f" x{world}", rows=rows, overlap=overlap,
                               exchange_over_a2a=real["ratio"],
                               exchange_fixed_ms=real["exchange_ms"] - real["a2a_ms"],
                               overlap_exposed_fraction=overlap["overlap_exposed_fraction"],
                               dp1_perm_ms_mb4=perm.get(4), dp1_perm_ms_mb32=perm.get(32), dp1_permuted_of_8=permuted,
                               dp1_by_kind_ms={f"{mb}/{kind}": v for (mb, kind), v in perm_split.items()},
                               dp1_parts_ms=dp1_parts, dp1_from_pinned_host_ms=dp1_host,
                               host=host),
                          f, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
