"""SampleCounts: the per-sample integers a window's plan and move list are computed from.

Counted by each rank from its own micro-batches (`reorder.batch.counting`), gathered over the DP
group in the window frame (`reorder.exchange.wire`), and read here by name, never by column number.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

COLUMNS = ("placeholders", "real_tokens", "images", "rows", "list_bytes", "square_patches", "cost_bits")
_INDEX = {name: i for i, name in enumerate(COLUMNS)}


@dataclass(frozen=True, slots=True)
class SampleCounts:
    """int64 table [..., len(COLUMNS)]: per sample, image placeholder tokens, real tokens (ones of
    attention_mask), images (vision-start tokens), vision patch rows, bytes of pickled per-sample
    list entries, the sum over its images of patches**2, and a cost given per sample by the caller
    (float64 bits, so every rank plans from the same bits; 0 unless one is given). A window's counts are [W, B, ...]
    (natural order per slot); one rank's share [W, B/dp, ...]."""

    table: np.ndarray

    def __post_init__(self):
        t = self.table
        if not isinstance(t, np.ndarray) or t.dtype != np.int64 or t.ndim < 1 or t.shape[-1] != len(COLUMNS):
            raise ValueError(f"SampleCounts.table must be an int64 array [..., {len(COLUMNS)}], got "
                             f"{getattr(t, 'dtype', type(t).__name__)} {getattr(t, 'shape', '')}")

    @classmethod
    def of(cls, **columns) -> "SampleCounts":
        """From named columns of one shape (a missing column is zeros)."""
        unknown = set(columns) - set(COLUMNS)
        if unknown:
            raise ValueError(f"unknown SampleCounts columns {sorted(unknown)}: expected some of {COLUMNS}")
        shape = np.shape(next(iter(columns.values())))
        table = np.zeros((*shape, len(COLUMNS)), dtype=np.int64)
        for i, name in enumerate(COLUMNS):
            if name in columns:
                table[..., i] = columns[name]
        return cls(table)

    def __getattr__(self, name):
        i = _INDEX.get(name)
        if i is None:
            raise AttributeError(name)
        return self.table[..., i]

    @property
    def shape(self) -> tuple:
        """Shape without the column axis, e.g. (W, B)."""
        return self.table.shape[:-1]

    def flat(self) -> "SampleCounts":
        """The same samples as one axis (a window [W, B] as W*B samples, slot-major)."""
        return SampleCounts(self.table.reshape(-1, len(COLUMNS)))

    @property
    def given_costs(self) -> np.ndarray:
        """float64 view of the cost_bits column."""
        return np.ascontiguousarray(self.cost_bits).view(np.float64)

    def entries(self, kind: str) -> np.ndarray:
        """Per-sample entries of a field of `kind`: 1 per "dense" sample, else rows / images / list bytes."""
        if kind == "dense":
            return np.ones(self.shape, dtype=np.int64)
        return getattr(self, {"row": "rows", "image": "images", "list": "list_bytes"}[kind])
