"""The two collectives a window exchange needs, behind one small interface, plus an emulated
implementation that runs N ranks as threads of one process (CPU tests, the demo).

`all_gather(t)` returns the stacked [size, *t.shape] tensor of every rank's `t` (same shape and
dtype on every rank). `all_to_all(send, send_splits, recv_splits)` is a ragged all_to_all_single on
uint8 buffers and returns the receive buffer. Both raise on timeout or a broken peer, never hang.
"""

from __future__ import annotations

import threading
from typing import Protocol

import torch


class CollectiveError(RuntimeError):
    """A collective could not complete (timeout, or a peer failed)."""


class Collectives(Protocol):
    rank: int
    size: int

    def all_gather(self, t: torch.Tensor) -> torch.Tensor: ...

    def all_to_all(self, send: torch.Tensor, send_splits: list, recv_splits: list) -> torch.Tensor: ...


class _Barrier:
    """A barrier whose completed rounds stay completed when it is aborted later (unlike
    threading.Barrier, where a released-but-not-yet-running waiter can still see 'broken')."""

    def __init__(self, parties: int):
        self.parties, self.count, self.generation, self.broken = parties, 0, 0, False
        self.cond = threading.Condition()

    def wait(self, timeout: float) -> None:
        with self.cond:
            if self.broken:
                raise threading.BrokenBarrierError
            gen = self.generation
            self.count += 1
            if self.count == self.parties:
                self.count, self.generation = 0, gen + 1
                self.cond.notify_all()
                return
            if not self.cond.wait_for(lambda: self.generation != gen or self.broken, timeout):
                self.broken = True
                self.cond.notify_all()
            if self.generation == gen:
                raise threading.BrokenBarrierError

    def abort(self) -> None:
        with self.cond:
            self.broken = True
            self.cond.notify_all()


class EmulatedGroup:
    """Shared state of N emulated ranks; `member(rank)` gives one rank's Collectives."""

    def __init__(self, size: int, timeout: float = 60.0):
        self.size = size
        self.timeout = timeout
        self._barrier = _Barrier(size)
        self._slots = [None] * size

    def member(self, rank: int) -> "EmulatedCollectives":
        return EmulatedCollectives(self, rank)

    def abort(self) -> None:
        """Break every pending and future collective (a rank died): peers raise instead of hanging."""
        self._barrier.abort()

    def _sync(self):
        try:
            self._barrier.wait(self.timeout)
        except threading.BrokenBarrierError:
            raise CollectiveError(f"emulated collective broken: a peer failed or did not arrive "
                                  f"within timeout={self.timeout}s") from None


class EmulatedCollectives:
    """One emulated rank; every call is a real rendezvous with the other threads."""

    def __init__(self, group: EmulatedGroup, rank: int):
        self.group, self.rank, self.size = group, rank, group.size

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        g = self.group
        g._sync()
        g._slots[self.rank] = t
        g._sync()
        shapes = {tuple(x.shape) for x in g._slots}
        out = torch.stack([x.clone() for x in g._slots]) if len(shapes) == 1 else None
        g._sync()
        if out is None:
            raise CollectiveError(f"all_gather shape mismatch across ranks: {sorted(shapes)}")
        return out

    def all_to_all(self, send, send_splits, recv_splits):
        g = self.group
        g._sync()
        g._slots[self.rank] = (send, list(send_splits))
        g._sync()
        parts = []
        for q in range(self.size):
            buf, splits = g._slots[q]
            start = sum(splits[:self.rank])
            if splits[self.rank] != recv_splits[q]:
                parts = None
                break
            parts.append(buf[start:start + splits[self.rank]])
        out = None if parts is None else (torch.cat(parts) if parts else send.new_empty(0))
        g._sync()
        if out is None:
            raise CollectiveError(f"rank {self.rank} expected {recv_splits} bytes, peers sent otherwise")
        return out


def run_emulated(size: int, fn, timeout: float = 60.0, return_exceptions: bool = False):
    """Run fn(rank, collectives) on `size` threads; return results in rank order.

    If any rank raises, the group is aborted so peers fail instead of waiting. With
    return_exceptions, each rank's exception takes the place of its result; otherwise the first
    real error (not a CollectiveError it caused on peers) is re-raised.
    """
    group = EmulatedGroup(size, timeout)
    results, errors = [None] * size, [None] * size

    def body(r):
        try:
            results[r] = fn(r, group.member(r))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors[r] = e
            group.abort()

    threads = [threading.Thread(target=body, args=(r,), name=f"emulated-rank-{r}") for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if return_exceptions:
        return [e if e is not None else res for res, e in zip(results, errors)]
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if failed:
        primary = next(((r, e) for r, e in failed if not isinstance(e, CollectiveError)), failed[0])
        raise primary[1]
    return results
