"""The overlap thread's meeting right before its all_to_all, against the deadlock it prevents, in real
Gloo processes with the device modelled on the host.

On a GPU (`functional_tests/overlap_sync_cuda.py`, second case) rank 1's worker waits for its whole
device before it packs (a kernel's first launch does), which waits for its consumer's queued
all-reduce, which needs rank 0's consumer, which first synchronizes its device, and that waits for
any collective rank 0's worker has put on it. Here a rank's "device" is what its threads queued:
rank 0's synchronize waits until its worker is out of the data all_to_all (a launched collective),
and rank 1's worker, packing window k, waits until its consumer's all-reduces of windows 0..k-1 have
returned. Without the meeting rank 0's worker sits in the all_to_all, waiting for rank 1's worker:
the synchronize never returns (the control). With it the worker waits in the meeting, on the host,
which a synchronize does not wait for."""

import threading
import time

import numpy as np
import pytest

from reorder import CostModel, WindowExchanger
from reorder.cli import synthetic as syn
from reorder.cli.processes import ProcessesFailed, run_processes
from reorder.exchange import dist as rd
from reorder.runtime.buffer import ReorderingBuffer

WINDOWS, B = 6, 8


def _served(rank, world, meeting):
    import torch
    import torch.distributed as dist

    groups = rd.build_groups({"language": [[0, 1]]}, device=torch.device("cpu"), overlap=True)
    groups.side.launch_rendezvous = meeting
    train = dist.new_group([0, 1], backend="gloo")
    in_flight, done, cond = [0], [0], threading.Condition()
    all_to_all = dist.all_to_all_single

    def launched(*a, **k):  # a collective on the device: a synchronize waits for it
        with cond:
            in_flight[0] += 1
        try:
            return all_to_all(*a, **k)
        finally:
            with cond:
                in_flight[0] -= 1
                cond.notify_all()

    dist.all_to_all_single = launched
    ex = WindowExchanger(grid=groups.grid, micro_batch_size=B, cost=CostModel(), window_size=1,
                         collectives=groups.side)
    packed = [0]
    if rank == 1:
        pack = ex.round.pack

        def pack_after_waiting():  # the worker waits for its device: its consumer's queued all-reduces
            k, packed[0] = packed[0], packed[0] + 1
            with cond:
                if not cond.wait_for(lambda: done[0] >= k, timeout=20):
                    raise AssertionError("rank 1's consumer never returned from its all-reduce")
            return pack()

        ex.round.pack = pack_after_waiting
    source = (syn.rank_share(syn.make_global_batch(np.random.default_rng((5, k)), B, 64, features=4, mix="small",
                                                   first_id=k * B), 2, rank) for k in range(WINDOWS))
    ids = []
    buf = ReorderingBuffer(source, ex, overlap=True)
    try:
        it = iter(buf)
        for _ in range(WINDOWS):
            ids.append(next(it)["sample_id"].tolist())
            if rank == 0:
                time.sleep(0.2)  # rank 0's worker reaches the next window's all_to_all meanwhile
                with cond:  # torch.cuda.synchronize()
                    if not cond.wait_for(lambda: in_flight[0] == 0, timeout=5):
                        raise AssertionError("deadlock: rank 0's synchronize waited 5 s for its worker's all_to_all")
            dist.all_reduce(torch.ones(1), group=train)
            with cond:
                done[0] += 1
                cond.notify_all()
    finally:
        buf.close(timeout=1.0)  # a deadlocked worker is left in its collective: the process ends anyway
    dist.all_to_all_single = all_to_all
    every = [None, None]
    dist.all_gather_object(every, (ids, packed[0]))
    return every


def test_with_the_meeting_no_synchronize_waits_for_a_peer_thread():
    (ids0, _), (ids1, packed) = run_processes(_served, 2, (True,), timeout=120, pg_timeout=10)
    assert packed >= WINDOWS  # rank 1's worker waited for its consumer before every pack
    for k in range(WINDOWS):  # every window whole: each sample once, on one rank
        assert sorted(ids0[k] + ids1[k]) == list(range(k * B, (k + 1) * B))


def test_without_the_meeting_the_same_loop_deadlocks():
    """The control: the test above can fail."""
    with pytest.raises(ProcessesFailed, match="deadlock: rank 0's synchronize waited 5 s"):
        run_processes(_served, 2, (False,), timeout=120, pg_timeout=10)
