"""Byte-exact sample packing: select samples of shards, pack them into one contiguous uint8 buffer,
and view them back. A selection is a list of runs of consecutive samples. Every field of a run is a
contiguous byte range of its source (one range per leading index when the batch dim is not 0, e.g.
MRoPE position_ids [3, B, S]), so a whole selection, all its fields, is written into one buffer
by a few copies of narrow views of those byte ranges (as the widest integer word their offsets
allow; `_Concat.write`: small ranges batched in one torch.cat, big ones by memcpy) with zero
padding between regions: every dtype travels bit-for-bit, and there is never an index tensor, a
host-to-device index copy or one Python call per sample per field. A reassembled micro-batch is one
new buffer in the same format; its fields are typed views into it.

Buffer format for n samples (all sizes computable from per-sample metadata alone, see `nbytes`):
dense fields in layout order ([*pre, n, *post] per field), then per-row fields, then per-image
fields, then the pickled list entries; each region starts at a multiple of ALIGN bytes so typed
views need no copy.
"""

from __future__ import annotations

import bisect
import math
import pickle

import numpy as np
import torch

from reorder.batch.layout import BatchLayout, DenseField, Shard

ALIGN = 16


def _align(n):
    """Round up to a multiple of ALIGN (ints or int64 arrays)."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


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


def _pre_post(f: DenseField) -> tuple:
    """(leading entries before the batch dim, bytes of one sample per leading entry)."""
    pre = math.prod(f.sample_shape[:f.batch_dim])
    return pre, math.prod(f.sample_shape[f.batch_dim:]) * f.dtype.itemsize


def _offsets(counts: np.ndarray) -> np.ndarray:
    """Entry offset of every sample, and the total: [0, c0, c0 + c1, ...]."""
    return np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])


class _Source:
    """One shard as byte ranges: each field flattened once per shard (kept in `Shard.flat`, so packing
    and reassembling the same shard flatten once) to a 1-D view of its own dtype (a copy only if the
    field is not contiguous), ragged entry offsets made on first use."""

    def __init__(self, shard: Shard):
        self.shard, self.n, self._flat, self._starts, self._counts = shard, shard.n, shard.flat, {}, {}

    def counts(self, per: str) -> np.ndarray:
        c = self._counts.get(per)
        if c is None:
            c = self._counts[per] = (self.shard.row_counts if per == "row" else self.shard.image_counts).numpy()
        return c

    def lists(self, a: int, b: int) -> list:
        return self.shard.lists[a:b]

    def _base(self, path, ragged: bool) -> torch.Tensor:
        t = self._flat.get(path)
        if t is None:
            t = (self.shard.ragged if ragged else self.shard.dense)[path].contiguous()
            t = self._flat[path] = t if t.dim() == 1 else t.reshape(-1)
        return t

    def dense(self, f: DenseField, p: int, post: int, a: int, b: int) -> tuple:
        """(base, start, length) of samples [a, b) at leading index p of dense field f."""
        return self._base(f.path, False), (p * self.n + a) * post, (b - a) * post

    def ragged(self, f, a: int, b: int) -> tuple:
        o = self._starts.get(f.per)
        if o is None:
            o = self._starts[f.per] = _offsets(self.counts(f.per))
        e = int(o[a])
        return self._base(f.path, True), e * f.entry_bytes, (int(o[b]) - e) * f.entry_bytes


class Packed:
    """n samples packed (`pack`) at byte `offset` of the uint8 buffer `buf`, as a source for `take`
    without making a single view: rows / images / list_lens are per-sample counts (int64, from the
    metadata)."""

    def __init__(self, layout: BatchLayout, buf: torch.Tensor, offset: int, n: int, rows, images, list_lens):
        self.buf, self.n = buf, n
        self._counts = {"row": np.asarray(rows, dtype=np.int64), "image": np.asarray(images, dtype=np.int64)}
        self._list_lens, self._lists, self._starts = list_lens, None, {}
        totals = {per: int(c.sum()) for per, c in self._counts.items()} if layout.ragged else {}
        regions, off = _regions(layout.dense, layout.ragged, offset, n, totals)
        self._region = {f.path: at for f, at in regions}
        self._lists_at, self.end = off, off + _align(int(np.sum(list_lens))) if layout.lists else off

    def counts(self, per: str) -> np.ndarray:
        return self._counts[per]

    def lists(self, a: int, b: int) -> list:
        if self._lists is None:  # unpickled on first use (one device-to-host copy)
            self._lists = _unpickle(self.buf[self._lists_at:self.end], self._list_lens)
        return self._lists[a:b]

    def dense(self, f: DenseField, p: int, post: int, a: int, b: int) -> tuple:
        return self.buf, self._region[f.path] + (p * self.n + a) * post, (b - a) * post

    def ragged(self, f, a: int, b: int) -> tuple:
        o = self._starts.get(f.per)
        if o is None:
            o = self._starts[f.per] = _offsets(self._counts[f.per])
        e = int(o[a])
        return self.buf, self._region[f.path] + e * f.entry_bytes, (int(o[b]) - e) * f.entry_bytes


def _unpickle(data: torch.Tensor, list_lens) -> list:
    raw, out, pos = bytes(data.cpu().numpy()), [], 0
    for ln in (int(x) for x in list_lens):
        out.append(pickle.loads(raw[pos:pos + ln]))
        pos += ln
    return out


_WORDS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
BIG = 1 << 20  # bytes: a range this large is copied on its own (memcpy), smaller ones are batched in a cat
_ZEROS = {}  # (device, word dtype) -> ALIGN zero bytes (the padding between regions)


class _Concat:
    """Byte ranges (base, start, length) to write back to back into one buffer (`write`); a base
    is a flat contiguous tensor of any dtype (offsets in bytes), None is zero padding."""

    def __init__(self):
        self.parts, self.size = [], 0

    def add(self, part: tuple):
        if part[2]:
            self.parts.append(part)
            self.size += part[2]

    def pad(self):
        gap = _align(self.size) - self.size
        if gap:
            self.parts.append((None, 0, gap))
            self.size += gap

    def write(self, out: torch.Tensor):
        """Copy the ranges into the uint8 tensor `out` (self.size bytes), as int64 words when every
        offset and length allows (else the widest word that divides them all): a range of BIG bytes
        or more with one copy of its own (a device memcpy runs at full bandwidth, the cat kernel does
        not); consecutive smaller ranges on one device with one torch.cat, on out's device directly,
        on another (pinned host memory) into a staging buffer there and then one copy to out."""
        if not self.parts:
            return
        dev, bases = out.device, {}
        bits = out.data_ptr() | out.numel()
        for base, start, length in self.parts:
            bits |= start | length
            if base is not None and id(base) not in bases:
                bases[id(base)] = base
                bits |= base.data_ptr() | base.numel() * base.dtype.itemsize
        w = min(8, bits & -bits) if bits else 8
        word = _WORDS[w]
        words = {k: v if v.dtype == word else v.view(word) for k, v in bases.items()}
        target, at = out.view(word), 0
        batch, where = [], [dev, 0]  # small ranges waiting, and (their device, their start in out)
        asynchronous = dev.type == "cuda"  # to a host tensor, copies block until done

        def flush():
            if not batch:
                return
            src_dev, first = where
            dst = target.narrow(0, first, at - first)
            if src_dev == dev:
                dst.copy_(batch[0]) if len(batch) == 1 else torch.cat(batch, out=dst)
            else:
                staged = batch[0] if len(batch) == 1 else torch.cat(batch, out=torch.empty(
                    at - first, dtype=word, device=src_dev, pin_memory=src_dev.type == "cpu" and asynchronous))
                dst.copy_(staged, non_blocking=asynchronous)
            batch.clear()

        for base, start, length in self.parts:
            if base is None:  # padding: zeros on the device of the ranges around it
                src_dev = where[0] if batch else dev
                v = _zeros(src_dev, word).narrow(0, 0, length // w)
            else:
                src_dev = base.device
                v = words[id(base)].narrow(0, start // w, length // w)
            if base is not None and length >= BIG:
                flush()
                target.narrow(0, at, v.numel()).copy_(v, non_blocking=asynchronous)
            else:
                if batch and src_dev != where[0]:
                    flush()
                if not batch:
                    where[:] = src_dev, at
                batch.append(v)
            at += length // w
        flush()


def _zeros(device: torch.device, word: torch.dtype) -> torch.Tensor:
    """ALIGN zero bytes on `device` as `word`s (the padding between regions), made once."""
    z = _ZEROS.get((device, word))
    if z is None:
        z = _ZEROS[device, word] = torch.zeros(ALIGN // word.itemsize, dtype=word, device=device)
    return z


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


def _add_fields(cat: _Concat, dense, ragged, sources: list, pieces: list):
    """The byte ranges of the selection `pieces` ((source, start, stop) runs) for the given fields,
    region by region in buffer order, each region padded to ALIGN."""
    for f in dense:
        pre, post = _pre_post(f)
        for p in range(pre):
            for k, a, b in pieces:
                cat.add(sources[k].dense(f, p, post, a, b))
        cat.pad()
    for f in ragged:
        for k, a, b in pieces:
            cat.add(sources[k].ragged(f, a, b))
        cat.pad()


def resolved(device: torch.device | None) -> torch.device | None:
    """`device` with a CUDA index filled in (the current device), so it compares equal to the device
    of tensors placed there."""
    if device is not None and device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def take(layout: BatchLayout, shards: list, index, device: torch.device | None = None) -> Shard:
    """Samples `index` (into the concatenation of `shards`, each a Shard or a Packed region, in
    that order) as a new shard on `device` (None: where each field's first source lives). A Shard
    taken whole and in order, already on `device`, is returned without a copy; one Shard alone is
    gathered field by field (`_gather`); otherwise every field is written into one new buffer
    (`_Concat.write`: batched small ranges, big ranges and ranges from another device copied
    directly), and the fields are typed views into it."""
    index = np.asarray(index, dtype=np.int64)
    device = resolved(device)
    pieces = _source_runs([s.n for s in shards], index)
    if len(pieces) == 1 and isinstance(shards[pieces[0][0]], Shard) and pieces[0][1] == 0 \
            and pieces[0][2] == shards[pieces[0][0]].n and (device is None or all(
                t.device == device for t in (*shards[pieces[0][0]].dense.values(), *shards[pieces[0][0]].ragged.values()))):
        return shards[pieces[0][0]]  # taken whole, in order, in place: no copy
    if len(shards) == 1 and isinstance(shards[0], Shard):
        return _gather(layout, shards[0], index, pieces, device)
    sources = [_Source(s) if isinstance(s, Shard) else s for s in shards]
    out = Shard(n=len(index))
    by_device = {}  # device -> (dense fields, ragged fields), in layout order
    first = shards[0]
    for f in layout.dense:
        dev = device or (first.dense[f.path].device if isinstance(first, Shard) else first.buf.device)
        by_device.setdefault(dev, ([], []))[0].append(f)
    for f in layout.ragged:
        dev = device or (first.ragged[f.path].device if isinstance(first, Shard) else first.buf.device)
        by_device.setdefault(dev, ([], []))[1].append(f)
    totals = {}
    if layout.ragged:
        rows, images = _cat_counts(sources, pieces, "row"), _cat_counts(sources, pieces, "image")
        out.row_counts, out.image_counts = torch.from_numpy(rows), torch.from_numpy(images)
        totals = {"row": int(rows.sum()), "image": int(images.sum())}
    for dev, (dense, ragged) in by_device.items():
        cat = _Concat()
        _add_fields(cat, dense, ragged, sources, pieces)
        buf = torch.empty(cat.size, dtype=torch.uint8, device=dev)
        cat.write(buf)
        _view_fields(out, dense, ragged, buf, 0, out.n, totals)
    if layout.lists:
        out.lists = [e for k, a, b in pieces for e in sources[k].lists(a, b)]
    return out


def _gather(layout: BatchLayout, shard: Shard, index: np.ndarray, pieces: list, device) -> Shard:
    """`take` of one shard (dp-1 permutation, a local reorder), field by field, each field to
    `device` (None: where it lives). Taken whole and in order: each field as is, or moved whole
    (`.to(device)`, what reorder off does). Otherwise dense and per-image fields by one index_select
    each (moved whole first when they live elsewhere: they are small), indices copied once per
    device; per-row fields by their runs (`pieces`): one cat of narrow views on their own device, or
    one copy per run, straight from where they live (e.g. pinned host memory) for a field of another
    device or of BIG bytes or more. About 3x fewer torch ops than packing every field into one
    buffer, no typed views, and from host memory every byte crosses PCIe once, by DMA."""
    out = Shard(n=len(index))
    whole = len(pieces) == 1 and pieces[0][1] == 0 and pieces[0][2] == shard.n

    def there(t):
        return device is None or t.device == device

    def moved(t):
        return t if there(t) else t.to(device, non_blocking=True)

    if layout.ragged:
        rows, images = shard.row_counts.numpy(), shard.image_counts.numpy()
        out.row_counts, out.image_counts = (shard.row_counts, shard.image_counts) if whole else (
            torch.from_numpy(rows[index]), torch.from_numpy(images[index]))
    if layout.lists:
        out.lists = list(shard.lists) if whole else [shard.lists[i] for i in index.tolist()]
    if whole:
        out.dense = {f.path: moved(shard.dense[f.path]) for f in layout.dense}
        out.ragged = {f.path: moved(shard.ragged[f.path]) for f in layout.ragged}
        return out
    host_ix, on = index, {}
    if any(f.per == "image" for f in layout.ragged):
        starts = _offsets(images)
        host_ix = np.concatenate([index] + [np.arange(starts[i], starts[i + 1]) for i in index.tolist()])

    def ix(dev):  # (sample index, image index) on `dev`, one host-to-device copy per device
        v = on.get(dev)
        if v is None:
            t = torch.from_numpy(host_ix)
            t = t if dev.type == "cpu" else t.to(dev, non_blocking=True)
            v = on[dev] = (t[:len(index)], t[len(index):])
        return v

    for f in layout.dense:
        t = moved(shard.dense[f.path])
        out.dense[f.path] = _select(t, f.batch_dim, ix(t.device)[0])
    row_starts = None
    for f in layout.ragged:
        t = shard.ragged[f.path]
        if f.per == "image":
            t = moved(t)
            out.ragged[f.path] = _select(t, 0, ix(t.device)[1])
            continue
        if row_starts is None:
            row_starts = _offsets(rows)
        ranges = [(int(row_starts[a]), int(row_starts[b] - row_starts[a])) for _, a, b in pieces]
        ranges = [r for r in ranges if r[1]]
        total = sum(n for _, n in ranges)
        if there(t) and (total * f.entry_bytes < BIG or len(ranges) <= 1):
            parts = [t.narrow(0, a, n) for a, n in ranges]
            out.ragged[f.path] = torch.cat(parts) if len(parts) > 1 else (
                parts[0].clone() if parts else t.new_empty((0, *f.entry_shape)))
        else:  # one copy per run (a cat kernel copies at a fraction of memcpy speed; host ranges by DMA)
            dst, at = torch.empty((total, *f.entry_shape), dtype=t.dtype, device=device or t.device), 0
            for a, n in ranges:
                dst.narrow(0, at, n).copy_(t.narrow(0, a, n), non_blocking=True)
                at += n
            out.ragged[f.path] = dst
    return out


# dtypes every backend's index_select handles (the standard dispatch set); others go through words
_SELECTABLE = {torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
               torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128}


def _select(t: torch.Tensor, dim: int, index: torch.Tensor) -> torch.Tensor:
    """index_select of `t` along `dim`, bit-for-bit for any dtype: other dtypes are gathered as the
    widest integer word that divides one entry's bytes."""
    if t.dtype in _SELECTABLE:
        return torch.index_select(t, dim, index)
    shape = list(t.shape)
    pre, n = math.prod(shape[:dim]), shape[dim]
    nbytes = math.prod(shape[dim + 1:]) * t.dtype.itemsize
    word = next(w for w in (8, 4, 2, 1) if nbytes % w == 0)
    words = t.contiguous().view(torch.uint8).view(pre, n, nbytes).view(_WORDS[word])
    shape[dim] = len(index)
    return torch.index_select(words, 1, index).view(torch.uint8).view(t.dtype).view(shape)


def _cat_counts(sources, pieces, per) -> np.ndarray:
    parts = [sources[k].counts(per)[a:b] for k, a, b in pieces]
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, dtype=np.int64)


