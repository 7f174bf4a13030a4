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


def piece_layout(fields: tuple, n: np.ndarray, totals: dict) -> tuple:
    """(region offsets [P, F], sizes [P]) of P pieces of n[p] samples holding totals[kind][p] entries."""
    n = np.asarray(n, dtype=np.int64)
    sizes = np.stack([align(f.pre * n * f.unit) if f.kind == "dense" else align(totals[f.kind] * f.unit)
                      for f in fields], axis=1) if fields else np.zeros((len(n), 0), np.int64)
    regions = np.zeros_like(sizes)
    np.cumsum(sizes[:, :-1], axis=1, out=regions[:, 1:])
    return regions, sizes.sum(axis=1)


def _grouped_before(values: np.ndarray, group: np.ndarray) -> np.ndarray:
    """Exclusive running sum of `values` within each run of equal `group` (items sorted by group)."""
    run = np.cumsum(values) - values
    if not len(values):
        return run
    starts = np.flatnonzero(np.r_[True, group[1:] != group[:-1]])
    return run - np.repeat(run[starts], np.diff(np.r_[starts, len(values)]))


@dataclass(frozen=True)
class _Place:
    """Where items sit in their buffers: buffer (per item, or per item and field with `per_field`),
    base byte offset, samples n of their container, index j in it, entries before them per kind,
    and each field's region offset [items, F] in the container."""

    buf: np.ndarray
    base: np.ndarray
    n: np.ndarray
    j: np.ndarray
    before: dict
    region: np.ndarray
    per_field: object = 0  # 1 where a container holds one field (a rank's own buffers): buffer = buf + field


def _segments(fields, entries: dict, src: _Place, dst: _Place):
    """The segment table copying every item's bytes of every field from `src` to `dst`."""
    cols = [[], [], [], [], []]
    for f_i, f in enumerate(fields):
        if f.kind == "dense":
            p = np.arange(f.pre, dtype=np.int64)[None, :]
            offs = [(pl.base + pl.region[:, f_i])[:, None] + (p * pl.n[:, None] + pl.j[:, None]) * f.unit
                    for pl in (src, dst)]
            size = np.full(offs[0].shape, f.unit, np.int64)
            bufs = [np.broadcast_to((pl.buf + f_i * pl.per_field)[:, None], offs[0].shape) for pl in (src, dst)]
        else:
            offs = [pl.base + pl.region[:, f_i] + pl.before[f.kind] * f.unit for pl in (src, dst)]
            size = entries[f.kind] * f.unit
            bufs = [pl.buf + f_i * pl.per_field for pl in (src, dst)]
        for c, v in zip(cols, (bufs[0], offs[0], bufs[1], offs[1], size)):
            c.append(np.asarray(v, dtype=np.int64).reshape(-1))
    return Segments(*(np.concatenate(c) if c else np.zeros(0, np.int64) for c in cols)).merged()


