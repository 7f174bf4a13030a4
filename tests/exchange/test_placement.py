"""One placement per window (`reorder.exchange.placement.place`): outputs, send and receive buffers
on the target; a source read in place only where the target's executor can read it there; the
decision independent of which source comes first."""

import itertools

import pytest
import torch

from reorder.exchange.dist import data_backend_for
from reorder.exchange.placement import place

CPU, GPU0, GPU1 = torch.device("cpu"), torch.device("cuda", 0), torch.device("cuda", 1)
PINNED, PAGEABLE, ON_GPU0, ON_GPU1 = (CPU, True), (CPU, False), (GPU0, False), (GPU1, False)


@pytest.mark.parametrize("sources", list(itertools.permutations([PINNED, PAGEABLE, ON_GPU0])), ids=str)
def test_a_window_of_host_and_device_sources_targets_the_device_whatever_comes_first(sources):
    """The send buffer was allocated where the first source lived: a pinned first source sent a host
    buffer to NCCL. The placement's target is the target, whatever the order."""
    kernel = place(GPU0, list(sources), reads_pinned_host=True)
    assert kernel.target == GPU0
    assert kernel.direct == tuple(s in (PINNED, ON_GPU0) for s in sources)
    torch_ops = place(GPU0, list(sources), reads_pinned_host=False)
    assert torch_ops.direct == tuple(s == ON_GPU0 for s in sources)


def test_sources_elsewhere_are_copied_and_host_targets_read_host_memory_in_place():
    assert place(GPU0, [ON_GPU1, PINNED], reads_pinned_host=True).direct == (False, True)
    cpu = place(CPU, [PINNED, PAGEABLE, ON_GPU0], reads_pinned_host=False)
    assert (cpu.target, cpu.direct) == (CPU, (True, True, False))
    assert place(CPU, [PINNED], reads_pinned_host=True).direct == (True,)  # on the host target: in place
    assert place(GPU0, [], reads_pinned_host=True).direct == ()


def test_the_data_backend_follows_where_the_data_lives():
    """With CUDA available, host micro-batches got an NCCL data group, which cannot move them."""
    assert data_backend_for("cpu", True) == "gloo"
    assert data_backend_for(torch.device("cpu"), False) == "gloo"
    assert data_backend_for("cuda:1", True) == "nccl"
    assert data_backend_for(None, True) == "cpu:gloo,cuda:nccl"
    assert data_backend_for(None, False) == "gloo"
