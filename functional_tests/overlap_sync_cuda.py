"""The overlap thread next to a training loop that synchronizes the whole device, as a pipeline does.

Megatron's pipeline P2P (`variable_seq_lengths`, `batch_p2p_sync`) calls `torch.cuda.synchronize()`,
which waits for every stream of the device, the overlap thread's too. Ranks here consume in a chain,
as pipeline stages of different DP replicas do: rank r takes window k only after rank r - 1 has taken
it and synchronized the device. Rank 0's worker starts window k + 1 as soon as rank 0 takes window k;
rank r's worker only once rank r has. A device collective of the worker's that waits for a peer's
worker (the window frame's all-gather on NCCL) makes rank 0's synchronize wait for rank 1's worker,
which waits for rank 1's consumer, which waits for rank 0: a deadlock (the NCCL watchdog ends it).
The overlap thread's metadata on the host lets every synchronize return.

The second case: every worker but rank 0's waits for its whole device before it packs (a kernel's first
launch in a process does: CUDA loads modules lazily; so do a Triton compile and a CUDA graph capture),
while its consumer has an NCCL all-reduce queued that needs rank 0's consumer, and rank 0's consumer
synchronizes the device before its own. Had rank 0's worker launched its all_to_all on the strength of
the window's frame alone, rank 0's synchronize would wait for it, it for the waiting worker, that for
its consumer's all-reduce, and that for rank 0: a deadlock. The overlap pair meets on the host right
before the all_to_all, so the launch waits there instead.

  torchrun --nproc-per-node 2 functional_tests/overlap_sync_cuda.py [--windows 20] [--pause 0.2]
  torchrun --nproc-per-node 2 functional_tests/overlap_sync_cuda.py --device cpu   # rehearsal only
  torchrun --nproc-per-node 2 functional_tests/overlap_sync_cuda.py --without-launch-rendezvous --timeout 30
      # the control: the overlap pair without its meeting before the all_to_all; the second case deadlocks

Ranks beyond the GPU count share them (bench.common.rank_device). Rank 0 prints one RESULT line; exit 1
when a window is missing or differs from the synchronous exchange's, or a rank fails.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # reorder, spec and bench from this checkout

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bench.common import init_torchrun  # noqa: E402
from reorder import CostModel, WindowExchanger  # noqa: E402
from reorder.cli import synthetic as syn  # noqa: E402
from reorder.exchange.dist import build_groups  # noqa: E402
from reorder.runtime.buffer import ReorderingBuffer  # noqa: E402

COST = CostModel(image_token_id=syn.IMAGE_TOKEN, vision_start_token_id=syn.VISION_START)


def source(args, dp: int, rank: int, dev):
    for k in range(args.windows):
        g = syn.make_global_batch(np.random.default_rng((args.seed, k)), args.micro_batch, 256, features=32,
                                  mix="small", first_id=k * args.micro_batch)
        yield syn.to_device(syn.rank_share(g, dp, rank), dev)


def served(args, groups, dev, *, overlap: bool, chain=None, train=None) -> list:
    """The sample ids of every micro-batch served; with `chain`, consumed in the chain above; with
    `train` (an NCCL group of every rank), the second case above."""
    ex = WindowExchanger(grid=groups.grid, micro_batch_size=args.micro_batch, cost=COST, window_size=1,
                         collectives=groups.side if overlap else groups.main, device=dev)
    rank, world = dist.get_rank(), dist.get_world_size()
    if train is not None and rank > 0:
        pack = ex.round.pack

        def pack_after_waiting():
            if threading.current_thread() is not threading.main_thread():
                torch.cuda.synchronize()  # the worker waits for its device, its consumer's all-reduce too
            return pack()

        ex.round.pack = pack_after_waiting
    loss = torch.ones(1, device=dev)
    token = torch.zeros(1)
    ids = []
    with ReorderingBuffer(source(args, groups.grid.dp, groups.grid.rank, dev), ex, overlap=overlap) as buf:
        it = iter(buf)
        for _ in range(args.windows):
            if chain is not None and rank > 0:
                dist.recv(token, rank - 1, group=chain)
            mb = next(it)
            ids.append(mb["sample_id"].tolist())
            if chain is not None:
                time.sleep(args.pause)  # the worker launches the next window's exchange meanwhile
                if dev.type == "cuda":
                    torch.cuda.synchronize()  # what the pipeline's P2P does
                if rank < world - 1:
                    dist.send(token, rank + 1, group=chain)
            if train is not None:
                if rank == 0:
                    time.sleep(args.pause)  # the others' all-reduces are queued meanwhile, their workers wait
                    torch.cuda.synchronize()
                dist.all_reduce(loss, group=train)
        if next(it, None) is not None:
            raise AssertionError("more micro-batches than the source holds")
    return ids


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--windows", type=int, default=20)
    p.add_argument("--micro-batch", type=int, default=0, help="global micro-batch B (default 4 x world size)")
    p.add_argument("--pause", type=float, default=0.2, help="seconds between taking a window and synchronizing")
    p.add_argument("--timeout", type=float, default=60, help="process-group timeout, s (a deadlock ends there)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a Gloo rehearsal (no device to synchronize)")
    p.add_argument("--without-launch-rendezvous", action="store_true",
                   help="the control: no meeting before the all_to_all (the second case deadlocks)")
    args = p.parse_args()
    timeout = datetime.timedelta(seconds=args.timeout)
    rank, world, dev = init_torchrun(cuda=args.device == "cuda", timeout=timeout)
    args.micro_batch = args.micro_batch or 4 * world
    groups = build_groups({"language": [list(range(world))]}, device=dev, overlap=True, timeout=timeout)
    chain = dist.new_group(backend="gloo", timeout=timeout)
    if args.without_launch_rendezvous and groups.side is not None:
        groups.side.launch_rendezvous = False
    t0 = time.time()
    want = served(args, groups, dev, overlap=False)
    got = served(args, groups, dev, overlap=True, chain=chain)
    ok = [got == want]
    if dev.type == "cuda":
        train = dist.new_group(backend="nccl", timeout=timeout)
        ok[0] = served(args, groups, dev, overlap=True, train=train) == want and ok[0]
    every = [None] * world
    dist.all_gather_object(every, ok[0])
    if rank == 0:
        print("RESULT", dict(ok=all(every), ranks=world, windows=args.windows, pause_s=args.pause,
                             cases=["chain", "worker waits"] if dev.type == "cuda" else ["chain"],
                             launch_rendezvous=groups.side is not None and groups.side.launch_rendezvous,
                             meta_on_device=groups.side.meta_on_device, seconds=round(time.time() - t0, 1)), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    sys.exit(0 if all(every) else 1)


if __name__ == "__main__":
    main()
