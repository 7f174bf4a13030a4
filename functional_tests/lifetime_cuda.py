"""Lifetimes under real asynchrony: fresh pinned micro-batches every window behind a delayed stream.

Each micro-batch a rank reads is made afresh and pinned (`pin_memory()` hands out the host blocks the
caching host allocator took back, the previous window's among them) and, before it is handed over,
`torch.cuda._sleep` is queued on the stream the exchange runs on, so every copy of the window runs
late: after the caller has dropped the window's inputs and pinned the next ones. A reader that the
allocator cannot see (a kernel reading pinned memory by its address, with nothing keeping the block)
then reads the next micro-batch's bytes. The consumer takes the whole stream without synchronizing
(a check per micro-batch would wait for the copies and hide the race), then checks every micro-batch
served byte for byte: this rank's canonical positions under the window's plan, every field as the
spec reads it from the natural global micro-batch. A window with any mismatch counts as corrupted.

Cases: early_copy off / on x overlap off / on x W 1..4 through `WindowExchanger` + `ReorderingBuffer`,
then the Megatron-Bridge drop-in (`reorder.integrations.bridge`, which picks early_copy itself) with
overlap off / on, W 1..4. One process: dp 1; under torchrun every rank is one rank of a module of
dp = world size (ranks beyond the GPU count share them: bench.common.rank_device).

  python functional_tests/lifetime_cuda.py [--windows 13] [--sleep 20000000]
  torchrun --nproc-per-node 4 functional_tests/lifetime_cuda.py
  python functional_tests/lifetime_cuda.py --defect   # the self-check must catch the defect put back

--defect puts the lifetime defect back (the Triton executors made from then on hold nothing, and each
copy launch waits for the device, then is queued behind one more busy kernel, so it runs after the
self-check's own read of the same sources has completed and that reader's holder, at its next launch,
has let them go; the self-check's holder is untouched) and runs
the exchanger cases with the runtime self-check on
every window (verify=1): the check passes when the self-check raised its ReorderError in at least
one case, and every case it did not stop served its micro-batches byte for byte (no corruption
went unseen) with no other error, so the check users can leave on is shown to catch what this
suite catches.

Rank 0 prints one RESULT line: ok, windows and micro-batches checked, corrupted windows per case.
Exit 1 on any corrupted window, on any rank, or when fewer windows than --min-windows were checked.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # reorder, spec and bench from this checkout

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bench.common import init_torchrun, rank_device  # noqa: E402
from reorder import CostModel, Grid, WindowExchanger  # noqa: E402
from reorder.cli import synthetic as syn  # noqa: E402
from reorder.exchange.dist import build_groups  # noqa: E402
from reorder.integrations import bridge as br  # noqa: E402
from reorder.runtime.buffer import ReorderingBuffer  # noqa: E402
from spec.samples import per_sample_bytes  # noqa: E402

COST = CostModel(image_token_id=syn.IMAGE_TOKEN, vision_start_token_id=syn.VISION_START)
BRIDGE_COST = functools.partial(br.sample_cost, encoder_cost_weight=1.0, language_cost_weight=0.0,
                                image_token_id=syn.IMAGE_TOKEN, square_merge_size=4)


def global_batch(args, k: int) -> dict:
    """Global micro-batch k (the same on every rank, made on demand so old ones are freed)."""
    rng = np.random.default_rng((args.seed, k))
    return syn.make_global_batch(rng, args.micro_batch, args.seq_len, features=args.features, mix="small",
                                 first_id=k * args.micro_batch)


def delayed_source(args, dp: int, rank: int, count: int):
    """This rank's shares of global micro-batches 0..count-1, each freshly pinned, each preceded by a
    busy kernel on the current stream (the stream of whoever reads the source: the overlap thread's
    own with overlap)."""
    for k in range(count):
        share = syn.pin(syn.rank_share(global_batch(args, k), dp, rank))
        torch.cuda._sleep(args.sleep)
        yield share


def corrupted_windows(args, out: list, orders: list, dp: int, rank: int, window: int) -> tuple[int, list]:
    """(corrupted windows, first mismatches) of the micro-batches `out` this rank was served, against
    the natural global micro-batches and the orders the reports give (one per micro-batch)."""
    torch.cuda.synchronize()
    if len(out) != len(orders):
        return -(-len(out) // window) or 1, [f"{len(out)} micro-batches served, {len(orders)} orders reported"]
    bad_windows, notes, b = set(), [], args.micro_batch // dp
    for k, (mb, order) in enumerate(zip(out, orders)):
        g = global_batch(args, k)
        want = per_sample_bytes(g, vision_start_token_id=syn.VISION_START)
        host = syn.to_device(mb, "cpu")
        try:
            got = per_sample_bytes(host, vision_start_token_id=syn.VISION_START)
        except (IndexError, RuntimeError) as e:  # corrupted past reading (e.g. more images than grid_thw rows)
            got = f"unreadable: {type(e).__name__}: {e}"
        positions = order[rank * b:(rank + 1) * b]
        if got != [want[i] for i in positions]:
            bad_windows.add(k // window)
            if len(notes) < 3:
                notes.append(f"micro-batch {k}: rank {rank} holds samples {host['sample_id'].tolist()}, canonical "
                             f"positions [{rank * b},{(rank + 1) * b}) are {g['sample_id'][positions].tolist()}")
    return len(bad_windows), notes


def run_exchanger(args, groups, dev, *, early: bool, overlap: bool, window: int, verify: int = 0):
    """(micro-batches served, their orders) through WindowExchanger + ReorderingBuffer."""
    coll = None if groups is None else (groups.side if overlap else groups.main)
    grid = Grid(size=2, dp=1, rank=0) if groups is None else groups.grid  # dp 1: a local permutation
    ex = WindowExchanger(grid=grid, micro_batch_size=args.micro_batch, cost=COST, window_size=window,
                         collectives=coll, device=dev, early_copy=early, verify=verify)
    with ReorderingBuffer(delayed_source(args, grid.dp, grid.rank, args.windows * window), ex,
                          overlap=overlap) as buf:
        out = list(buf)
    return out, [o.tolist() for rep in buf.reports for o in rep.orders]


def run_drop_in(args, bridge_groups, dp: int, rank: int, *, overlap: bool, window: int):
    """(micro-batches served, their orders) through the Megatron-Bridge drop-in."""
    gloo, data = bridge_groups[overlap] if dp > 1 else (None, None)
    buf = br.ReorderingBuffer(delayed_source(args, dp, rank, args.windows * window), dp_rank=rank, dp_size=dp,
                              n_groups=2 * dp, cost_of=BRIDGE_COST, dp_group_gloo=gloo, dp_group_nccl=data,
                              overlap=overlap, image_count_of=br.image_count_of, window_size=window)
    out = list(buf)
    return out, [o.tolist() for rep in buf.reports for o in rep.orders]


def defect_caught(args, groups, dev, rank: int, world: int):
    """--defect: the exchanger cases without early copies, self-check on every window, the
    executor's keep-alive disabled; exit 0 when the self-check caught the corruption."""
    from reorder import ReorderError
    from reorder.exchange import executors

    class HoldsNothing(executors.KeepAlive):  # the defect: the copy kernel's pinned sources are not kept
        def hold(self, tensors, stream):
            pass

    executors.KeepAlive = HoldsNothing  # executors made from now on; the self-check's own holder is kept
    run = executors.TritonExecutor.run

    def late(self, *a, **k):  # the copy runs late, after the self-check's own read of the same sources has
        torch.cuda.current_stream().synchronize()  # completed (a host slower than its device), so the check's
        torch.cuda._sleep(args.sleep)  # holder lets go of them at its next launch, before the copy reads them
        return run(self, *a, **k)

    executors.TritonExecutor.run = late
    caught, other = [], []
    for overlap in (False, True):
        for w in (1, 2, 3, 4):
            try:
                out, orders = run_exchanger(args, groups, dev, early=False, overlap=overlap, window=w, verify=1)
                n, why = corrupted_windows(args, out, orders, world, rank, w)
                if n:  # corrupted, and the check said nothing: what it exists to prevent
                    other.append(f"overlap={int(overlap)} W{w}: {n} corrupted windows went unseen: {why[:1]}")
            except ReorderError as e:
                (caught if "self-check failed" in str(e) else other).append(f"overlap={int(overlap)} W{w}: {e}")
            except Exception as e:  # noqa: BLE001 - reported
                other.append(f"overlap={int(overlap)} W{w}: {type(e).__name__}: {e}")
    every = [(caught, other)]
    if world > 1:
        every = [None] * world
        dist.all_gather_object(every, (caught, other))
    ok = any(c for c, _ in every) and not any(o for _, o in every)
    if rank == 0:
        print("RESULT", dict(ok=ok, mode="defect put back, verify=1", ranks=world,
                             cases_caught=sum(len(c) for c, _ in every), first=[c for cs, _ in every for c in cs][:2],
                             other_errors=[o for _, os_ in every for o in os_][:3]), flush=True)
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    sys.exit(0 if ok else 1)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--micro-batch", type=int, default=0, help="global micro-batch B (default 4 x world size)")
    p.add_argument("--windows", type=int, default=13, help="windows per case")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--features", type=int, default=64)
    p.add_argument("--sleep", type=int, default=20_000_000, help="cycles of torch.cuda._sleep before each micro-batch")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--min-windows", type=int, default=200, help="fail when fewer windows were checked in all")
    p.add_argument("--no-drop-in", action="store_true", help="skip the Megatron-Bridge drop-in cases")
    p.add_argument("--defect", action="store_true", help="put the lifetime defect back: the self-check must catch it")
    args = p.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        rank, world, dev = init_torchrun(cuda=True)
    else:
        rank, dev = 0, rank_device(True)
        torch.cuda.set_device(dev)
    args.micro_batch = args.micro_batch or 4 * world
    groups = build_groups({"language": [list(range(world))]}, device=dev, overlap=True) if world > 1 else None
    bridge_groups = {ov: br.build_module_dp_process_groups(dist.group.WORLD, overlap=ov)[2:] for ov in (False, True)} \
        if world > 1 else {}
    if args.defect:
        return defect_caught(args, groups, dev, rank, world)
    cases, windows, micro_batches, notes = {}, 0, 0, []
    for early in (False, True):
        for overlap in (False, True):
            for w in (1, 2, 3, 4):
                out, orders = run_exchanger(args, groups, dev, early=early, overlap=overlap, window=w)
                n, why = corrupted_windows(args, out, orders, world, rank, w)
                cases[f"exchanger early_copy={int(early)} overlap={int(overlap)} W{w}"] = n
                windows, micro_batches, notes = windows + args.windows, micro_batches + len(out), notes + why
    for overlap in (() if args.no_drop_in else (False, True)):
        for w in (1, 2, 3, 4):
            out, orders = run_drop_in(args, bridge_groups, world, rank, overlap=overlap, window=w)
            n, why = corrupted_windows(args, out, orders, world, rank, w)
            cases[f"drop-in overlap={int(overlap)} W{w}"] = n
            windows, micro_batches, notes = windows + args.windows, micro_batches + len(out), notes + why
    every = [(cases, windows, micro_batches, notes)]
    if world > 1:
        every = [None] * world
        dist.all_gather_object(every, (cases, windows, micro_batches, notes))
    corrupted = {c: sum(e[0][c] for e in every) for c in cases}
    total = sum(corrupted.values())
    ok = total == 0 and min(e[1] for e in every) >= args.min_windows
    if rank == 0:
        print("RESULT", dict(ok=ok, ranks=world, device=torch.cuda.get_device_name(dev), sleep_cycles=args.sleep,
                             windows_per_rank=windows, micro_batches_per_rank=micro_batches,
                             corrupted_windows=total, corrupted_by_case={c: n for c, n in corrupted.items() if n},
                             first_mismatches=[n for e in every for n in e[3]][:5]), flush=True)
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
