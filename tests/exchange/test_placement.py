"""One placement per window (`reorder.exchange.placement.place`): outputs, send and receive buffers
on the target; a source read in place only where the target's executor can read it there; held
until its launch completes exactly when a kernel reads it from the host by address; the decision
independent of which source comes first."""

import itertools

import numpy as np
import pytest
import torch

from reorder import CostModel, Grid, WindowExchanger, run_emulated
from reorder.cli import synthetic as syn
from reorder.exchange.dist import data_backend_for
from reorder.exchange.executors import TorchExecutor
from reorder.exchange.placement import place

CPU, GPU0, GPU1 = torch.device("cpu"), torch.device("cuda", 0), torch.device("cuda", 1)
PINNED, PAGEABLE, ON_GPU0, ON_GPU1 = (CPU, True), (CPU, False), (GPU0, False), (GPU1, False)


@pytest.mark.parametrize("sources", list(itertools.permutations([PINNED, PAGEABLE, ON_GPU0])), ids=str)
def test_a_window_of_host_and_device_sources_targets_the_device_whatever_comes_first(sources):
    """The send buffer was allocated where the first source lived: a pinned first source sent a host
    buffer to NCCL. The placement's target is the target, whatever the order."""
    kernel = place(GPU0, list(sources), executor="triton", reads_pinned_host=True)
    assert kernel.target == GPU0
    assert kernel.direct == tuple(s in (PINNED, ON_GPU0) for s in sources)
    assert kernel.held == tuple(s == PINNED for s in sources)  # read by address: kept until the launch is done
    assert kernel.executor == "triton"
    torch_ops = place(GPU0, list(sources), executor="torch", reads_pinned_host=False)
    assert torch_ops.direct == tuple(s == ON_GPU0 for s in sources)
    assert torch_ops.held == (False, False, False)  # copied first: torch's copies are seen by the allocators


def test_sources_elsewhere_are_copied_and_host_targets_read_host_memory_in_place():
    across = place(GPU0, [ON_GPU1, PINNED], executor="triton", reads_pinned_host=True)
    assert (across.direct, across.held) == ((False, True), (False, True))
    cpu = place(CPU, [PINNED, PAGEABLE, ON_GPU0], executor="torch", reads_pinned_host=False)
    assert (cpu.target, cpu.direct, cpu.held) == (CPU, (True, True, False), (False, False, False))
    host = place(CPU, [PINNED], executor="triton", reads_pinned_host=True)
    assert (host.direct, host.held) == ((True,), (False,))  # on the host target: in place, nothing to hold
    empty = place(GPU0, [], executor="triton", reads_pinned_host=True)
    assert (empty.direct, empty.held) == ((), ())


def test_the_data_backend_follows_where_the_data_lives():
    """With CUDA available, host micro-batches got an NCCL data group, which cannot move them."""
    assert data_backend_for("cpu", True) == "gloo"
    assert data_backend_for(torch.device("cpu"), False) == "gloo"
    assert data_backend_for("cuda:1", True) == "nccl"
    assert data_backend_for(None, True) == "cpu:gloo,cuda:nccl"
    assert data_backend_for(None, False) == "gloo"


class Recording(TorchExecutor):
    """The torch executor, recording the `held` flags and source count of every launch."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def run(self, segments, sources, destinations, held=None):
        self.calls.append((held, len(sources)))
        return super().run(segments, sources, destinations, held)


def test_every_launch_of_a_window_gets_the_placement_held_flags():
    """The round hands its executor the placement's decision for every launch (pack: the sources;
    assemble: the receive buffer, then the sources), one flag per buffer; on a host target nothing
    is held."""
    rng = np.random.default_rng(3)
    batch = syn.make_global_batch(rng, 8, 256, features=8, mix="large", first_id=0, scale=0.05)
    recorders = [Recording(), Recording()]

    def fn(r, coll):
        ex = WindowExchanger(grid=Grid(size=2, dp=2, rank=r), micro_batch_size=8, cost=CostModel(),
                             balancer="lpt", collectives=coll)
        ex.round._executors[CPU] = recorders[r]
        share = syn.rank_share(batch, 2, r)
        ex.exchange([share])
        ex.exchange([])

    run_emulated(2, fn, timeout=30)
    for rec in recorders:
        assert len(rec.calls) == 2  # pack, then assemble
        (pack_held, pack_n), (asm_held, asm_n) = rec.calls
        assert asm_n == pack_n + 1 and pack_n > 0
        assert pack_held == (False,) * pack_n and asm_held == (False,) * asm_n
