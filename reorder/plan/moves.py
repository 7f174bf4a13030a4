"""The move list of one rank for one window: which bytes go where, as pure data.

From the window plan, every rank's counts and the layout's byte sizes, `build_moves` computes
vectorized (no per-sample Python loop) two segment tables that an executor
(`reorder.exchange.executors`) carries out:

- `pack`: from this rank's own micro-batches (one source buffer per slot and field, the field's
  contiguous bytes) into the send buffer, whose part for peer q holds the pieces q receives;
- `assemble`: from the receive buffer and this rank's own micro-batches into the output field
  buffers of every slot that changes, laid out like the source buffers (a field's contiguous bytes
  for B/dp samples), so the outputs are allocated as typed tensors and nothing is viewed.

Data wire format (`piece_layout`): a *piece* is n samples, one region per byte field in layout
order (dense fields [*pre, n, *post], per-row, per-image, then the samples' pickled list bytes),
each region starting at a multiple of `ALIGN` bytes. The send buffer holds, per peer q ascending,
the pieces for q's slots ascending; inside a piece samples are in canonical-position order. Sender
and receiver compute the same piece sizes from the gathered counts, so nothing else travels.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

import numpy as np

from reorder.plan.counts import COLUMNS, SampleCounts
from reorder.plan.segments import Segments
from reorder.plan.shared import read_only
from reorder.plan.window import WindowPlan

ALIGN = 16
KINDS = ("dense", "row", "image", "list")


class ByteField(NamedTuple):
    """A field as bytes: kind (one of KINDS); pre: leading entries before the batch dim (dense
    fields, e.g. 3 for MRoPE position_ids [3, B, S]; 1 otherwise); unit: bytes of one sample at
    one leading index (dense), of one row / image entry, or 1 (list bytes). (A named tuple: the
    move list's per-layout tables are cached by it, and tuples hash fast.)"""

    kind: str
    pre: int
    unit: int


@dataclass(frozen=True, kw_only=True)
class MoveList:
    """This rank's bytes to move for one window (see the module docstring for buffers).

    pack: segments, sources [slot * F + field] = this rank's field buffers, destination 0 = send
    buffer. assemble: sources [0] = receive buffer, [1 + slot * F + field] = this rank's field
    buffers; destinations [k * F + field] = the field buffers of the k-th output slot to assemble
    (the slots not kept, ascending), each field's samples as in a source buffer. send_splits /
    recv_splits: bytes per peer. out_counts [W, B/dp]: SampleCounts of the output samples (they
    size the output buffers). kept [W]: output slot s is this rank's own slot s, in order (nothing
    to copy). send_items / recv_items: per peer, the flat natural ids (slot * B + j) in wire order."""

    pack: Segments
    assemble: Segments
    send_splits: list
    recv_splits: list
    out_counts: SampleCounts
    kept: np.ndarray
    send_items: tuple
    recv_items: tuple


def align(n):
    """Round up to a multiple of ALIGN (ints or int64 arrays)."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


class _Columns(NamedTuple):
    """One column per (field, leading index) a sample's bytes are split into (a dense field of
    `pre` leading entries has pre columns): field, leading index, kind index, unit bytes, dense?;
    and per field: kind index and bytes per entry of that kind (pre x unit for dense fields)."""

    field: np.ndarray
    p: np.ndarray
    kind: np.ndarray
    unit: np.ndarray
    dense: np.ndarray
    field_kind: np.ndarray
    field_size: np.ndarray


def _columns(fields: tuple) -> _Columns:
    cols = [(i, p, KINDS.index(f.kind), f.unit) for i, f in enumerate(fields)
            for p in range(f.pre if f.kind == "dense" else 1)]
    field, p, kind, unit = (np.array(c, dtype=np.int64) for c in zip(*cols)) if cols else [np.zeros(0, np.int64)] * 4
    return _Columns(*map(read_only, (field, p, kind, unit, kind == 0,
                                     np.array([KINDS.index(f.kind) for f in fields], dtype=np.int64),
                                     np.array([f.pre * f.unit if f.kind == "dense" else f.unit for f in fields],
                                              dtype=np.int64))))


_columns = lru_cache(maxsize=64)(_columns)  # a plain function wrapped: mutmut mutates no decorated function


def piece_layout(fields: tuple, n: np.ndarray, totals: np.ndarray) -> tuple:
    """(region offsets [P, F], sizes [P]) of P pieces of n[p] samples holding totals[kind - 1, p]
    entries of each ragged kind (row, image, list)."""
    cols = _columns(tuple(fields))
    entries = np.vstack([n, totals])
    sizes = align(entries[cols.field_kind].T * cols.field_size)
    regions = np.cumsum(sizes, axis=1) - sizes
    return regions, sizes.sum(axis=1)


def _grouped_before(values: np.ndarray, group: np.ndarray) -> np.ndarray:
    """Exclusive running sum of `values` (rows) within each run of equal `group` (items sorted by group)."""
    run = np.cumsum(values, axis=0) - values
    if not len(values):
        return run
    starts = np.flatnonzero(np.concatenate([[True], group[1:] != group[:-1]]))
    return run - np.repeat(run[starts], np.diff(np.append(starts, len(values))), axis=0)


def _before_in_runs(values: np.ndarray, run: int) -> np.ndarray:
    """Exclusive running sum of `values` [n, K] within consecutive runs of `run` rows (n % run == 0):
    the entries before each sample in a shard or output block of `run` samples."""
    v = values.reshape(len(values) // run, run, len(KINDS))
    return (np.cumsum(v, axis=1) - v).reshape(values.shape)


class _Place(NamedTuple):
    """Where items sit in their buffers: buffer (per item; plus the field index where per_field is
    1: a rank's own buffers hold one field each), base byte offset, samples n of their container,
    index j in it, entries before them [items, kinds], each field's region offset [items, F]. An
    array of length 1 (first axis) holds what every item shares; it broadcasts over the items."""

    buf: np.ndarray
    base: np.ndarray
    n: np.ndarray
    j: np.ndarray
    before: np.ndarray
    region: np.ndarray
    per_field: np.ndarray


def _offsets(pl: _Place, cols: _Columns) -> np.ndarray:
    """Byte offset [items, columns] of every item's bytes of every column in its container."""
    inner = np.where(cols.dense, (cols.p * pl.n[:, None] + pl.j[:, None]) * cols.unit, pl.before[:, cols.kind] * cols.unit)
    return pl.base[:, None] + pl.region[:, cols.field] + inner


def _segments(fields, entries: np.ndarray, src: _Place, dst: _Place) -> Segments:
    """The segment table copying every item's bytes of every column from `src` to `dst`: one
    segment per (item, column), item-major, zero-byte ones included; vectorized over both. (Fusing
    contiguous segments is the executor's business: it pays for per-segment copies, not for one
    launch over a table.)"""
    cols = _columns(tuple(fields))
    items, columns = len(src.buf), len(cols.field)
    table = np.empty((5, items, columns), np.int64)  # rows: Segments' five arrays
    table[0] = src.buf[:, None] + cols.field * src.per_field[:, None]
    table[1] = _offsets(src, cols)
    table[2] = dst.buf[:, None] + cols.field * dst.per_field[:, None]
    table[3] = _offsets(dst, cols)
    table[4] = entries[:, cols.kind] * cols.unit
    return Segments.trusted(*table.reshape(5, items * columns))


def build_moves(fields: tuple, counts: SampleCounts, plan: WindowPlan, rank: int) -> MoveList:
    """The move list of `rank` for a window with gathered counts [W, B] and its plan."""
    w, batch = plan.orders.shape
    dp, nf = plan.dp, len(fields)
    b = batch // dp
    ids = np.arange(w * batch)
    src_slot, src_pos = ids // batch, ids % batch
    src_rank, dst_rank = src_pos // b, plan.dest_pos // b
    local = src_pos % b
    table = counts.flat().table
    entries = _entries(table)
    own_before = _before_in_runs(entries, b)  # every (slot, rank) shard is a run of b natural ids
    # what every item of a rank's own buffers or of an output slot shares, as length-1 arrays that
    # broadcast over the items: base offset 0, b samples, region offsets 0, one buffer per field
    zero, shard_n, no_regions, per_field = _ZERO, np.full(1, b), np.zeros((1, nf), np.int64), _ONE

    def own_place(items, first_buffer):  # a rank's own buffers: one per (slot, field)
        return _Place(first_buffer + src_slot[items] * nf, zero, shard_n, local[items], own_before[items],
                      no_regions, per_field)

    def wire_order(sel, peer):  # peer, then destination slot, then canonical position
        return ids[sel][np.lexsort((plan.dest_pos[sel], plan.dest_slot[sel], peer[sel]))]

    send = recv = _NONE
    send_sizes = recv_sizes = np.zeros(dp * w, np.int64)
    pack, send_items, recv_items = _NO_SEGMENTS, (_NONE,) * dp, (_NONE,) * dp
    if plan.moves_anything and dp > 1:  # else nothing crosses ranks: no pieces, no pack, no all_to_all
        send = wire_order((src_rank == rank) & (dst_rank != rank), dst_rank)
        recv = wire_order((dst_rank == rank) & (src_rank != rank), src_rank)
        sent, send_sizes = _pieces(fields, entries[send], dst_rank[send] * w + plan.dest_slot[send], dp * w)
        got, recv_sizes = _pieces(fields, entries[recv], src_rank[recv] * w + plan.dest_slot[recv], dp * w)
        pack = _segments(fields, entries[send], own_place(send, 0), sent)
        send_items, recv_items = _split(send, dst_rank[send], dp), _split(recv, src_rank[recv], dp)
    # assemble: output slot s holds canonical positions rank*b .. rank*b + b - 1 of slot s
    mine = dst_rank == rank
    out = np.empty(w * b, np.int64)  # [W * b] natural id at each output (slot, position)
    out[plan.dest_slot[mine] * b + plan.dest_pos[mine] - rank * b] = ids[mine]
    kept = (out.reshape(w, b) == (np.arange(w) * batch + rank * b)[:, None] + np.arange(b)).all(axis=1)
    items = out[np.repeat(~kept, b)]  # kept slots are returned as they are: nothing to assemble
    out_entries = entries[items]
    src = own_place(items, 1)
    if len(recv):
        in_recv = np.zeros(w * batch, np.int64)
        in_recv[recv] = np.arange(len(recv))
        src = _combine(src_rank[items] == rank, src, got, in_recv[items])
    k = np.arange(len(items))  # the k-th output sample: output buffer k // b, position k % b
    dst = _Place(k // b * nf, zero, shard_n, k % b, _before_in_runs(out_entries, b), no_regions, per_field)
    return MoveList(pack=pack, assemble=_segments(fields, out_entries, src, dst),
                    send_splits=send_sizes.reshape(dp, w).sum(axis=1).tolist(),
                    recv_splits=recv_sizes.reshape(dp, w).sum(axis=1).tolist(),
                    out_counts=SampleCounts(table[out].reshape(w, b, len(COLUMNS))), kept=kept,
                    send_items=send_items, recv_items=recv_items)


_NONE = np.zeros(0, np.int64)
_NO_SEGMENTS = Segments.trusted(*(_NONE,) * 5)
_ZERO, _ONE = np.zeros(1, np.int64), np.ones(1, np.int64)
_ENTRY_COLUMNS = [COLUMNS.index(c) for c in ("rows", "images", "list_bytes")]  # KINDS[1:], in order


def _entries(table: np.ndarray) -> np.ndarray:
    """int64 [samples, kinds]: per sample of a flat counts table [samples, columns], entries of a
    field of each kind (1 for dense)."""
    out = np.full((len(table), len(KINDS)), 1)
    out[:, 1:] = table[:, _ENTRY_COLUMNS]
    return out


def _pieces(fields, entries: np.ndarray, key: np.ndarray, n_keys: int):
    """_Place of items in wire order (`key` = peer * W + slot, non-decreasing) in the pieces laid
    out back to back in one buffer (buffer 0); returns (place, size of every piece)."""
    n = np.bincount(key, minlength=n_keys)
    totals = np.stack([np.bincount(key, weights=entries[:, c], minlength=n_keys) for c in range(1, len(KINDS))])
    regions, sizes = piece_layout(fields, n, totals.astype(np.int64))
    starts = np.cumsum(sizes) - sizes
    j = _grouped_before(np.full(len(key), 1), key)
    zeros = np.full(len(key), 0)
    return _Place(zeros, starts[key], n[key], j, _grouped_before(entries, key), regions[key], zeros), sizes


def _combine(own: np.ndarray, a: _Place, b: _Place, index: np.ndarray) -> _Place:
    """Per item, `a`'s entry where `own`, else `b`'s entry at `index` (items of `a` and the index
    are aligned; `b` holds the received items in wire order)."""
    return _Place(*(np.where(own.reshape(len(own), *[1] * (x.ndim - 1)), x, y[index]) for x, y in zip(a, b)))


def _split(items: np.ndarray, peer: np.ndarray, dp: int) -> tuple:
    """Per peer, its items (in wire order, grouped by peer)."""
    return tuple(np.split(items, np.searchsorted(peer, np.arange(1, dp))))


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
    index = np.asarray(index).astype(np.int64).ravel()
    sizes = np.asarray(sizes).astype(np.int64)
    source = np.repeat(np.arange(len(sizes)), sizes)
    first = np.cumsum(sizes) - sizes
    table = counts.flat().table
    entries = _entries(table)
    before = _grouped_before(entries, source)
    n, nf = len(index), len(fields)
    src = _Place(source[index] * nf, np.full(n, 0), sizes[source[index]], index - first[source[index]],
                 before[index], np.full((n, nf), 0), np.full(n, 1))
    out = entries[index]
    regions, block = piece_layout(fields, np.array([n]), out[:, 1:].sum(axis=0)[:, None])
    zeros = np.full(n, 0)
    dst = _Place(zeros, zeros, np.full(n, n), np.arange(n), _grouped_before(out, zeros),
                 np.repeat(regions, n, axis=0), zeros)
    return TakeList(segments=_segments(fields, out, src, dst), regions=regions[0], block_bytes=int(block[0]),
                    out_counts=SampleCounts(table[index]))
