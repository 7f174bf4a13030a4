"""A segment table: the move list's unit of work, as pure data (numpy, no torch).

Segment i copies `nbytes[i]` bytes from byte offset `src_off[i]` of source buffer `src_buf[i]` to
byte offset `dst_off[i]` of destination buffer `dst_buf[i]`; executors
(`reorder.exchange.executors`) carry a table out between tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

FIELDS = ("src_buf", "src_off", "dst_buf", "dst_off", "nbytes")


@dataclass(frozen=True)
class Segments:
    """A segment table: five one-dimensional int64 arrays of equal length, all entries >= 0
    (validated on construction; the error names the field and the offending value). Treat the
    arrays as immutable. Zero-byte segments are allowed and copy nothing."""

    src_buf: np.ndarray
    src_off: np.ndarray
    dst_buf: np.ndarray
    dst_off: np.ndarray
    nbytes: np.ndarray

    def __post_init__(self):
        n = None
        for f in FIELDS:
            a = getattr(self, f)
            if not isinstance(a, np.ndarray) or a.dtype != np.int64 or a.ndim != 1:
                what = f"{a.dtype} array of shape {a.shape}" if isinstance(a, np.ndarray) else type(a).__name__
                raise ValueError(f"Segments.{f} must be a one-dimensional int64 numpy array, got {what}")
            if n is not None and len(a) != n:
                raise ValueError(f"Segments.{f} has length {len(a)}, src_buf has length {n}")
            n = len(a)
            if n and a.min() < 0:
                i = int(np.argmax(a < 0))
                raise ValueError(f"Segments.{f}[{i}] = {int(a[i])} is negative")

    @classmethod
    def of(cls, src_buf, src_off, dst_buf, dst_off, nbytes) -> "Segments":
        """A table from any integer sequences (converted to int64 arrays; non-integers rejected)."""
        arrays = {}
        for f, v in zip(FIELDS, (src_buf, src_off, dst_buf, dst_off, nbytes)):
            a = np.asarray(v)
            if a.size and not np.issubdtype(a.dtype, np.integer):
                raise ValueError(f"Segments.{f} must hold integers, got dtype {a.dtype}")
            arrays[f] = a.astype(np.int64).reshape(-1)
        return cls(**arrays)

    @classmethod
    def empty(cls) -> "Segments":
        return cls(*(np.zeros(0, np.int64) for _ in FIELDS))

    def __len__(self) -> int:
        return len(self.nbytes)

    @property
    def total_bytes(self) -> int:
        return int(self.nbytes.sum())

    @classmethod
    def trusted(cls, src_buf, src_off, dst_buf, dst_off, nbytes) -> "Segments":
        """A table of arrays already known valid (int64, one-dimensional, equal lengths, >= 0), e.g.
        computed by the move list or taken from a valid table: no check, no copy."""
        s = object.__new__(cls)
        for f, v in zip(FIELDS, (src_buf, src_off, dst_buf, dst_off, nbytes)):
            object.__setattr__(s, f, v)
        return s

    def take(self, index) -> "Segments":
        """The segments at `index` (an integer index array or a boolean mask), in that order."""
        return Segments.trusted(*(getattr(self, f)[index] for f in FIELDS))

    def merged(self) -> "Segments":
        """The same copy as fewer segments: zero-byte segments dropped, the rest sorted by destination
        (dst_buf, dst_off) and every run of segments contiguous in both the source and the
        destination (same buffers, each starting where the previous one ends) fused into one.
        Copy order is immaterial since destinations never overlap. Vectorized; O(n log n)."""
        keep = np.flatnonzero(self.nbytes)
        s = self.take(keep[np.lexsort((self.dst_off[keep], self.dst_buf[keep]))])
        if len(s) < 2:
            return s
        joins = ((s.src_buf[1:] == s.src_buf[:-1]) & (s.dst_buf[1:] == s.dst_buf[:-1])
                 & (s.src_off[:-1] + s.nbytes[:-1] == s.src_off[1:])
                 & (s.dst_off[:-1] + s.nbytes[:-1] == s.dst_off[1:]))
        starts = np.flatnonzero(np.concatenate([[True], ~joins]))
        head = s.take(starts)
        return Segments.trusted(head.src_buf, head.src_off, head.dst_buf, head.dst_off,
                                np.add.reduceat(s.nbytes, starts).astype(np.int64))
