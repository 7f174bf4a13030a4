"""Canonical-grid batch sampler: each module rank reads its contiguous share of one global micro-batch.

Contract (docs/design.md, Canonical grid and Scalable reads). Every module, whatever its DP size d, walks the same sequence of
ordered *global micro-batches* of B samples, defined on the canonical grid G = lcm(module DP sizes)
(`math.lcm(*dp_sizes)`; B % G == 0). Group g (0 <= g < G) holds positions [g*B/G, (g+1)*B/G) of each
global micro-batch, so rank r of a module with DP size d yields positions [r*B/d, (r+1)*B/d): the
concatenation of its groups [r*G/d, (r+1)*G/d). Hence rank r of dp d == block r (size B/d) of the
dp-1 window, for every d dividing G. The order depends on (dataset length, B, G, dataloader_type,
data_sharding, seed) only, never on d or r. B is Megatron-Bridge's `micro_batch_size` of the canonical
sampler: the global micro-batch, not a rank's share.

The dataset is truncated to N' = (N // B) * B samples: indices >= N' are never yielded (54 samples,
B 8 -> 6 global micro-batches per pass, for every G).

dataloader_type (b = B/G samples per group, W = N'/B global micro-batches per epoch, window k of an epoch):
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
import warnings

import torch

MODES = ("single", "cyclic")


def _check_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name}={value!r}: must be an integer >= {minimum}")
    return int(value)


_RENAMED = {"global_batch_size": "micro_batch_size", "dp": "data_parallel_size", "rank": "data_parallel_rank",
            "grid": "grid_size", "mode": "dataloader_type"}  # deprecated keyword -> Megatron's name


class CanonicalBatchSampler:
    """Batch sampler (iterable of lists of dataset indices) of DP rank `data_parallel_rank` of a module
    with DP size `data_parallel_size`. Names follow Megatron's samplers and Megatron-Bridge's canonical
    MIMO sampler: `micro_batch_size` is B, the GLOBAL micro-batch (every module's ranks together; each
    rank yields B / data_parallel_size indices), `grid_size` the canonical grid G, `dataloader_type`
    "single" or "cyclic". The older keywords (global_batch_size, dp, rank, grid, mode) still work, with
    a DeprecationWarning."""

    def __init__(self, total_samples: int, micro_batch_size: int | None = None, *,
                 data_parallel_size: int | None = None, data_parallel_rank: int | None = None,
                 grid_size: int | None = None, dataloader_type: str = "single", data_sharding: bool = True,
                 seed: int = 0, consumed_samples: int = 0, drop_last: bool = True, **renamed):
        if renamed:
            given = dict(micro_batch_size=micro_batch_size, data_parallel_size=data_parallel_size,
                         data_parallel_rank=data_parallel_rank, grid_size=grid_size, dataloader_type=dataloader_type)
            for old, value in renamed.items():
                if old not in _RENAMED:
                    raise TypeError(f"CanonicalBatchSampler() got an unexpected keyword argument {old!r}")
                given[_RENAMED[old]] = value
            warnings.warn(f"CanonicalBatchSampler({', '.join(k + '=' for k in renamed)}) is deprecated: use "
                          f"{', '.join(_RENAMED[k] + '=' for k in renamed)} (Megatron's names)",
                          DeprecationWarning, stacklevel=2)
            micro_batch_size, data_parallel_size, data_parallel_rank, grid_size, dataloader_type = given.values()
        for name, v in (("micro_batch_size", micro_batch_size), ("data_parallel_size", data_parallel_size),
                        ("data_parallel_rank", data_parallel_rank), ("grid_size", grid_size)):
            if v is None:
                raise TypeError(f"CanonicalBatchSampler() missing argument {name!r}")
        self.total_samples = _check_int("total_samples", total_samples, 0)
        self.micro_batch_size = B = _check_int("micro_batch_size", micro_batch_size, 1)
        self.data_parallel_size = dp = _check_int("data_parallel_size", data_parallel_size, 1)
        self.grid_size = groups = _check_int("grid_size", grid_size, 1)
        self.data_parallel_rank = rank = _check_int("data_parallel_rank", data_parallel_rank, 0)
        self.seed = _check_int("seed", seed, 0)
        if rank >= dp:
            raise ValueError(f"data_parallel_rank={rank} is out of range for data_parallel_size={dp}: must be in "
                             f"[0, {dp})")
        if groups % dp:
            raise ValueError(f"grid_size={groups} is not a multiple of data_parallel_size={dp}: the canonical grid G "
                             f"must be the lcm of all module DP sizes")
        if B % groups:
            raise ValueError(f"micro_batch_size={B} is not a multiple of the canonical grid G={groups}")
        if dataloader_type not in MODES:
            raise ValueError(f"dataloader_type={dataloader_type!r}: must be one of {list(MODES)}")
        if drop_last is not True:
            raise ValueError(f"drop_last={drop_last!r} is not supported: modules with different DP sizes "
                             f"must all see whole global micro-batches, so the dataset is truncated to a "
                             f"multiple of micro_batch_size; pass drop_last=True")
        if not isinstance(data_sharding, bool):
            raise ValueError(f"data_sharding={data_sharding!r}: must be a bool")
        if total_samples < B:
            raise ValueError(f"total_samples={total_samples} is smaller than micro_batch_size={B}: "
                             f"not even one global micro-batch")
        self.dataloader_type = dataloader_type
        self.data_sharding = data_sharding
        self.drop_last = True
        self.windows_per_epoch = total_samples // B
        self.active_samples = self.windows_per_epoch * B
        self._perm_cache: tuple[int, list[int]] | None = None
        self.consumed_samples = self._check_consumed(consumed_samples)

    # -- state -----------------------------------------------------------------------------------
    def _check_consumed(self, consumed_samples) -> int:
        consumed_samples = _check_int("consumed_samples", consumed_samples, 0)
        B = self.micro_batch_size
        if consumed_samples % B:
            raise ValueError(f"consumed_samples={consumed_samples} is not a multiple of "
                             f"micro_batch_size={B}")
        if self.dataloader_type == "single" and consumed_samples > self.active_samples:
            raise ValueError(f"consumed_samples={consumed_samples} exceeds the {self.active_samples} "
                             f"samples of the single pass (dataloader_type 'single' does not wrap around)")
        return consumed_samples

    def _fingerprint(self) -> dict:
        return {"total_samples": self.total_samples, "micro_batch_size": self.micro_batch_size,
                "grid_size": self.grid_size, "dataloader_type": self.dataloader_type,
                "data_sharding": self.data_sharding, "seed": self.seed}

    def state_dict(self) -> dict:
        """Global state: consumed_samples plus the settings that define the order (not the DP size or
        rank). With a DataLoader that reads ahead (num_workers > 0), this counts what the loader read,
        not what training consumed: checkpoint the buffer `wrap` returns instead."""
        return {"consumed_samples": self.consumed_samples, **self._fingerprint()}

    def load_state_dict(self, state: dict) -> None:
        """Resume from `state_dict()`; every order-defining setting must match this sampler's."""
        state = {_RENAMED.get(k, k): v for k, v in state.items()}  # states saved under the older names
        for key, mine in self._fingerprint().items():
            if key in state and state[key] != mine:
                raise ValueError(f"{key}={state[key]!r} in the state dict does not match this "
                                 f"sampler's {key}={mine!r}")
        self.consumed_samples = self._check_consumed(state["consumed_samples"])

    @property
    def epoch(self) -> int:
        """Epoch of the next global micro-batch (always 0 in mode 'single')."""
        return 0 if self.dataloader_type == "single" else self.consumed_samples // self.active_samples

    # -- order -----------------------------------------------------------------------------------
    def _perm(self, epoch: int, n: int) -> list[int]:
        if self._perm_cache is None or self._perm_cache[0] != epoch:
            g = torch.Generator()
            g.manual_seed(self.seed + epoch)
            self._perm_cache = (epoch, torch.randperm(n, generator=g).tolist())
        return self._perm_cache[1]

    def _groups(self, window: int, groups: range) -> list[int]:
        """Indices of `groups` (in order) of global micro-batch number `window` (counted from 0)."""
        B, G = self.micro_batch_size, self.grid_size
        b = B // G
        if self.dataloader_type == "single":
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
        if self.dataloader_type == "single" and not 0 <= window < self.windows_per_epoch:
            raise IndexError(f"window={window} is outside the single pass of {self.windows_per_epoch}")
        return self._groups(window, range(self.grid_size))

    def rank_share(self, window: int) -> list[int]:
        """This rank's B/dp indices of global micro-batch number `window`."""
        per = self.grid_size // self.data_parallel_size
        return self._groups(window, range(self.data_parallel_rank * per, (self.data_parallel_rank + 1) * per))

    # -- iteration -------------------------------------------------------------------------------
    def _stop(self, window: int) -> int:
        if self.dataloader_type == "single":
            return self.windows_per_epoch
        return (window // self.windows_per_epoch + 1) * self.windows_per_epoch

    def __len__(self) -> int:
        """Batches the next `iter()` yields: the rest of the current pass / epoch."""
        window = self.consumed_samples // self.micro_batch_size
        return self._stop(window) - window

    def __iter__(self):
        B = self.micro_batch_size
        window = self.consumed_samples // B
        for w in range(window, self._stop(window)):
            batch = self.rank_share(w)
            self.consumed_samples = (w + 1) * B
            yield batch
