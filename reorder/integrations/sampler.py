"""Canonical-grid batch sampler: each module rank reads its contiguous share of one global micro-batch.

Contract (DESIGN sections 2 and 7). Every module, whatever its DP size d, walks the same sequence of
ordered *global micro-batches* of B samples, defined on the canonical grid G = lcm(module DP sizes)
(`math.lcm(*dp_sizes)`; B % G == 0). Group g (0 <= g < G) holds positions [g*B/G, (g+1)*B/G) of each
global micro-batch, so rank r of a module with DP size d yields positions [r*B/d, (r+1)*B/d): the
concatenation of its groups [r*G/d, (r+1)*G/d). Hence rank r of dp d == block r (size B/d) of the
dp-1 window, for every d dividing G. The order depends on (dataset length, B, G, mode, data_sharding,
seed) only, never on d or r.

The dataset is truncated to N' = (N // B) * B samples: indices >= N' are never yielded (54 samples,
B 8 -> 6 global micro-batches per pass, for every G).

Modes (b = B/G samples per group, W = N'/B global micro-batches per epoch, window k of an epoch):
- "single": one pass in order; window k is indices [k*B, (k+1)*B), group g takes slice g.
- "cyclic": epoch e reshuffles with `torch.Generator().manual_seed(seed + epoch)`.
  - data_sharding=True: N' is split into G contiguous buckets of W*b; one `randperm(W*b)` per epoch,
    group g takes g*W*b + perm[k*b:(k+1)*b]. (All buckets share the epoch's permutation.)
  - data_sharding=False: one `randperm(N')` per epoch; window k draws perm[k*B:(k+1)*B] and group g
    takes the stride perm[k*B + g :: G] (b items). The window's *set* is independent of G; its order
    is group-major.
  For G == Megatron's dp and seed 0, group g's stream is Megatron's `MegatronPretrainingRandomSampler`
  stream of data-parallel rank g with micro-batch size b (up to the truncation of N' noted above).

Like Megatron's samplers, one `iter()` yields the rest of the current pass ("single") or epoch
("cyclic"); the next `iter()` of a cyclic sampler starts the next epoch. `consumed_samples` counts
global samples (a multiple of B) and is advanced *before* each batch is handed out, so `state_dict()`
taken after k batches resumes at batch k + 1. The state is global: a run may resume with another DP
size on the same grid. Pure Python/torch: no distributed calls.
"""

from __future__ import annotations

import numbers

import torch

MODES = ("single", "cyclic")


def _check_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name}={value!r}: must be an integer >= {minimum}")
    return int(value)


