"""Byte-exact sample packing: select samples of shards, pack them into one contiguous uint8 buffer,
and view them back. Every copy works on uint8 views, one vectorized op per field (so every dtype,
float8 and complex included, travels bit-for-bit), never one Python call per sample per field.

Buffer format for n samples (all sizes computable from per-sample metadata alone, see `nbytes`):
dense fields in layout order, then per-row fields, then per-image fields, then the pickled list
entries; each region starts at a multiple of ALIGN bytes so typed views need no copy.
"""

from __future__ import annotations

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


def from_bytes(u: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of bytes_view (a view, no copy)."""
    if dtype == torch.uint8:
        return u.squeeze(-1)
    return u.view(dtype).squeeze(-1)


def ragged_index(counts: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Entry indices of samples `index` when sample s owns `counts[s]` consecutive entries (CPU int64)."""
    counts = counts.to(torch.int64)
    starts = torch.cumsum(counts, 0) - counts
    sel = counts[index]
    total = int(sel.sum())
    if total == 0:
        return torch.zeros(0, dtype=torch.int64)
    shift = starts[index] - (torch.cumsum(sel, 0) - sel)
    return torch.repeat_interleave(shift, sel) + torch.arange(total, dtype=torch.int64)


class _DeviceCache:
    """Copies each CPU index tensor to a device once per call (one small H2D copy, not one per field)."""

    def __init__(self):
        self._seen = {}

    def __call__(self, t: torch.Tensor, device) -> torch.Tensor:
        if device.type == "cpu":
            return t
        key = (id(t), device)
        if key not in self._seen:
            self._seen[key] = (t, t.to(device, non_blocking=True))
        return self._seen[key][1]


def _cat(tensors, dim):
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim)


def take(layout: BatchLayout, shards: list, index) -> Shard:
    """Samples `index` (into the concatenation of `shards`, in that order) as a new shard."""
    index = torch.as_tensor(index, dtype=torch.int64)
    out = Shard(n=len(index))
    on = _DeviceCache()
    for f in layout.dense:
        src = _cat([bytes_view(s.dense[f.path]) for s in shards], f.batch_dim)
        out.dense[f.path] = from_bytes(src.index_select(f.batch_dim, on(index, src.device)), f.dtype)
    if layout.ragged:
        rows = _cat([s.row_counts for s in shards], 0)
        imgs = _cat([s.image_counts for s in shards], 0)
        row_idx, img_idx = ragged_index(rows, index), ragged_index(imgs, index)
        for f in layout.ragged:
            src = _cat([bytes_view(s.ragged[f.path]) for s in shards], 0)
            idx = row_idx if f.per == "row" else img_idx
            out.ragged[f.path] = from_bytes(src.index_select(0, on(idx, src.device)), f.dtype)
        out.row_counts, out.image_counts = rows[index], imgs[index]
    if layout.lists:
        entries = [e for s in shards for e in s.lists]
        out.lists = [entries[i] for i in index.tolist()]
    return out


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
    index = torch.as_tensor(index, dtype=torch.int64)
    n, off = len(index), 0
    on = _DeviceCache()
    for f in layout.dense:
        src = bytes_view(shard.dense[f.path])
        shape = list(src.shape)
        shape[f.batch_dim] = n
        size = n * f.sample_bytes
        region = out[off:off + size].view(shape)
        torch.index_select(src, f.batch_dim, on(index, src.device), out=region)
        off += _align(size)
    if layout.ragged:
        idx = {"row": ragged_index(shard.row_counts, index), "image": ragged_index(shard.image_counts, index)}
        for f in layout.ragged:
            src = bytes_view(shard.ragged[f.path])
            sel = idx[f.per]
            size = len(sel) * f.entry_bytes
            region = out[off:off + size].view(len(sel), *src.shape[1:])
            torch.index_select(src, 0, on(sel, src.device), out=region)
            off += _align(size)
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
        shape = list(f.full_shape(n)) + [f.dtype.itemsize]
        out.dense[f.path] = from_bytes(buf[off:off + size].view(shape), f.dtype)
        off += _align(size)
    if layout.ragged:
        counts = {"row": int(row_counts.sum()), "image": int(image_counts.sum())}
        for f in layout.ragged:
            k = counts[f.per]
            size = k * f.entry_bytes
            shape = [k, *f.entry_shape, f.dtype.itemsize]
            out.ragged[f.path] = from_bytes(buf[off:off + size].view(shape), f.dtype)
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
