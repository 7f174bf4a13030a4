"""Where each sample's bytes of each field lie in a shard's buffers: the regions a per-sample,
per-field checksum reads (numbers in, numbers out).

A shard's buffers are laid out as `reorder.batch.blocks.field_buffers` gives them, in `byte_fields`
order: a dense field of `pre` leading entries holds its n samples as `[pre, n, unit]` bytes (sample j
at leading index p starts at (p * n + j) * unit), a per-row or per-image field its entries
sample after sample (`unit` bytes each), the list field the samples' pickled bytes one after the
other. The checksum of (sample, field) covers that sample's bytes of the field in this order; a
field beyond `CHECKED_FIELDS - 1` shares the last slot (its checksum is added to that slot's).

Each region is read as words of its field's width: the widest of (8, 4, 2, 1) bytes dividing the
field's unit (1 for list bytes), so offsets and lengths are whole words on sender and receiver
alike; `at` is the region's byte position in its (sample, field) sequence (fields sharing the last
slot start 2**40 bytes apart), so the checksum does not depend on where the bytes sit in a buffer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from reorder.plan.counts import SampleCounts

CHECKED_FIELDS = 16  # checksum words per sample in the window frame: fields 15, 16, ... share the last


@dataclass(frozen=True, slots=True)
class Regions:
    """n regions: buffer index, byte offset, length, checksum key (sample * CHECKED_FIELDS + slot),
    byte position of the region in its (sample, field) sequence, word width; int64 arrays."""

    buf: np.ndarray
    off: np.ndarray
    nbytes: np.ndarray
    key: np.ndarray
    at: np.ndarray
    width: np.ndarray

    def __len__(self) -> int:
        return len(self.buf)


def field_slot(field: int) -> int:
    """The checksum slot of field `field` (layout order)."""
    return min(field, CHECKED_FIELDS - 1)


def sample_regions(fields: tuple, counts: SampleCounts) -> Regions:
    """The regions of every (sample, field) of one shard of n samples (counts [n]) whose buffers are
    buffers 0..F-1 (one per field of `fields`, `ByteField`s in layout order)."""
    n = counts.shape[0]
    per = {"row": counts.rows, "image": counts.images, "list": counts.list_bytes}
    parts = []
    j = np.arange(n, dtype=np.int64)
    for f, (kind, pre, unit) in enumerate(fields):
        key = j * CHECKED_FIELDS + field_slot(f)
        base = max(0, f - (CHECKED_FIELDS - 1)) << 40  # fields sharing the last slot apart
        width = 1 if kind == "list" else (unit | 8) & -(unit | 8)
        if kind == "dense":
            for p in range(pre):
                parts.append((f, (p * n + j) * unit, np.full(n, unit, np.int64), key,
                              np.full(n, base + p * unit, np.int64), width))
        else:
            entries = np.asarray(per[kind], dtype=np.int64)
            start = np.cumsum(entries) - entries
            parts.append((f, start * unit, entries * unit, key, np.full(n, base, np.int64), width))
    if not parts:
        z = np.zeros(0, np.int64)
        return Regions(z, z, z, z, z, z)
    buf = np.concatenate([np.full(len(p[1]), p[0], np.int64) for p in parts])
    width = np.concatenate([np.full(len(p[1]), p[5], np.int64) for p in parts])
    off, nbytes, key, at = (np.concatenate([p[i] for p in parts]) for i in range(1, 5))
    keep = nbytes > 0
    return Regions(buf[keep], off[keep], nbytes[keep], key[keep], at[keep], width[keep])