class CanonicalBatchSampler:
    """Batch sampler (iterable of lists of dataset indices) of rank `rank` of a module with DP `dp`."""

    def __init__(self, total_samples: int, global_batch_size: int, *, dp: int, rank: int, grid: int,
                 mode: str = "single", data_sharding: bool = True, seed: int = 0,
                 consumed_samples: int = 0, drop_last: bool = True):
        self.total_samples = _check_int("total_samples", total_samples, 0)
        self.global_batch_size = B = _check_int("global_batch_size", global_batch_size, 1)
        self.dp = _check_int("dp", dp, 1)
        self.grid = _check_int("grid", grid, 1)
        self.rank = _check_int("rank", rank, 0)
        self.seed = _check_int("seed", seed, 0)
        if rank >= dp:
            raise ValueError(f"rank={rank} is out of range for dp={dp}: must be in [0, {dp})")
        if grid % dp:
            raise ValueError(f"grid={grid} is not a multiple of dp={dp}: the canonical grid G must be "
                             f"the lcm of all module DP sizes")
        if B % grid:
            raise ValueError(f"global_batch_size={B} is not a multiple of the canonical grid G={grid}")
        if mode not in MODES:
            raise ValueError(f"mode={mode!r}: must be one of {list(MODES)}")
        if drop_last is not True:
            raise ValueError(f"drop_last={drop_last!r} is not supported: modules with different DP sizes "
                             f"must all see whole global micro-batches, so the dataset is truncated to a "
                             f"multiple of global_batch_size; pass drop_last=True")
        if not isinstance(data_sharding, bool):
            raise ValueError(f"data_sharding={data_sharding!r}: must be a bool")
        if total_samples < B:
            raise ValueError(f"total_samples={total_samples} is smaller than global_batch_size={B}: "
                             f"not even one global micro-batch")
        self.mode = mode
        self.data_sharding = data_sharding
        self.drop_last = True
        self.windows_per_epoch = total_samples // B
        self.active_samples = self.windows_per_epoch * B
        self._perm_cache: tuple[int, list[int]] | None = None
        self.consumed_samples = self._check_consumed(consumed_samples)

    # -- state -----------------------------------------------------------------------------------
    def _check_consumed(self, consumed_samples) -> int:
        consumed_samples = _check_int("consumed_samples", consumed_samples, 0)
        B = self.global_batch_size
        if consumed_samples % B:
            raise ValueError(f"consumed_samples={consumed_samples} is not a multiple of "
                             f"global_batch_size={B}")
        if self.mode == "single" and consumed_samples > self.active_samples:
            raise ValueError(f"consumed_samples={consumed_samples} exceeds the {self.active_samples} "
                             f"samples of the single pass (mode 'single' does not wrap around)")
        return consumed_samples

    def _fingerprint(self) -> dict:
        return {"total_samples": self.total_samples, "global_batch_size": self.global_batch_size,
                "grid": self.grid, "mode": self.mode, "data_sharding": self.data_sharding,
                "seed": self.seed}

    def state_dict(self) -> dict:
        """Global state: consumed_samples plus the settings that define the order (not dp/rank)."""
        return {"consumed_samples": self.consumed_samples, **self._fingerprint()}

    def load_state_dict(self, state: dict) -> None:
        """Resume from `state_dict()`; every order-defining setting must match this sampler's."""
        for key, mine in self._fingerprint().items():
            if key in state and state[key] != mine:
                raise ValueError(f"{key}={state[key]!r} in the state dict does not match this "
                                 f"sampler's {key}={mine!r}")
        self.consumed_samples = self._check_consumed(state["consumed_samples"])

    @property
    def epoch(self) -> int:
        """Epoch of the next global micro-batch (always 0 in mode 'single')."""
        return 0 if self.mode == "single" else self.consumed_samples // self.active_samples

    # -- order -----------------------------------------------------------------------------------
    def _perm(self, epoch: int, n: int) -> list[int]:
        if self._perm_cache is None or self._perm_cache[0] != epoch:
            g = torch.Generator()
            g.manual_seed(self.seed + epoch)
            self._perm_cache = (epoch, torch.randperm(n, generator=g).tolist())
        return self._perm_cache[1]

    def _groups(self, window: int, groups: range) -> list[int]:
        """Indices of `groups` (in order) of global micro-batch number `window` (counted from 0)."""
        B, G = self.global_batch_size, self.grid
        b = B // G
        if self.mode == "single":
            return list(range(window * B + groups.start * b, window * B + groups.stop * b))
        epoch, k = divmod(window, self.windows_per_epoch)
        out: list[int] = []
        if self.data_sharding:
            bucket = self.windows_per_epoch * b
            perm = self._perm(epoch, bucket)[k * b:(k + 1) * b]
            for g in groups:
                out.extend(g * bucket + i for i in perm)
        else:
            perm = self._perm(epoch, self.active_samples)[k * B:(k + 1) * B]
            for g in groups:
                out.extend(perm[g::G])
        return out

    def global_micro_batch(self, window: int) -> list[int]:
        """The whole ordered global micro-batch number `window` (what a dp-1 module reads)."""
        if self.mode == "single" and not 0 <= window < self.windows_per_epoch:
            raise IndexError(f"window={window} is outside the single pass of {self.windows_per_epoch}")
        return self._groups(window, range(self.grid))

    def rank_share(self, window: int) -> list[int]:
        """This rank's B/dp indices of global micro-batch number `window`."""
        per = self.grid // self.dp
        return self._groups(window, range(self.rank * per, (self.rank + 1) * per))

    # -- iteration -------------------------------------------------------------------------------
    def _stop(self, window: int) -> int:
        if self.mode == "single":
            return self.windows_per_epoch
        return (window // self.windows_per_epoch + 1) * self.windows_per_epoch

    def __len__(self) -> int:
        """Batches the next `iter()` yields: the rest of the current pass / epoch."""
        window = self.consumed_samples // self.global_batch_size
        return self._stop(window) - window

    def __iter__(self):
        B = self.global_batch_size
        window = self.consumed_samples // B
        for w in range(window, self._stop(window)):
            batch = self.rank_share(w)
            self.consumed_samples = (w + 1) * B
            yield batch
