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


@dataclass(frozen=True, slots=True, kw_only=True)
class Grid:
    """One module rank's place on the canonical grid: `groups` (G), `dp` (d), `rank` (r)."""

    groups: int
    dp: int
    rank: int

    def __post_init__(self):
        if not isinstance(self.dp, int) or self.dp < 1:
            raise ValueError(f"dp={self.dp!r} is invalid: a module's DP size must be an integer >= 1")
        if not isinstance(self.groups, int) or self.groups < 1:
            raise ValueError(f"groups={self.groups!r} is invalid: the canonical grid must be >= 1")
        if self.groups % self.dp:
            raise ValueError(f"canonical grid G={self.groups} is not a multiple of dp={self.dp}: "
                             f"G must be the lcm of all module DP sizes")
        if not 0 <= self.rank < self.dp:
            raise ValueError(f"rank={self.rank} is out of range for dp={self.dp}")

    @property
    def groups_per_rank(self) -> int:
        return self.groups // self.dp

    def covered_groups(self) -> range:
        """Groups [r*G/d, (r+1)*G/d) this rank holds."""
        k = self.groups_per_rank
        return range(self.rank * k, (self.rank + 1) * k)

    def owner(self, group):
        """Rank of this module that owns canonical group(s) `group` (int or integer array)."""
        return group // self.groups_per_rank


def check_micro_batch_size(micro_batch_size: int, groups: int) -> None:
    """B, the global micro-batch (`micro_batch_size`), must be a positive multiple of G so every
    group gets B/G samples."""
    if micro_batch_size < 1 or micro_batch_size % groups:
        raise ValueError(f"micro_batch_size={micro_batch_size} (B, the global micro-batch) is not a positive "
                         f"multiple of the canonical grid G={groups}: choose B as a multiple of lcm(DP sizes)")


def check_global_batch(global_batch: int, groups: int) -> None:
    """Deprecated name of `check_micro_batch_size` (renamed names are accepted, with a
    DeprecationWarning, until release 0.3)."""
    warnings.warn("check_global_batch is deprecated: use check_micro_batch_size", DeprecationWarning, stacklevel=2)
    check_micro_batch_size(global_batch, groups)
