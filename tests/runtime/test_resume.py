"""Resume from the buffer's state: what training consumed, not what the loader or the overlap thread read.

A run checkpoints the object `wrap` returns through torch.distributed.checkpoint (Stateful protocol)
after K micro-batches, while DataLoader workers and the overlap thread have read ahead; a fresh
buffer built from a source factory and loaded from that checkpoint must serve exactly the micro-batches
the continuous run served from K on, byte for byte (2 forked Gloo ranks, CanonicalBatchSampler in
cyclic mode across an epoch boundary, DataLoader num_workers 0 and 2, overlap on and off, W 1 and 3).
"""

import datetime
import itertools
import time

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from reorder.cli import synthetic as syn
from reorder.integrations import megatron as rm
from reorder.integrations.config import ReorderConfig
from reorder.integrations.sampler import CanonicalBatchSampler
from reorder.runtime.buffer import PassThroughBuffer

B, N, TOTAL, K = 4, 40, 14, 7  # 10 micro-batches per epoch; checkpoint after 7 (inside a window of 3)
POOL = syn.make_global_batch(np.random.default_rng(11), N, 64, features=4, mix="skewed", first_id=1000)


class Indices(torch.utils.data.Dataset):
    def __len__(self):
        return N

    def __getitem__(self, i):
        return i


def collate(indices):
    """The samples `indices` of the pool as one fixed-width micro-batch (runs in the loader's workers)."""
    return syn.take_samples(POOL, np.asarray(indices))


def make_source(dp, rank, workers, samplers):
    """consumed_samples -> this rank's micro-batches of the rest of the run (TOTAL micro-batches in all)."""
    def source(consumed_samples):
        sampler = CanonicalBatchSampler(N, B, data_parallel_size=dp, data_parallel_rank=rank, grid_size=dp,
                                        dataloader_type="cyclic", seed=5,
                                        consumed_samples=consumed_samples)
        samplers.append((consumed_samples, sampler))
        loader = DataLoader(Indices(), batch_sampler=sampler, num_workers=workers, collate_fn=collate)
        epochs = (mb for _ in itertools.count() for mb in loader)  # cyclic: each pass is one epoch
        return itertools.islice(epochs, TOTAL - consumed_samples // B)
    return source


def same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def _rank_main(rank, world, cfg_kwargs, workers, ckpt):
    import torch.distributed.checkpoint as dcp

    cfg = ReorderConfig(megatron_mimo_scalable_dp=True, megatron_mimo_intra_microbatch_reorder=True, **cfg_kwargs)
    grids = {"images": [[0, 1]], "language": [[0, 1]]}

    def wrap(source):
        return rm.wrap(source, config=cfg, module="language", grids=grids, micro_batch_size=B,
                       fixed_width_padding=True, timeout=datetime.timedelta(seconds=60))

    samplers = []
    with wrap(make_source(world, rank, workers, samplers)) as buf:  # the continuous run
        continuous = list(buf)
        moved = sum(r.moved_samples for r in buf.reports)
    first = []
    buf = wrap(make_source(world, rank, workers, samplers))
    for _ in range(K):
        first.append(next(buf))
    time.sleep(0.3)  # let the loader's workers and the overlap thread read ahead (they do, in training)
    read_ahead = samplers[-1][1].consumed_samples - buf.state_dict()["consumed_samples"]
    dcp.save({"data": buf}, checkpoint_id=ckpt)  # the run stops here
    buf.close()

    resumed = wrap(make_source(world, rank, workers, samplers))
    dcp.load({"data": resumed}, checkpoint_id=ckpt)
    assert resumed.consumed_micro_batches == K
    rest = list(resumed)
    resumed.close()
    assert resumed.state_dict() == {"consumed_micro_batches": TOTAL, "consumed_samples": TOTAL * B,
                                    "micro_batch_size": B}
    assert len(continuous) == TOTAL and len(first) + len(rest) == TOTAL
    diff = [k for k, (a, b) in enumerate(zip(continuous, first + rest)) if not same(a, b)]
    assert not diff, f"rank {rank}: micro-batches {diff} differ from the continuous run"
    return dict(moved=moved, read_ahead=read_ahead, resumed_at=samplers[-1][0])


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("overlap,window,cross_slot", [(False, 1, False), (True, 1, False), (False, 3, False),
                                                       (True, 3, False), (True, 3, True)])
def test_resume_reproduces_the_continuous_run(tmp_path, workers, overlap, window, cross_slot):
    from reorder.cli.processes import run_processes

    cfg = dict(megatron_mimo_reorder_overlap=overlap, megatron_mimo_reorder_window_size=window,
               megatron_mimo_reorder_cross_slot=cross_slot)
    got = run_processes(_rank_main, 2, (cfg, workers, str(tmp_path / "ckpt")), timeout=240)
    assert got["moved"] > 0  # the plans did move samples across ranks
    if workers or overlap:  # the sampler ran ahead of training: its own count would skip micro-batches
        assert got["read_ahead"] > 0
    assert got["resumed_at"] == K // window * window * B  # rebuilt at the start of the checkpoint's window


# ---- the pass-through (reorder off) and the rules, in one process --------------------------------


@pytest.mark.parametrize("workers", [0, 2])
def test_pass_through_resumes_where_training_stopped(workers):
    samplers = []
    source = make_source(1, 0, workers, samplers)
    continuous = list(PassThroughBuffer(source, micro_batch_size=B))
    buf = PassThroughBuffer(source, micro_batch_size=B)
    first = [next(buf) for _ in range(K)]
    state = buf.state_dict()
    assert state == {"consumed_micro_batches": K, "consumed_samples": K * B, "micro_batch_size": B}
    if workers:
        assert samplers[-1][1].consumed_samples > K * B  # the loader's workers read ahead
    buf.close()
    resumed = PassThroughBuffer(source, micro_batch_size=B)
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert samplers[-1][0] == K * B
    assert [same(a, b) for a, b in zip(continuous, first + rest)] == [True] * TOTAL
    assert len(first + rest) == TOTAL


def test_load_state_dict_rules():
    source = make_source(1, 0, 0, [])
    buf = PassThroughBuffer(source, micro_batch_size=B)
    with pytest.raises(ValueError, match="micro_batch_size=8 in the state does not match this run's micro_batch_size=4"):
        buf.load_state_dict({"consumed_micro_batches": 3, "micro_batch_size": 8})
    with pytest.raises(ValueError, match="has no 'consumed_micro_batches'"):
        buf.load_state_dict({"consumed_samples": 12})
    with pytest.raises(ValueError, match="consumed_samples=11 in the state is not"):
        buf.load_state_dict({"consumed_micro_batches": 3, "consumed_samples": 11, "micro_batch_size": 4})
    next(buf)
    with pytest.raises(RuntimeError, match="before the first next"):
        buf.load_state_dict({"consumed_micro_batches": 3})
    it = PassThroughBuffer(iter(range(5)), micro_batch_size=B)
    with pytest.raises(ValueError, match="from an iterator, which cannot be repositioned"):
        it.load_state_dict({"consumed_micro_batches": 3})
    it.load_state_dict({"consumed_micro_batches": 0})  # nothing consumed: an iterator is fine
    assert list(it) == [0, 1, 2, 3, 4] and it.consumed_micro_batches == 5


def test_a_pass_through_buffer_has_verified_nothing():
    """Reordering off (what `wrap` returns then): no self-check, the counts a training loop reads are 0."""
    buf = PassThroughBuffer(iter([]), micro_batch_size=4)
    assert (buf.verified_windows, buf.verified_samples) == (0, 0)
