"""Byte-exact sample packing: select samples of shards, pack them into one contiguous uint8 buffer,
and view them back. A selection is a list of runs of consecutive samples; each field is copied by
one concatenation of `narrow` views of those runs (dtypes without a native copy, float8 and complex
among them, as the widest integer word their bytes allow, so every dtype travels bit-for-bit), never
one Python call per sample per field and never an index tensor.

Buffer format for n samples (all sizes computable from per-sample metadata alone, see `nbytes`):
dense fields in layout order, then per-row fields, then per-image fields, then the pickled list
entries; each region starts at a multiple of ALIGN bytes so typed views need no copy.
"""

from __future__ import annotations

import bisect
import math
import pickle

import numpy as np
import torch

from reorder.layout import BatchLayout, Shard

ALIGN = 16


def _align(n):
    """Round up to a multiple of ALIGN (ints or int64 arrays)."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


def bytes_view(t: torch.Tensor) -> torch.Tensor:
    """uint8 view of a tensor with one extra trailing dim of itemsize bytes (copies if not contiguous)."""
    t = t.contiguous()
    if t.dtype == torch.uint8:
        return t.unsqueeze(-1)
    return t.view(torch.uint8).reshape(*t.shape, t.dtype.itemsize)


def runs(index) -> list:
    """Maximal runs of consecutive indices, in order: [(start, stop), ...] (index ascending by one
    inside a run). A permutation that keeps most samples in place has few runs."""
    out = []
    for i in np.asarray(index, dtype=np.int64).tolist():
        if out and out[-1][1] == i:
            out[-1][1] = i + 1
        else:
            out.append([i, i + 1])
    return [tuple(r) for r in out]


class _Source:
    """One shard with the per-sample entry offsets of its ragged fields (made on first use), so a run
    of samples is one `narrow` per field (no index tensor, no host-to-device copy)."""

    def __init__(self, shard: Shard):
        self.shard, self._starts = shard, {}

    def tensor(self, path, ragged: bool) -> torch.Tensor:
        return (self.shard.ragged if ragged else self.shard.dense)[path]

    def entries(self, per: str, a: int, b: int) -> tuple:
        """Entry range (start, length) of samples [a, b) in a per-`per` ragged field."""
        o = self._starts.get(per)
        if o is None:
            counts = self.shard.row_counts if per == "row" else self.shard.image_counts
            o = self._starts[per] = np.concatenate([[0], np.cumsum(counts.numpy(), dtype=np.int64)])
        return int(o[a]), int(o[b] - o[a])


_WORDS = (torch.int64, torch.int32, torch.int16, torch.uint8)


def _word(post_bytes: int, tensors) -> torch.dtype:
    """For dtypes without a native copy: the widest integer word dividing the bytes per sample and
    every tensor's start address."""
    for w in _WORDS:
        if post_bytes % w.itemsize == 0 and all(t.data_ptr() % w.itemsize == 0 for t in tensors):
            return w
    return torch.uint8


def _split(shape: tuple, batch_dim: int, itemsize: int) -> tuple:
    """(pre, post_bytes) of a contiguous tensor of `shape` around its batch dim."""
    return math.prod(shape[:batch_dim]), math.prod(shape[batch_dim + 1:]) * itemsize


