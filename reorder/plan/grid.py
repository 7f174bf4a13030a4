"""Canonical grid: G = lcm of the module DP sizes, the groups a rank covers, and owners."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass


def canonical_grid(dp_sizes) -> int:
    """G = lcm(dp_sizes). Every DP size must be an integer >= 1."""
    sizes = list(dp_sizes)
    if not sizes:
        raise ValueError("dp_sizes is empty: give the DP size of every module, e.g. [2, 4]")
    for d in sizes:
        if not isinstance(d, int) or d < 1:
            raise ValueError(f"dp size {d!r} is invalid: every module's DP size must be an integer >= 1")
    return math.lcm(*sizes)


@dataclass(frozen=True, slots=True, init=False)
class Grid:
    """One module rank's place on the canonical grid: its `size` (G, the lcm of every module's DP
    size: the number of canonical groups), `dp` (d) and `rank` (r).

    `groups=` (the old name of `size`, before process groups took that word) is accepted with a
    DeprecationWarning through 0.2.x."""

    size: int
    dp: int
    rank: int

    def __init__(self, *, size: int | None = None, dp: int, rank: int, groups: int | None = None):
        if groups is not None:
            if size is not None:
                raise TypeError("give size= (the canonical grid size G) only: groups= is its old name")
            warnings.warn("Grid(groups=) is renamed Grid(size=) (the canonical grid size G); groups= is removed "
                          "in 0.3.0", DeprecationWarning, stacklevel=2)
            size = groups
        object.__setattr__(self, "size", size)
        object.__setattr__(self, "dp", dp)
        object.__setattr__(self, "rank", rank)
        if not isinstance(self.dp, int) or self.dp < 1:
            raise ValueError(f"dp={self.dp!r} is invalid: a module's DP size must be an integer >= 1")
        if not isinstance(self.size, int) or self.size < 1:
            raise ValueError(f"size={self.size!r} is invalid: the canonical grid size G must be an integer >= 1")
        if self.size % self.dp:
            raise ValueError(f"canonical grid G={self.size} is not a multiple of dp={self.dp}: "
                             f"G must be the lcm of all module DP sizes")
        if not 0 <= self.rank < self.dp:
            raise ValueError(f"rank={self.rank} is out of range for dp={self.dp}")

    @property
    def groups(self) -> int:
        """The old name of `size` (DeprecationWarning; removed in 0.3.0)."""
        warnings.warn("Grid.groups is renamed Grid.size (the canonical grid size G); groups is removed in 0.3.0",
                      DeprecationWarning, stacklevel=2)
        return self.size

    @property
    def groups_per_rank(self) -> int:
        return self.size // self.dp

    def covered_groups(self) -> range:
        """Groups [r*G/d, (r+1)*G/d) this rank holds."""
        k = self.groups_per_rank
        return range(self.rank * k, (self.rank + 1) * k)

    def owner(self, group):
        """Rank of this module that owns canonical group(s) `group` (int or integer array)."""
        return group // self.groups_per_rank


def check_micro_batch_size(micro_batch_size: int, grid_size: int) -> None:
    """B, the global micro-batch (`micro_batch_size`), must be a positive multiple of the canonical
    grid size G so every group gets B/G samples."""
    if micro_batch_size < 1 or micro_batch_size % grid_size:
        raise ValueError(f"micro_batch_size={micro_batch_size} (B, the global micro-batch) is not a positive "
                         f"multiple of the canonical grid G={grid_size}: choose B as a multiple of lcm(DP sizes)")


def check_global_batch(global_batch: int, groups: int) -> None:
    """Deprecated name of `check_micro_batch_size` (renamed names are accepted, with a
    DeprecationWarning, until release 0.3)."""
    warnings.warn("check_global_batch is deprecated: use check_micro_batch_size", DeprecationWarning, stacklevel=2)
    check_micro_batch_size(global_batch, groups)