def build_moves(fields: tuple, counts: SampleCounts, plan: WindowPlan, rank: int) -> MoveList:
    """The move list of `rank` for a window with gathered counts [W, B] and its plan."""
    w, batch = plan.orders.shape
    dp, nf = plan.dp, len(fields)
    b = batch // dp
    flat = counts.flat()
    ids = np.arange(w * batch, dtype=np.int64)
    src_rank, dst_rank = (ids % batch) // b, plan.dest_pos // b
    src_slot, local = ids // batch, ids % batch - (ids % batch) // b * b
    entries = {k: flat.entries(k).reshape(-1).astype(np.int64) for k in KINDS}
    own_ids = np.flatnonzero(src_rank == rank)  # natural order per slot, slot-major
    own_before = {k: _grouped_before(entries[k][own_ids], src_slot[own_ids]) for k in KINDS[1:]}

    def own_place(items, first_buffer):  # a rank's own buffers: one per (slot, field)
        at, n = np.searchsorted(own_ids, items), len(items)
        return _Place(first_buffer + src_slot[items] * nf, np.zeros(n, np.int64), np.full(n, b, np.int64),
                      local[items], {k: v[at] for k, v in own_before.items()}, np.zeros((n, nf), np.int64), 1)

    def wire_order(sel, peer):  # peer, then destination slot, then canonical position
        return ids[sel][np.lexsort((plan.dest_pos[sel], plan.dest_slot[sel], peer[sel]))]

    send = wire_order((src_rank == rank) & (dst_rank != rank), dst_rank)
    recv = wire_order((dst_rank == rank) & (src_rank != rank), src_rank)
    on_wire = {}
    for name, items, peer in (("send", send, dst_rank), ("recv", recv, src_rank)):
        key = peer[items] * w + plan.dest_slot[items]
        on_wire[name] = _pieces(fields, {k: v[items] for k, v in entries.items()}, key, dp * w)
    pack = _segments(fields, {k: v[send] for k, v in entries.items()}, own_place(send, 0), on_wire["send"][0])
    # assemble: own and received samples -> output blocks, by destination slot, then position
    mine = np.flatnonzero(dst_rank == rank)
    mine = mine[np.lexsort((plan.dest_pos[mine], plan.dest_slot[mine]))]
    out_slot, k = plan.dest_slot[mine], plan.dest_pos[mine] - rank * b
    out = {kk: v[mine] for kk, v in entries.items()}
    regions, block = piece_layout(fields, np.full(w, b), {kk: out[kk].reshape(w, b).sum(axis=1) for kk in KINDS[1:]})
    dst = _Place(out_slot, np.zeros(len(mine), np.int64), np.full(len(mine), b, np.int64), k,
                 {kk: _grouped_before(out[kk], out_slot) for kk in KINDS[1:]}, regions[out_slot])
    is_own = src_rank[mine] == rank
    in_recv = np.zeros(w * batch, np.int64)
    in_recv[recv] = np.arange(len(recv))
    src = _combine(is_own, own_place(mine[is_own], 1), _take(on_wire["recv"][0], in_recv[mine[~is_own]]))
    assemble = _segments(fields, out, src, dst)
    kept = np.bincount(out_slot, weights=is_own & (src_slot[mine] == out_slot) & (local[mine] == k),
                       minlength=w) == b
    return MoveList(pack=pack, assemble=assemble, send_splits=on_wire["send"][1].reshape(dp, w).sum(axis=1).tolist(),
                    recv_splits=on_wire["recv"][1].reshape(dp, w).sum(axis=1).tolist(), block_bytes=block,
                    regions=regions, out_counts=SampleCounts(flat.table[mine].reshape(w, b, -1)), kept=kept,
                    send_items=_split(send, dst_rank[send], dp), recv_items=_split(recv, src_rank[recv], dp))


def _pieces(fields, entries: dict, key: np.ndarray, n_keys: int):
    """_Place of items in wire order (`key` = peer * W + slot, non-decreasing) in the pieces laid
    out back to back in one buffer (buffer 0); returns (place, size of every piece)."""
    n = np.bincount(key, minlength=n_keys)
    totals = {k: np.bincount(key, weights=entries[k], minlength=n_keys).astype(np.int64) for k in KINDS[1:]}
    regions, sizes = piece_layout(fields, n, totals)
    starts = np.cumsum(sizes) - sizes
    j = _grouped_before(np.ones(len(key), np.int64), key)
    before = {k: _grouped_before(entries[k], key) for k in KINDS[1:]}
    return _Place(np.zeros(len(key), np.int64), starts[key], n[key], j, before, regions[key], 0), sizes


def _take(place: _Place, index) -> _Place:
    return _Place(place.buf[index], place.base[index], place.n[index], place.j[index],
                  {k: v[index] for k, v in place.before.items()}, place.region[index], place.per_field)


def _combine(first: np.ndarray, a: _Place, b: _Place) -> _Place:
    """Items where `first` is True come from `a` (in order), the others from `b` (in order)."""
    def mix(x, y):
        out = np.empty((len(first), *x.shape[1:]), np.int64)
        out[first], out[~first] = x, y
        return out

    per_field = mix(np.full(len(a.buf), a.per_field), np.full(len(b.buf), b.per_field))
    return _Place(mix(a.buf, b.buf), mix(a.base, b.base), mix(a.n, b.n), mix(a.j, b.j),
                  {k: mix(a.before[k], b.before[k]) for k in a.before}, mix(a.region, b.region), per_field)


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
    entries = {k: counts.entries(k).reshape(-1).astype(np.int64) for k in KINDS}
    before = {k: _grouped_before(entries[k], source) for k in KINDS[1:]}
    n, nf = len(index), len(fields)
    src = _Place(source[index] * nf, np.zeros(n, np.int64), sizes[source[index]], index - first[source[index]],
                 {k: v[index] for k, v in before.items()}, np.zeros((n, nf), np.int64), 1)
    out = {k: v[index] for k, v in entries.items()}
    regions, block = piece_layout(fields, np.array([n]), {k: np.array([out[k].sum()]) for k in KINDS[1:]})
    dst = _Place(np.zeros(n, np.int64), np.zeros(n, np.int64), np.full(n, n, np.int64), np.arange(n),
                 {k: _grouped_before(out[k], np.zeros(n, np.int64)) for k in KINDS[1:]}, np.repeat(regions, n, axis=0))
    return TakeList(segments=_segments(fields, out, src, dst), regions=regions[0], block_bytes=int(block[0]),
                    out_counts=SampleCounts(counts.table.reshape(-1, counts.table.shape[-1])[index]))
