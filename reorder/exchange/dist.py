"""The one layer that talks to torch.distributed: process groups and the two collectives.

`build_groups` is a world-wide collective: every rank of every module calls it with the same
arguments in the same order (dp-1 modules included) and it creates groups only when the canonical
grid G > 1, never gated on a rank's own DP size. Payloads travel on the data backend, which follows
where the micro-batches live (NCCL for CUDA tensors, Gloo for host ones). The fixed-size int64
metadata of a synchronous exchange travels on the data group too when that has NCCL (a private CUDA
stream, pinned staging buffers: ~0.1 ms instead of Gloo's 0.3+ ms, and it never waits for the
training stream's queued kernels), else on Gloo; `meta_backend="gloo"` forces Gloo. The overlap
thread's metadata always travels on Gloo, and that thread meets its peers on Gloo once more right
before its all_to_all, once the receive buffer is allocated: it puts a collective on the device only
when every peer's thread is at the same launch. A device collective that waited for a peer's thread
would hold up a training loop that synchronizes the whole device (Megatron's pipeline P2P does), while
that peer's thread waits for its consumer, which may wait for this rank's pipeline stage: a deadlock
(`functional_tests/overlap_sync_cuda.py` shows it). The window's frame alone does not suffice: between
it and the launch a thread may wait for its whole device, and so for its consumer's queued
collectives. A kernel's first launch in a process (CUDA loads modules lazily), a Triton compile or
module load, a CUDA graph capture and a cudaFree (an allocation that frees cached blocks makes one)
each waited for a kernel running on another stream (`functional_tests/device_waits_cuda.py`, one
H200). The latency of both meetings is hidden behind the training step.
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from reorder.exchange.collectives import CollectiveError
from reorder.plan.grid import Grid, canonical_grid


class TorchCollectives:
    """Collectives over a Gloo metadata group and a data group (any backend).

    meta_on_device: the metadata all-gather runs on the data group (NCCL) on the current CUDA device,
    on a private stream; a peer that does not arrive within `timeout` seconds raises CollectiveError
    (polled), like Gloo's timeout, instead of blocking forever. spin: seconds to poll without
    sleeping first (lowest latency for a synchronous exchange; 0 on the overlap thread, where polling
    would hold the GIL that the training thread needs). launch_rendezvous: meet every peer on the
    Gloo group right before each all_to_all (the overlap thread's pair, module docstring)."""

    def __init__(self, meta_group, data_group, *, meta_on_device: bool = False, timeout: float = 300.0,
                 spin: float = 2e-4, launch_rendezvous: bool = False):
        self.meta_group, self.data_group = meta_group, data_group
        self.rank = dist.get_rank(meta_group)
        self.size = dist.get_world_size(meta_group)
        self.meta_on_device, self.timeout, self.spin = meta_on_device, timeout, spin
        self.launch_rendezvous = launch_rendezvous
        self._meta = {}  # (device, dtype, shape) -> (stream, pinned in, device in, device out, pinned out, event)

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        if self.meta_on_device:
            return self._all_gather_device(t)
        out = [torch.empty_like(t) for _ in range(self.size)]
        try:
            dist.all_gather(out, t, group=self.meta_group)
        except RuntimeError as e:  # timeouts and lost peers surface here
            raise CollectiveError(f"reorder metadata all_gather failed on rank {self.rank}: {e}") from e
        return torch.stack(out)

    def _all_gather_device(self, t: torch.Tensor) -> torch.Tensor:
        dev = torch.device("cuda", torch.cuda.current_device())
        key = (dev, t.dtype, tuple(t.shape))
        if key not in self._meta:
            self._meta[key] = (torch.cuda.Stream(dev), torch.empty(t.shape, dtype=t.dtype, pin_memory=True),
                               torch.empty(t.shape, dtype=t.dtype, device=dev),
                               torch.empty((self.size, *t.shape), dtype=t.dtype, device=dev),
                               torch.empty((self.size, *t.shape), dtype=t.dtype, pin_memory=True),
                               torch.cuda.Event())
        stream, h_in, d_in, d_out, h_out, done = self._meta[key]
        h_in.copy_(t)  # the previous call's copies are done: it waited for `done`
        try:
            with torch.cuda.stream(stream):  # independent of the training stream's queued work
                d_in.copy_(h_in, non_blocking=True)
                dist.all_gather_into_tensor(d_out, d_in, group=self.data_group)
                h_out.copy_(d_out, non_blocking=True)
                done.record(stream)
        except RuntimeError as e:
            raise CollectiveError(f"reorder metadata all_gather failed on rank {self.rank}: {e}") from e
        _wait(done, self.timeout, f"reorder metadata all_gather on rank {self.rank}", self.spin)
        return h_out.clone()

    def all_to_all(self, send: torch.Tensor, send_splits: list, recv_splits: list) -> torch.Tensor:
        # allocated before the meeting: an allocation that has to free cached blocks waits for the device
        recv = torch.empty(sum(recv_splits), dtype=torch.uint8, device=send.device)
        try:
            if self.launch_rendezvous:  # a host tensor: Gloo's collective never touches a device
                dist.all_reduce(torch.zeros(1, dtype=torch.int32), group=self.meta_group)
            dist.all_to_all_single(recv, send, output_split_sizes=list(recv_splits),
                                   input_split_sizes=list(send_splits), group=self.data_group)
        except RuntimeError as e:
            raise CollectiveError(f"reorder all_to_all failed on rank {self.rank}: {e}") from e
        return recv


def _wait(event, timeout: float, what: str, spin: float = 2e-4) -> None:
    """Wait for a CUDA event without holding the GIL long: poll for `spin` seconds, then sleep-poll
    (every 50 us for 0.1 s, then every ms; every ms from the start when spin is 0: each wake-up takes
    the GIL from the training thread, and the overlap thread's latency is hidden anyway); raise
    CollectiveError after `timeout` seconds."""
    start = time.perf_counter()
    while not event.query():
        waited = time.perf_counter() - start
        if waited > timeout:
            raise CollectiveError(f"{what} timed out after {timeout:.0f} s: a peer did not arrive")
        if waited >= spin:
            time.sleep(5e-5 if spin and waited < 0.1 else 1e-3)


def data_backend_for(device, cuda_available: bool) -> str:
    """The payload backend for micro-batches that live on `device`: Gloo for the CPU, NCCL for CUDA,
    and, when the device is not known in advance (None) on a machine with CUDA, a group with both
    ("cpu:gloo,cuda:nccl": torch picks by the tensor's device, so host and device batches both work).

    >>> data_backend_for("cpu", True), data_backend_for("cuda:0", True), data_backend_for(None, False)
    ('gloo', 'nccl', 'gloo')
    """
    if device is None:
        return "cpu:gloo,cuda:nccl" if cuda_available else "gloo"
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


@dataclass(frozen=True, slots=True, kw_only=True)
class RankGroups:
    """This rank's module, place on the grid, and its reorder groups (None where dp == 1 or G == 1).

    `side` is a second, independent pair of groups for the overlap worker thread (own Gloo and own
    NCCL communicator, so background exchanges never interleave with the training stream's)."""

    module: str
    grid: Grid
    main: TorchCollectives | None
    side: TorchCollectives | None


def build_groups(modules: dict, *, device=None, data_backend: str | None = None, overlap: bool = True,
                 timeout: datetime.timedelta = datetime.timedelta(minutes=5),
                 meta_backend: str = "auto") -> RankGroups:
    """Create reorder's process groups; call on every rank of the world with identical arguments.

    modules: name -> list of DP groups, each a list of global ranks (one DP group per tp/cp/pp
    coordinate; all groups of a module have the same size), e.g. {"vision": [[0, 1]],
    "language": [[2, 3, 4, 5]]}. A rank may appear in several modules (colocated); the first
    module listing it is returned. data_backend: the payload backend; by default it follows where the
    data lives (`data_backend_for(device)`). device: where the reordered micro-batches live (the
    exchanger's `device`; None: where they are read). meta_backend: "auto" (metadata on the data
    group's NCCL backend when it has one, else Gloo; the overlap pair's metadata is always on
    Gloo, see the module docstring) or "gloo".
    """
    if meta_backend not in ("auto", "gloo"):
        raise ValueError(f"meta_backend={meta_backend!r} is invalid: expected 'auto' or 'gloo'")
    me = dist.get_rank()
    dp_sizes, where = [], None
    for name in modules:
        dp_groups = [list(g) for g in modules[name]]
        sizes = {len(g) for g in dp_groups}
        if len(sizes) != 1:
            raise ValueError(f"module {name!r} has DP groups of different sizes {sorted(sizes)}")
        dp_sizes.append(sizes.pop())
        for g in dp_groups:
            if me in g and where is None:
                where = (name, g)
    if where is None:
        raise ValueError(f"rank {me} is in no module's DP group: {modules}")
    grid_size = canonical_grid(dp_sizes)
    name, mine = where
    grid = Grid(size=grid_size, dp=len(mine), rank=sorted(mine).index(me))  # DP rank = position in sorted ranks
    if data_backend is None:
        data_backend = data_backend_for(device, torch.cuda.is_available())
    main = side = None
    if grid_size > 1:  # same decision on every rank: group creation is world-wide
        for pair in ("main", "side") if overlap else ("main",):
            for module in modules:
                for ranks in modules[module]:
                    ranks = sorted(ranks)
                    meta = dist.new_group(ranks, backend="gloo", timeout=timeout)
                    data = dist.new_group(ranks, backend=data_backend, timeout=timeout)
                    if module == name and me in ranks and len(ranks) > 1 and sorted(mine) == ranks:
                        coll = TorchCollectives(meta, data, timeout=timeout.total_seconds(),
                                                meta_on_device=(pair == "main" and meta_backend == "auto"
                                                                and "nccl" in data_backend),
                                                spin=2e-4 if pair == "main" else 0.0,
                                                launch_rendezvous=pair == "side" and "nccl" in data_backend)
                        if pair == "main":
                            main = coll
                        else:
                            side = coll
    return RankGroups(module=name, grid=grid, main=main, side=side)
