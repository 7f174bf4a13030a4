"""Per-sample, per-field 64-bit checksums of a shard's buffers, on whatever device they live.

The regions come from `reorder.plan.checksums.sample_regions`. A word w (the field's width,
little-endian, sign-extended to int64) at byte position k of its (sample, field) sequence adds
(w + 1) * mix(k) to its key's sum, mix(k) an odd 64-bit mix of k; sums wrap modulo 2**64. Integer
addition is associative, so the sums are bit-identical on the CPU and on a GPU, whatever the order
of the additions: a sender's checksums (computed where it reads its samples) and a receiver's
(computed on what it assembled) agree exactly when the bytes do. One flipped byte changes its word's
term by a nonzero multiple of an odd number; two swapped samples or a dropped segment change
several. A handful of torch ops per (buffer, word width), no host synchronization.
"""

from __future__ import annotations

import numpy as np
import torch

from reorder.plan.checksums import CHECKED_FIELDS, Regions

_MIX = -7046029254386353131  # 0x9E3779B97F4A7C15 as a signed int64 (Fibonacci hashing)
_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def mix(k: torch.Tensor) -> torch.Tensor:
    """An odd int64 mix of byte positions k (int64): multiply, fold the high bits down."""
    h = k * _MIX
    return (h ^ (h >> 29)) | 1


def checksums(buffers: list, regions: Regions, samples: int, device) -> torch.Tensor:
    """int64 [samples, CHECKED_FIELDS] on `device`: the checksums of the regions of `buffers`
    (contiguous tensors, on `device`)."""
    out = torch.zeros(samples * CHECKED_FIELDS, dtype=torch.int64, device=device)
    if not len(regions):
        return out.view(samples, CHECKED_FIELDS)
    order = np.lexsort((regions.width, regions.buf))
    b, w = regions.buf[order], regions.width[order]
    cuts = np.flatnonzero(np.concatenate([[True], (b[1:] != b[:-1]) | (w[1:] != w[:-1]), [True]]))
    for lo, hi in zip(cuts[:-1].tolist(), cuts[1:].tolist()):
        sel = order[lo:hi]
        _add(out, _words(buffers[int(regions.buf[sel[0]])], int(regions.width[sel[0]])), regions, sel)
    return out.view(samples, CHECKED_FIELDS)


def _words(t: torch.Tensor, width: int) -> torch.Tensor:
    """The bytes of contiguous tensor t as words of `width` bytes (a copy when its storage offset is
    not a whole word)."""
    b = t.reshape(-1).view(torch.uint8)
    if width == 1:
        return b
    if (b.storage_offset() % width) or (b.data_ptr() % width):
        b = b.clone()
    return b.narrow(0, 0, b.numel() // width * width).view(_WORDS[width])


def _add(out: torch.Tensor, words: torch.Tensor, regions: Regions, sel: np.ndarray) -> None:
    """Add the terms of regions `sel` (one buffer, one width) to `out`, on the words' device."""
    width = int(regions.width[sel[0]])
    count = regions.nbytes[sel] // width
    total = int(count.sum())
    dev = words.device

    def put(a):
        return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(dev, non_blocking=True)

    region = torch.repeat_interleave(torch.arange(len(sel), device=dev), put(count), output_size=total)
    rel = torch.arange(total, device=dev) - put(np.cumsum(count) - count)[region]
    index = put(regions.off[sel] // width)[region] + rel
    position = put(regions.at[sel])[region] + rel * width
    term = (words.index_select(0, index).to(torch.int64) + 1) * mix(position)
    out.index_add_(0, put(regions.key[sel])[region], term)