def _words(t: torch.Tensor, batch_dim: int, word: torch.dtype) -> torch.Tensor:
    """[pre, n, post_bytes / word size] view of contiguous `t` (n = samples or entries along batch_dim)."""
    pre, post = _split(tuple(t.shape), batch_dim, t.dtype.itemsize)
    n = t.shape[batch_dim]
    if t.dim() > batch_dim + 1 and (t.shape[-1] * t.dtype.itemsize) % word.itemsize == 0:
        return t.view(word).view(pre, n, post // word.itemsize)  # the common case: two views
    return t.reshape(-1).view(torch.uint8).view(word).view(pre, n, post // word.itemsize)


def _from_words(w: torch.Tensor, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
    if w.dtype.itemsize % dtype.itemsize == 0 and w.shape[-1]:
        return w.view(dtype).view(shape)
    return w.view(torch.uint8).view(dtype).view(shape)


def _source_runs(sizes: list, index) -> list:
    """Runs of `index` (into the concatenation of sources of `sizes` samples) as
    (source, start, stop) in source-local indices; a run never crosses a source boundary."""
    bounds = [0]
    for n in sizes:
        bounds.append(bounds[-1] + n)
    out = []
    for a, b in runs(index):
        while a < b:
            k = bisect.bisect_right(bounds, a) - 1
            end = min(b, bounds[k + 1])
            out.append((k, a - bounds[k], end - bounds[k]))
            a = end
    return out


def _gather(views: list, dim: int, out: torch.Tensor | None):
    """Concatenate `views` along `dim` into `out` (or a new contiguous tensor; a single view that is
    already contiguous is returned as it is); one copy kernel per field."""
    if out is None:
        return views[0].contiguous() if len(views) == 1 else torch.cat(views, dim)
    if len(views) == 1:
        out.copy_(views[0])
    elif views:
        torch.cat(views, dim, out=out)
    return out


# dtypes torch.cat copies natively on every backend; others (float8, complex, wide unsigned) are
# reinterpreted as integer words, which also keeps them bit-exact
_NATIVE = {torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
           torch.bfloat16, torch.float32, torch.float64}


def _field(sources: list, tensor, spans: list, batch_dim: int, shape_of, dtype, region):
    """One field of a selection: `spans` ((source, start, length) along `batch_dim`) of the sources'
    `tensor(source)`, concatenated in order into `region` (a flat uint8 buffer) or a new tensor."""
    n = sum(ln for _, _, ln in spans)
    shape = shape_of(n)
    if dtype in _NATIVE:  # the common case: one narrow per run and one cat
        views = [tensor(sources[k]).narrow(batch_dim, s, ln) for k, s, ln in spans if ln]
        if not views:
            return torch.empty(shape, dtype=dtype, device=tensor(sources[0]).device) if region is None \
                else region.view(dtype).view(shape)
        return _gather(views, batch_dim, None if region is None else region.view(dtype).view(shape))
    used = {k: tensor(sources[k]).contiguous() for k in dict.fromkeys(k for k, _, _ in spans)} or \
        {0: tensor(sources[0]).contiguous()}
    pre, post = _split(shape, batch_dim, dtype.itemsize)
    if pre * post == 0 or n == 0:
        first = next(iter(used.values()))
        return torch.empty(shape, dtype=dtype, device=first.device) if region is None else _from_words(
            region, dtype, shape)
    word = _word(post, list(used.values()) + ([] if region is None else [region]))
    whole = {k: _words(t, batch_dim, word) for k, t in used.items()}
    views = [whole[k].narrow(1, s, ln) for k, s, ln in spans if ln]
    out = None if region is None else region.view(word).view(pre, n, post // word.itemsize)
    return _from_words(_gather(views, 1, out), dtype, shape)


def _select(layout: BatchLayout, sources: list, pieces: list, regions=None) -> Shard:
    """The samples of `pieces` ((source, start, stop) runs over `sources`, a list of _Source) as
    a new shard; with `regions` (path -> flat uint8 buffer for the field) the fields are written
    there instead of to new tensors. A shard taken whole is returned as-is (no copy)."""
    if regions is None and len(pieces) == 1 and pieces[0][1] == 0 and pieces[0][2] == sources[pieces[0][0]].shard.n:
        return sources[pieces[0][0]].shard  # taken whole, in order: no copy
    out = Shard(n=sum(b - a for _, a, b in pieces))
    spans = [(k, a, b - a) for k, a, b in pieces]
    for f in layout.dense:
        out.dense[f.path] = _field(sources, lambda src, f=f: src.tensor(f.path, False), spans, f.batch_dim,
                                   f.full_shape, f.dtype, None if regions is None else regions[f.path])
    if layout.ragged:
        if regions is None:  # a packed buffer carries no counts: the receiver has them from the metadata
            rows = [sources[k].shard.row_counts.numpy()[a:b] for k, a, b in pieces]
            imgs = [sources[k].shard.image_counts.numpy()[a:b] for k, a, b in pieces]
            out.row_counts = torch.from_numpy(np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64))
            out.image_counts = torch.from_numpy(np.concatenate(imgs) if imgs else np.zeros(0, dtype=np.int64))
        for f in layout.ragged:
            entry = [(k, *sources[k].entries(f.per, a, b)) for k, a, b in pieces]
            out.ragged[f.path] = _field(sources, lambda src, f=f: src.tensor(f.path, True), entry, 0,
                                        lambda n, f=f: (n, *f.entry_shape), f.dtype,
                                        None if regions is None else regions[f.path])
    if layout.lists:
        out.lists = [e for k, a, b in pieces for e in sources[k].shard.lists[a:b]]
    return out


def take(layout: BatchLayout, shards: list, index) -> Shard:
    """Samples `index` (into the concatenation of `shards`, in that order) as a new shard: one
    concatenation of contiguous-run views per field; a shard taken whole and in order is returned
    without a copy."""
    index = np.asarray(index, dtype=np.int64)
    sources = [_Source(s) for s in shards]
    return _select(layout, sources, _source_runs([s.n for s in shards], index))


def nbytes(layout: BatchLayout, n: int, rows: int, images: int, list_bytes: int) -> int:
    """Packed size of n samples holding `rows` patch rows, `images` images and `list_bytes`."""
    return int(nbytes_many(layout, n, rows, images, list_bytes))


def nbytes_many(layout: BatchLayout, n, rows, images, list_bytes):
    """Vectorized `nbytes` over int64 arrays of equal length."""
    n, rows, images, lb = (np.asarray(x, dtype=np.int64) for x in (n, rows, images, list_bytes))
    total = _align(lb)
    for f in layout.dense:
        total = total + _align(n * f.sample_bytes)
    for f in layout.ragged:
        total = total + _align((rows if f.per == "row" else images) * f.entry_bytes)
    return total


def pack(layout: BatchLayout, shard: Shard, index, out: torch.Tensor, blobs=None) -> int:
    """Write samples `index` of `shard` into the uint8 buffer `out` (from offset 0); returns bytes
    written. `blobs` are the shard's per-sample pickled list entries (Shard.list_blobs())."""
    index = np.asarray(index, dtype=np.int64)
    src = _Source(shard)
    pieces = _source_runs([shard.n], index)
    n, off, regions = len(index), 0, {}
    for f in layout.dense:
        size = n * f.sample_bytes
        regions[f.path] = out[off:off + size]
        off += _align(size)
    if layout.ragged:
        for f in layout.ragged:
            k = sum(src.entries(f.per, a, b)[1] for _, a, b in pieces)
            size = k * f.entry_bytes
            regions[f.path] = out[off:off + size]
            off += _align(size)
    _select(layout, [src], pieces, regions)
    if layout.lists:
        blobs = shard.list_blobs() if blobs is None else blobs
        data = b"".join(blobs[i] for i in index.tolist())
        if data:
            out[off:off + len(data)].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        off += _align(len(data))
    return off


def unpack(layout: BatchLayout, buf: torch.Tensor, n: int, row_counts: torch.Tensor,
           image_counts: torch.Tensor, list_lens) -> Shard:
    """View a packed buffer of n samples back as a shard (typed views into `buf`, no copy)."""
    out, off = Shard(n=n), 0
    for f in layout.dense:
        size = n * f.sample_bytes
        out.dense[f.path] = buf[off:off + size].view(f.dtype).view(f.full_shape(n))
        off += _align(size)
    if layout.ragged:
        counts = {"row": int(row_counts.numpy().sum()), "image": int(image_counts.numpy().sum())}
        for f in layout.ragged:
            k = counts[f.per]
            size = k * f.entry_bytes
            out.ragged[f.path] = buf[off:off + size].view(f.dtype).view(k, *f.entry_shape)
            off += _align(size)
        out.row_counts, out.image_counts = row_counts, image_counts
    if layout.lists:
        lens = [int(x) for x in list_lens]
        data = bytes(buf[off:off + sum(lens)].cpu().numpy())
        out.lists, pos = [], 0
        for ln in lens:
            out.lists.append(pickle.loads(data[pos:pos + ln]))
            pos += ln
        off += _align(sum(lens))
    if off != len(buf):
        raise RuntimeError(f"unpack consumed {off} bytes of a {len(buf)}-byte buffer: sender and "
                           "receiver disagree on the layout")
    return out
