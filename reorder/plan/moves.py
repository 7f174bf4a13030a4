"""The move list of one rank for one window: which bytes go where, as pure data.

From the window plan, every rank's counts and the layout's byte sizes, `build_moves` computes
vectorized (no per-sample Python loop) two segment tables that an executor
(`reorder.exchange.executors`) carries out:

- `pack`: from this rank's own micro-batches (one source buffer per slot and field, the field's
  contiguous bytes) into the send buffer, whose part for peer q holds the pieces q receives;
- `assemble`: from the receive buffer and this rank's own micro-batches into one output block per
  slot, laid out as a piece of B/dp samples; the output fields are typed views of that block.

Data wire format (`piece_layout`): a *piece* is n samples, one region per byte field in layout
order (dense fields [*pre, n, *post], per-row, per-image, then the samples' pickled list bytes),
each region starting at a multiple of `ALIGN` bytes. The send buffer holds, per peer q ascending,
the pieces for q's slots ascending; inside a piece samples are in canonical-position order. Sender
and receiver compute the same piece sizes from the gathered counts, so nothing else travels.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from reorder.plan.counts import SampleCounts
from reorder.plan.segments import Segments
from reorder.plan.window import WindowPlan

ALIGN = 16
KINDS = ("dense", "row", "image", "list")


@dataclass(frozen=True, slots=True)
class ByteField:
    """A field as bytes: kind (one of KINDS); pre: leading entries before the batch dim (dense
    fields, e.g. 3 for MRoPE position_ids [3, B, S]; 1 otherwise); unit: bytes of one sample at
    one leading index (dense), of one row / image entry, or 1 (list bytes)."""

    kind: str
    pre: int
    unit: int


@dataclass(frozen=True, kw_only=True)
class MoveList:
    """This rank's bytes to move for one window (see the module docstring for buffers).

    pack: segments, sources [slot * F + field] = this rank's field buffers, destination 0 = send
    buffer. assemble: sources [0] = receive buffer, [1 + slot * F + field] = this rank's field
    buffers; destinations [slot] = output blocks. send_splits / recv_splits: bytes per peer.
    block_bytes [W]: output block sizes; regions [W, F]: each field's offset in its block;
    out_counts [W, B/dp] SampleCounts of the output samples. kept [W]: output slot s is this
    rank's own slot s, in order (nothing to copy). send_items / recv_items: per peer, the flat
    natural ids (slot * B + j) in wire order."""

    pack: Segments
    assemble: Segments
    send_splits: list
    recv_splits: list
    block_bytes: np.ndarray
    regions: np.ndarray
    out_counts: SampleCounts
    kept: np.ndarray
    send_items: tuple
    recv_items: tuple


def align(n):
    """Round up to a multiple of ALIGN (ints or int64 arrays)."""
    return (np.asarray(n, dtype=np.int64) + ALIGN - 1) // ALIGN * ALIGN


def piece_layout(fields: tuple, n: np.ndarray, totals: np.ndarray) -> tuple:
    """(region offsets [P, F], sizes [P]) of P pieces of n[p] samples holding totals[kind - 1, p]
    entries of each ragged kind (row, image, list)."""
    field, _, kind, unit, dense = _columns(tuple(fields))
    kind, size = _field_units(tuple(fields))
    n = np.asarray(n, dtype=np.int64)
    entries = np.concatenate([n[None, :], np.asarray(totals, dtype=np.int64).reshape(len(KINDS) - 1, len(n))])
    sizes = align(entries[kind].T * size)
    regions = np.zeros_like(sizes)
    np.cumsum(sizes[:, :-1], axis=1, out=regions[:, 1:])
    return regions, sizes.sum(axis=1)


def _grouped_before(values: np.ndarray, group: np.ndarray) -> np.ndarray:
    """Exclusive running sum of `values` (rows) within each run of equal `group` (items sorted by group)."""
    run = np.cumsum(values, axis=0) - values
    if not len(values):
        return run
    new = np.empty(len(group), bool)
    new[0], new[1:] = True, group[1:] != group[:-1]
    starts = np.flatnonzero(new)
    return run - np.repeat(run[starts], np.diff(np.append(starts, len(values))), axis=0)


@dataclass(frozen=True)
class _Place:
    """Where items sit in their buffers: buffer (per item; plus the field index where per_field is
    1: a rank's own buffers hold one field each), base byte offset, samples n of their container,
    index j in it, entries before them [items, kinds], each field's region offset [items, F]."""

    buf: np.ndarray
    base: np.ndarray
    n: np.ndarray
    j: np.ndarray
    before: np.ndarray
    region: np.ndarray
    per_field: np.ndarray


@lru_cache(maxsize=64)
def _columns(fields: tuple) -> tuple:
    """One column per (field, leading index) a sample's bytes are split into: (field, leading index,
    kind index, unit bytes, dense?) arrays; a dense field of `pre` leading entries has pre columns."""
    cols = [(i, p, KINDS.index(f.kind), f.unit) for i, f in enumerate(fields)
            for p in range(f.pre if f.kind == "dense" else 1)]
    field, p, kind, unit = (np.array(c, dtype=np.int64) for c in zip(*cols)) if cols else [np.zeros(0, np.int64)] * 4
    return field, p, kind, unit, kind == 0


@lru_cache(maxsize=64)
def _field_units(fields: tuple) -> tuple:
    """Per field: kind index, and bytes per entry of that kind (pre x unit for dense fields)."""
    return (np.array([KINDS.index(f.kind) for f in fields], dtype=np.int64),
            np.array([f.pre * f.unit if f.kind == "dense" else f.unit for f in fields], dtype=np.int64))


def _offsets(pl: _Place, field, p, kind, unit, dense) -> np.ndarray:
    """Byte offset [items, columns] of every item's bytes of every column in its container."""
    inner = np.where(dense, (p * pl.n[:, None] + pl.j[:, None]) * unit, pl.before[:, kind] * unit)
    return pl.base[:, None] + pl.region[:, field] + inner


def _segments(fields, entries: np.ndarray, src: _Place, dst: _Place) -> Segments:
    """The segment table copying every item's bytes of every field from `src` to `dst`, as few
    segments as contiguity allows; vectorized over items and fields together."""
    field, p, kind, unit, dense = cols = _columns(tuple(fields))
    shape = (len(src.buf), len(field))
    parts = [np.broadcast_to(src.buf[:, None] + field * src.per_field[:, None], shape), _offsets(src, *cols),
             np.broadcast_to(dst.buf[:, None] + field * dst.per_field[:, None], shape), _offsets(dst, *cols),
             np.broadcast_to(entries[:, kind] * unit, shape)]
    return Segments.trusted(*(np.ascontiguousarray(x, dtype=np.int64).reshape(-1) for x in parts)).merged()


def build_moves(fields: tuple, counts: SampleCounts, plan: WindowPlan, rank: int) -> MoveList:
    """The move list of `rank` for a window with gathered counts [W, B] and its plan."""
    w, batch = plan.orders.shape
    dp, nf = plan.dp, len(fields)
    b = batch // dp
    ids = np.arange(w * batch, dtype=np.int64)
    src_rank, dst_rank = (ids % batch) // b, plan.dest_pos // b
    src_slot, local = ids // batch, ids % batch - (ids % batch) // b * b
    entries = _entries(counts.flat())
    own_ids = np.flatnonzero(src_rank == rank)  # natural order per slot, slot-major
    own_before = _grouped_before(entries[own_ids], src_slot[own_ids])

    def own_place(items, first_buffer):  # a rank's own buffers: one per (slot, field)
        n = len(items)
        return _Place(first_buffer + src_slot[items] * nf, np.zeros(n, np.int64), np.full(n, b, np.int64),
                      local[items], own_before[np.searchsorted(own_ids, items)], np.zeros((n, nf), np.int64),
                      np.ones(n, np.int64))

    def wire_order(sel, peer):  # peer, then destination slot, then canonical position
        return ids[sel][np.lexsort((plan.dest_pos[sel], plan.dest_slot[sel], peer[sel]))]

    send = recv = ids[:0]
    send_sizes = recv_sizes = np.zeros(dp * w, np.int64)
    pack = Segments.trusted(*(ids[:0] for _ in range(5)))
    if plan.moves_anything and dp > 1:  # else nothing crosses ranks: no pieces, no pack, no all_to_all
        send = wire_order((src_rank == rank) & (dst_rank != rank), dst_rank)
        recv = wire_order((dst_rank == rank) & (src_rank != rank), src_rank)
        sent, send_sizes = _pieces(fields, entries[send], dst_rank[send] * w + plan.dest_slot[send], dp * w)
        got, recv_sizes = _pieces(fields, entries[recv], src_rank[recv] * w + plan.dest_slot[recv], dp * w)
        pack = _segments(fields, entries[send], own_place(send, 0), sent)
    # assemble: own and received samples -> output blocks, by destination slot, then position
    mine = np.flatnonzero(dst_rank == rank)
    mine = mine[np.lexsort((plan.dest_pos[mine], plan.dest_slot[mine]))]
    out_slot, k = plan.dest_slot[mine], plan.dest_pos[mine] - rank * b
    is_own = src_rank[mine] == rank
    kept = np.bincount(out_slot, weights=is_own & (src_slot[mine] == out_slot) & (local[mine] == k),
                       minlength=w) == b
    out = entries[mine]
    regions, block = piece_layout(fields, np.full(w, b), out[:, 1:].reshape(w, b, -1).sum(axis=1).T)
    todo = ~kept[out_slot]  # kept slots are returned as they are: nothing to assemble
    in_recv = np.zeros(w * batch, np.int64)
    in_recv[recv] = np.arange(len(recv))
    if len(recv):
        src = _combine(is_own[todo], own_place(mine[todo & is_own], 1), _take(got, in_recv[mine[todo & ~is_own]]))
    else:  # every output sample is this rank's own
        src = own_place(mine[todo], 1)
    dst = _Place(out_slot[todo], np.zeros(todo.sum(), np.int64), np.full(todo.sum(), b, np.int64), k[todo],
                 _grouped_before(out, out_slot)[todo], regions[out_slot[todo]], np.zeros(todo.sum(), np.int64))
    return MoveList(pack=pack, assemble=_segments(fields, out[todo], src, dst),
                    send_splits=send_sizes.reshape(dp, w).sum(axis=1).tolist(),
                    recv_splits=recv_sizes.reshape(dp, w).sum(axis=1).tolist(), block_bytes=block, regions=regions,
                    out_counts=SampleCounts(counts.flat().table[mine].reshape(w, b, -1)), kept=kept,
                    send_items=_split(send, dst_rank[send], dp), recv_items=_split(recv, src_rank[recv], dp))


def _entries(counts: SampleCounts) -> np.ndarray:
    """int64 [samples, kinds]: per sample, entries of a field of each kind (1 for dense)."""
    return np.stack([counts.entries(k) for k in KINDS], axis=1).astype(np.int64)


def _pieces(fields, entries: np.ndarray, key: np.ndarray, n_keys: int):
    """_Place of items in wire order (`key` = peer * W + slot, non-decreasing) in the pieces laid
    out back to back in one buffer (buffer 0); returns (place, size of every piece)."""
    n = np.bincount(key, minlength=n_keys)
    totals = np.stack([np.bincount(key, weights=entries[:, c], minlength=n_keys) for c in range(1, len(KINDS))])
    regions, sizes = piece_layout(fields, n, totals.astype(np.int64))
    starts = np.cumsum(sizes) - sizes
    j = _grouped_before(np.ones(len(key), np.int64), key)
    zeros = np.zeros(len(key), np.int64)
    return _Place(zeros, starts[key], n[key], j, _grouped_before(entries, key), regions[key], zeros), sizes


def _take(place: _Place, index) -> _Place:
    return _Place(place.buf[index], place.base[index], place.n[index], place.j[index], place.before[index],
                  place.region[index], place.per_field[index])


def _combine(first: np.ndarray, a: _Place, b: _Place) -> _Place:
    """Items where `first` is True come from `a` (in order), the others from `b` (in order)."""
    def mix(x, y):
        out = np.empty((len(first), *x.shape[1:]), np.int64)
        out[first], out[~first] = x, y
        return out

    return _Place(*(mix(getattr(a, f), getattr(b, f)) for f in ("buf", "base", "n", "j", "before", "region",
                                                                 "per_field")))


def _split(items: np.ndarray, peer: np.ndarray, dp: int) -> tuple:
    """Per peer, its items (in wire order, grouped by peer)."""
    bounds = np.searchsorted(peer, np.arange(dp + 1))
    return tuple(items[bounds[q]:bounds[q + 1]] for q in range(dp))


@dataclass(frozen=True, kw_only=True)
class TakeList:
    """Samples `index` of sources concatenated, into one block (a local reorder or selection):
    segments from sources [source * F + field] to destination 0; regions [F] and block_bytes of the
    block; out_counts [n] of the samples taken."""

    segments: Segments
    regions: np.ndarray
    block_bytes: int
    out_counts: SampleCounts


def take_moves(fields: tuple, counts: SampleCounts, sizes: list, index) -> TakeList:
    """The copy of samples `index` (into the concatenation of sources holding sizes[i] samples each,
    counts [sum(sizes)]) into one block in the wire format, any index (repeats, subsets) allowed."""
    index = np.asarray(index, dtype=np.int64).reshape(-1)
    sizes = np.asarray(sizes, dtype=np.int64)
    source = np.repeat(np.arange(len(sizes)), sizes)
    first = np.cumsum(sizes) - sizes
    entries = _entries(SampleCounts(counts.table.reshape(-1, counts.table.shape[-1])))
    before = _grouped_before(entries, source)
    n, nf = len(index), len(fields)
    src = _Place(source[index] * nf, np.zeros(n, np.int64), sizes[source[index]], index - first[source[index]],
                 before[index], np.zeros((n, nf), np.int64), np.ones(n, np.int64))
    out = entries[index]
    regions, block = piece_layout(fields, np.array([n]), out[:, 1:].sum(axis=0)[:, None])
    zeros = np.zeros(n, np.int64)
    dst = _Place(zeros, zeros, np.full(n, n, np.int64), np.arange(n), _grouped_before(out, zeros),
                 np.repeat(regions, n, axis=0), zeros)
    return TakeList(segments=_segments(fields, out, src, dst), regions=regions[0], block_bytes=int(block[0]),
                    out_counts=SampleCounts(counts.table.reshape(-1, counts.table.shape[-1])[index]))