def _regions(dense, ragged, off: int, n: int, totals: dict) -> tuple:
    """([(field, byte offset of its region)], offset after them) for n samples of `dense` and
    `ragged` fields packed from byte `off` (totals: entries per "row" / "image")."""
    out = []
    for f in dense:
        out.append((f, off))
        off += _align(n * f.sample_bytes)
    for f in ragged:
        out.append((f, off))
        off += _align(totals[f.per] * f.entry_bytes)
    return out, off


def _view_fields(out: Shard, dense, ragged, buf: torch.Tensor, off: int, n: int, totals: dict) -> int:
    """Typed views of the regions of `dense` and `ragged` fields of n samples, from byte `off` of
    the uint8 `buf` (a multiple of ALIGN bytes), into the shard `out` (one view op per field, one
    per dtype); returns the offset after them."""
    typed = {}

    def view(dtype, shape, off):
        t = typed.get(dtype)
        if t is None:
            t = typed[dtype] = buf.view(dtype)
        stride, step = [], 1
        for d in reversed(shape):
            stride.append(step)
            step *= d
        return torch.as_strided(t, shape, stride[::-1], t.storage_offset() + off // dtype.itemsize)

    regions, end = _regions(dense, ragged, off, n, totals)
    for f, at in regions:
        if isinstance(f, DenseField):
            out.dense[f.path] = view(f.dtype, f.full_shape(n), at)
        else:
            out.ragged[f.path] = view(f.dtype, (totals[f.per], *f.entry_shape), at)
    return end


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


def pack_many(layout: BatchLayout, jobs: list, out: torch.Tensor) -> list:
    """Write the selections `jobs` ((shard, index, blobs or None) each) back to back into the uint8
    buffer `out` (from offset 0), each in the packed format, with one copy kernel for all of them;
    returns the bytes written per job. `blobs` are the shard's per-sample pickled list entries
    (Shard.list_blobs())."""
    cat, sizes, sources = _Concat(), [], {}
    for shard, index, blobs in jobs:
        start = cat.size
        index = np.asarray(index, dtype=np.int64)
        src = sources.get(id(shard)) or sources.setdefault(id(shard), _Source(shard))
        _add_fields(cat, layout.dense, layout.ragged, [src], _source_runs([shard.n], index))
        if layout.lists:
            blobs = shard.list_blobs() if blobs is None else blobs
            data = b"".join(blobs[i] for i in index.tolist())
            if data:  # an aligned, padded host buffer: the region travels as whole words
                host = torch.zeros(_align(len(data)), dtype=torch.uint8)
                host[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
                cat.add((host, 0, len(host)))
        sizes.append(cat.size - start)
    cat.write(out[:cat.size])
    return sizes


def pack(layout: BatchLayout, shard: Shard, index, out: torch.Tensor, blobs=None) -> int:
    """Write samples `index` of `shard` into the uint8 buffer `out` (from offset 0); returns bytes
    written. `blobs` are the shard's per-sample pickled list entries (Shard.list_blobs())."""
    return pack_many(layout, [(shard, index, blobs)], out)[0]


def unpack(layout: BatchLayout, buf: torch.Tensor, n: int, row_counts: torch.Tensor,
           image_counts: torch.Tensor, list_lens) -> Shard:
    """View a packed buffer of n samples back as a shard (typed views into `buf`, no copy)."""
    out = Shard(n=n)
    totals = {}
    if layout.ragged:
        totals = {"row": int(row_counts.numpy().sum()), "image": int(image_counts.numpy().sum())}
        out.row_counts, out.image_counts = row_counts, image_counts
    off = _view_fields(out, layout.dense, layout.ragged, buf, 0, n, totals)
    if layout.lists:
        lens = [int(x) for x in list_lens]
        out.lists = _unpickle(buf[off:off + sum(lens)], lens)
        off += _align(sum(lens))
    if off != len(buf):
        raise RuntimeError(f"unpack consumed {off} bytes of a {len(buf)}-byte buffer: sender and "
                           "receiver disagree on the layout")
    return out
