"""The window driver: one rank's reorder of W micro-batches, and the only code that calls collectives.

Everything a window decides is in `reorder.exchange.round.WindowRound`, which takes and returns
frames and byte buffers; this driver carries them: the config frame's all-gather once, the window
frame's all-gather (and, rarely, a text frame's), and the payload all_to_all. A module of DP size 1
runs the same round with no collective.
"""

from __future__ import annotations

import numpy as np
import torch

from reorder.exchange.collectives import Collectives
from reorder.exchange.round import Outgoing, ReorderError, WindowReport, WindowRound
from reorder.plan.cost import CostModel
from reorder.plan.grid import Grid

__all__ = ["ReorderError", "WindowExchanger", "WindowReport"]


class WindowExchanger:
    """Reorders windows of micro-batches for one rank of one module.

    grid: this rank's place (G, dp, rank); micro_batch_size: B, the global micro-batch; cost: the
    cost model; balancer: name; window_size: most slots per window (the window frame is sized for
    it); collectives: the module's DP group (None only when dp == 1); batch_dims: overrides of
    per-field batch dims; device: where the reordered micro-batches go (counts are taken, and
    payloads copied straight from, where the batch lives, e.g. pinned host memory); min_gain /
    min_saving, shadow, cross_slot: see `PlanSettings`; early_copy (with `device`): copy each
    micro-batch there as soon as it is counted, so the copy overlaps the metadata all-gather and
    planning (the whole window then sits on the device); gate_backoff (needs min_gain or
    min_saving): skip windows after fully gated ones (`reorder.plan.backoff`): no counting, no
    collective, natural order, per-sample fields moved to `device` (what reorder off does). Every
    rank and module skips the same windows; in a skipped window a data-source error or an early end
    is raised on its own rank only, as with reorder off. 0 (default): every window is planned.
    sample_costs: `micro-batch -> B/dp finite costs >= 0`, used instead of the cost model (from fields
    every module holds, so every module plans alike); they travel bit for bit in the window frame.
    image_counts: `micro-batch -> B/dp image counts`, instead of counting vision-start tokens.
    verify: the runtime self-check, 0 (off), 1 (every window) or N (every N-th): each rank's
    per-sample, per-field checksums of what it read and of what it assembled travel in the next
    window frame; every rank compares them alike, and a mismatch raises ReorderError on every rank of
    the group at that window (or at the end of the stream), naming window, micro-batch, holding rank,
    sample, field and source rank (`reorder.batch.checksum`). Nothing waits for the device.
    """

    def __init__(self, *, grid: Grid, micro_batch_size: int, cost: CostModel, balancer: str = "balanced",
                 window_size: int = 1, collectives: Collectives | None = None, batch_dims: dict | None = None,
                 device: torch.device | str | None = None, profile_stages: bool = False,
                 min_gain: float | None = None, min_saving: float | None = None, shadow: bool = False,
                 cross_slot: bool = False, early_copy: bool = False, gate_backoff: int = 0,
                 sample_costs=None, image_counts=None, verify: int = 0):
        self.round = WindowRound(grid=grid, micro_batch_size=micro_batch_size, cost=cost, balancer=balancer,
                                 window_size=window_size, batch_dims=batch_dims, device=device,
                                 profile_stages=profile_stages, min_gain=min_gain, min_saving=min_saving,
                                 shadow=shadow, cross_slot=cross_slot, early_copy=early_copy,
                                 gate_backoff=gate_backoff, sample_costs=sample_costs, image_counts=image_counts,
                                 verify=verify)
        if grid.dp > 1 and collectives is None:
            raise ValueError(f"dp={grid.dp} needs collectives over the module's DP group")
        if collectives is not None and (collectives.size != grid.dp or collectives.rank != grid.rank):
            raise ValueError(f"collectives has rank {collectives.rank} of {collectives.size} but the grid says "
                             f"rank {grid.rank} of dp {grid.dp}")
        self.collectives = collectives

    # the round's settings, by the names the exchanger is built with
    grid = property(lambda self: self.round.grid)
    micro_batch_size = property(lambda self: self.round.micro_batch_size)
    cost = property(lambda self: self.round.cost)
    window_size = property(lambda self: self.round.window_size)
    device = property(lambda self: self.round.device)
    early_copy = property(lambda self: self.round.early_copy)
    balancer = property(lambda self: self.round.settings.balancer)
    min_gain = property(lambda self: self.round.settings.min_gain)
    min_saving = property(lambda self: self.round.settings.min_saving)
    shadow = property(lambda self: self.round.settings.shadow)
    cross_slot = property(lambda self: self.round.settings.cross_slot)
    gate_backoff = property(lambda self: self.round.backoff.cap)
    verify = property(lambda self: self.round.verify)
    verified_windows = property(lambda self: self.round.verified_windows,
                                doc="Windows the self-check compared on every rank of the group and found intact "
                                    "(a checked window is compared at the next window, or at the end of the stream).")
    verified_samples = property(lambda self: self.round.verified_samples,
                                doc="The samples of those windows, module-wide: each compared field by field.")
    skips_next = property(lambda self: self.round.skips_next,
                          doc="The next window will be skipped by the gate backoff (no collective, nothing to overlap).")

    def exchange(self, batches: list, error: BaseException | None = None) -> tuple[list, WindowReport | None]:
        """Reorder one window (1..window_size micro-batches of this rank); returns the reordered
        micro-batches (same structure, canonical order) and a report. Raises ReorderError on every
        rank together when any rank's input is bad. An empty window marks the end of the stream:
        every rank must pass one together (else all raise); it returns ([], None). `error` is a
        failure found while reading this rank's window (e.g. the data source raised): it is shared
        like a validation error, so every rank raises."""
        r = self.round
        frame = r.read(batches, error)
        if frame is not None:  # None: a window the gate backoff skips, on every rank alike
            if not r.agreed:
                r.agree(self._all_gather(r.config_frame()))
            texts = r.gathered(self._all_gather(frame))
            if texts is not None:
                r.gathered_texts(self._all_gather(texts))
        outgoing = r.pack()
        try:
            received = None if outgoing is None else self._all_to_all(outgoing)
        except Exception:
            r.verify_last()  # a corrupted window is the worse news: its error first
            raise
        return r.finish(received)

    def _all_gather(self, frame: np.ndarray) -> np.ndarray:
        if self.collectives is None:
            return frame[None]
        return self.collectives.all_gather(torch.from_numpy(frame)).numpy()

    def _all_to_all(self, outgoing: Outgoing) -> torch.Tensor:
        return self.collectives.all_to_all(outgoing.buffer, outgoing.send_splits, outgoing.recv_splits)
