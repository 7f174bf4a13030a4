"""Where one window's buffers live: decided once per window, as a value, before anything is allocated.

The target device holds the outputs, the send and the receive buffers (what the data group's
collective reads and writes: NCCL only takes CUDA tensors, Gloo host ones), and the executor runs
there. A source buffer is read in place when it is on the target, or when it is pinned host memory
and the executor reads pinned memory directly (the Triton kernel); otherwise it is copied to the
target first. Nothing here depends on which source comes first.

A source read in place from the host is read by the kernel through its raw address, which torch's
caching host allocator cannot see: the placement marks it `held`, and the executor keeps every held
source referenced until an event recorded after its launch completes (`TritonExecutor`, through
`KeepAlive`). Every other buffer's readers are torch ops or collectives, which the caching
allocators see (docs/design.md, "Placement and lifetimes").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class Placement:
    """One window's placement.

    target: the device of outputs, send and receive buffers, and of the executor's launches.
    executor: the name of the executor that runs the window's launches on `target` ("triton" or
        "torch").
    direct: per source buffer, in order: read where it is (True) or copied to `target` first.
    held: per source buffer: read in place from host memory by a kernel on the device, so kept
        referenced until an event recorded after the launch that reads it completes.
    """

    target: torch.device
    executor: str
    direct: tuple
    held: tuple


def place(target: torch.device, sources: list, *, executor: str, reads_pinned_host: bool) -> Placement:
    """The placement of a window whose outputs go to `target`.

    Args:
        target: where the reordered micro-batches go (the exchanger's `device`, else where input_ids
            lives), a CUDA device with its index.
        sources: per source buffer, (its device, whether it is pinned host memory).
        executor: the name of the target's executor.
        reads_pinned_host: the target's executor reads pinned host memory directly.
    """
    kernel_reads_host = reads_pinned_host and target.type == "cuda"
    direct = tuple(d == target or (kernel_reads_host and d.type == "cpu" and pinned) for d, pinned in sources)
    held = tuple(x and target.type == "cuda" and d.type == "cpu" for x, (d, _) in zip(direct, sources))
    return Placement(target=target, executor=executor, direct=direct, held=held)
