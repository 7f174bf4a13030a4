"""Window routes: from every slot's canonical order, compute one rank's sends, receives, split
sizes and the reassembly gather (pure numpy; numbers in, numbers out).

Conventions: window of W slots, B samples per slot in natural order (rank q of the module reads
natural indices [q*b, (q+1)*b), b = B/dp). Everything a rank sends to q or receives from q is
ordered by (slot, canonical position). Samples that stay are not sent (split to self is 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True, kw_only=True)
class Routes:
    """One rank's part of a window exchange."""

    rank: int
    dp: int
    local_batch: int
    send_index: tuple  # per dest q: int64 local flat ids (slot*b + i), (slot, position) order
    recv_natural: tuple  # per src q: int64 flat natural ids (slot*B + j) in arrival order
    recv_slot_counts: np.ndarray  # [dp, W]: samples arriving from q for slot s
    gather: np.ndarray  # [W, b]: index into [local slot s] + [from q, slot s, q ascending, q != rank]
    moved_samples: int  # samples this rank sends away

    @property
    def slots(self) -> int:
        return self.gather.shape[0]


def inverse(orders: np.ndarray) -> np.ndarray:
    """Canonical position of every natural index, per slot: pos[s, order[s, p]] = p."""
    orders = np.asarray(orders, dtype=np.int64)
    pos = np.empty_like(orders)
    rows = np.arange(orders.shape[0])[:, None]
    pos[rows, orders] = np.arange(orders.shape[1])[None, :]
    return pos


def window_routes(orders: np.ndarray, dp: int, rank: int) -> Routes:
    """Routes of `rank` (module DP size `dp`) for a window whose slot s has canonical order orders[s]."""
    orders = np.asarray(orders, dtype=np.int64)
    slots, batch = orders.shape
    b = batch // dp
    pos = inverse(orders)
    dest = pos // b  # [W, B]: new owner of each natural index
    src = np.arange(batch) // b  # natural owner
    # every sample keyed by (slot, canonical position): a stable sort order
    key = (np.arange(slots)[:, None] * batch + pos).reshape(-1)
    flat_dest, flat_src = dest.reshape(-1), np.broadcast_to(src, (slots, batch)).reshape(-1)
    by_key = np.argsort(key, kind="stable")  # flat natural ids (slot*B + j) in (slot, position) order
    d_sorted, s_sorted = flat_dest[by_key], flat_src[by_key]
    mine = s_sorted == rank
    local_ids = (by_key // batch) * b + (by_key % batch - rank * b)
    send_index = tuple(local_ids[mine & (d_sorted == q)] if q != rank else np.zeros(0, np.int64)
                       for q in range(dp))
    to_me = d_sorted == rank
    recv_natural = tuple(by_key[to_me & (s_sorted == q)] if q != rank else np.zeros(0, np.int64)
                         for q in range(dp))
    recv_slot_counts = np.zeros((dp, slots), dtype=np.int64)
    for q in range(dp):
        if q != rank and len(recv_natural[q]):
            recv_slot_counts[q] = np.bincount(recv_natural[q] // batch, minlength=slots)
    gather = np.empty((slots, b), dtype=np.int64)
    for s in range(slots):
        nat = orders[s, rank * b:(rank + 1) * b]
        owner = nat // b
        idx = np.where(owner == rank, nat - rank * b, -1)
        base = b
        for q in range(dp):
            if q == rank:
                continue
            from_q = owner == q  # positions ascending == arrival order within slot s
            idx[from_q] = base + np.arange(int(from_q.sum()))
            base += int(recv_slot_counts[q, s])
        gather[s] = idx
    moved = int(sum(len(x) for x in send_index))
    return Routes(rank=rank, dp=dp, local_batch=b, send_index=send_index, recv_natural=recv_natural,
                  recv_slot_counts=recv_slot_counts, gather=gather, moved_samples=moved)
