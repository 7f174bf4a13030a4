"""Per-sample, per-field 64-bit checksums of a shard's buffers, on whatever device they live.

A field is read as entries of words (`reorder.plan.checksums.word_width`): a dense field's sample
has `pre` entries (one per leading index) of `unit` bytes, a ragged field's sample its rows or
images, the list field's sample one entry of its pickled bytes. A word w (little-endian,
sign-extended to int64) at byte c of entry e of its sample adds

    (w + 1) * mix(c) * mix(e + 2**32 * f)        (f: the field's index when it shares the last slot, else 0)

to the sample's checksum of that field; mix(x) is an odd 64-bit mix and every sum wraps modulo
2**64. Integer addition is associative, so the sums are bit-identical on the CPU and on a GPU,
whatever the order of the additions: a sender's checksums (where it reads its samples) and a
receiver's (on what it assembled) agree exactly when the bytes do. A flipped byte changes its
word's term by a nonzero multiple of an odd number; swapped samples, rows or entries, or a dropped
segment, change several. The mix factors into a column part and an entry part, so a field costs one
broadcast multiply and one row sum over its words: about one pass over the bytes, no index tensors.
"""

from __future__ import annotations

import numpy as np
import torch

from reorder.plan.checksums import CHECKED_FIELDS, field_slot, word_width
from reorder.plan.counts import SampleCounts

_MIX = -7046029254386353131  # 0x9E3779B97F4A7C15 as a signed int64 (Fibonacci hashing)
_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def mix(x: torch.Tensor) -> torch.Tensor:
    """An odd int64 mix of int64 x: multiply, fold the high bits down, set the low bit."""
    h = x * _MIX
    return (h ^ (h >> 29)) | 1


def checksums(buffers: list, fields: tuple, counts: SampleCounts) -> torch.Tensor:
    """int64 [n, CHECKED_FIELDS] on the buffers' device: the checksums of the n samples (counts [n])
    of a shard whose buffers (contiguous, one per `ByteField` of `fields`, in order) are `buffers`."""
    n = counts.shape[0]
    dev = buffers[0].device if buffers else torch.device("cpu")
    out = torch.zeros(n, CHECKED_FIELDS, dtype=torch.int64, device=dev)
    for f, ((kind, pre, unit), buf) in enumerate(zip(fields, buffers)):
        salt = max(0, f - (CHECKED_FIELDS - 1)) << 32
        slot = field_slot(f)
        if kind == "dense":
            words = _words(buf, word_width(kind, unit)).view(pre, n, -1)
            per = _entry_sums(words) * mix(torch.arange(pre, device=dev) + salt)[:, None]  # [pre, n]
            out[:, slot] += per.sum(0)
        elif kind == "list":
            ends = np.cumsum(counts.list_bytes)
            raw = _words(buf, 1)
            for j, (a, b) in enumerate(zip((ends - counts.list_bytes).tolist(), ends.tolist())):
                if b > a:
                    out[j, slot] += _entry_sums(raw[a:b].view(1, -1))[0] * mix(torch.tensor(salt, device=dev))
        else:
            entries = np.asarray(counts.rows if kind == "row" else counts.images, dtype=np.int64)
            total = int(entries.sum())
            if not total:
                continue
            words = _words(buf, word_width(kind, unit)).view(total, -1)
            sample = np.repeat(np.arange(n, dtype=np.int64), entries)
            index = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(entries) - entries, entries)
            per = _entry_sums(words) * mix(torch.from_numpy(index + salt).to(dev, non_blocking=True))
            out[:, slot].index_add_(0, torch.from_numpy(sample).to(dev, non_blocking=True), per)
    return out


def _entry_sums(words: torch.Tensor) -> torch.Tensor:
    """Per entry (last dim: its words), sum of (w + 1) * mix(byte position of w in the entry)."""
    width = words.element_size()
    col = mix(torch.arange(words.shape[-1], device=words.device) * width)
    return ((words.to(torch.int64) + 1) * col).sum(-1)


def _words(t: torch.Tensor, width: int) -> torch.Tensor:
    """The bytes of contiguous tensor t as a flat tensor of `width`-byte words (a copy when its
    storage does not start at a whole word)."""
    b = t.reshape(-1).view(torch.uint8)
    if width == 1:
        return b
    if b.storage_offset() % width or b.data_ptr() % width:
        b = b.clone()
    return b.view(_WORDS[width])
