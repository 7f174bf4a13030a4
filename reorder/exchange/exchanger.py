"""Window exchange: one rank's full reorder of W micro-batches, over any `Collectives`.

Per window: compute integer counts locally (cost inputs, images, patch rows, list bytes), one
metadata all-gather of a fixed-size int64 tensor (header + error/layout text + counts), the same
plan on every rank, one ragged all_to_all of packed samples, reassembly in canonical order.
A local validation error travels in the all-gather so every rank raises the same ReorderError.
A module with DP size 1 permutes locally with no communication.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch

from reorder.batch import packing
from reorder.exchange.collectives import Collectives
from reorder.plan.cost import CostModel
from reorder.plan.grid import Grid, check_global_batch
from reorder.batch.layout import LayoutError, describe, field_at, grid_of, rebuild, unify
from reorder.exchange import wire
from reorder.plan.orders import plan_gated_orders, plan_orders, rank_loads
from reorder.plan.routes import window_routes

COLS = 6  # placeholders, real tokens, images, patch rows, list bytes, sum of per-image patches**2


class ReorderError(ValueError):
    """Raised identically on every rank of a DP group when any rank found bad input or config."""


@dataclass(frozen=True, slots=True, kw_only=True)
class WindowReport:
    """What one window exchange did, from this rank's view (module-wide figures where named)."""

    slots: int
    orders: np.ndarray  # [W, B] canonical orders
    loads_before: np.ndarray  # [W, dp] per-rank cost, natural assignment
    loads_after: np.ndarray  # [W, dp] per-rank cost after reordering
    moved_samples: int  # module-wide: samples whose rank changed
    total_samples: int  # module-wide: W * B
    moved_bytes: int  # module-wide payload bytes of moved samples
    sent_bytes: int  # this rank's all_to_all send size
    plan_ms: float
    exchange_ms: float
    stage_ms: dict | None = None  # prepare, gather, plan, pack, all_to_all, assemble (see profile_stages)
    gated_slots: int = 0  # slots kept in natural order by the cost-benefit gate
    shadow: bool = False  # planned and reported only: nothing moved, micro-batches returned as given
    skipped: bool = False  # gate backoff: not planned, no collective, natural order (loads unknown: NaN)

    @property
    def max_before(self) -> float:
        return float(self.loads_before.max(axis=1).sum())

    @property
    def max_after(self) -> float:
        return float(self.loads_after.max(axis=1).sum())

    @property
    def spread_before(self) -> float:
        return _spread(self.loads_before)

    @property
    def spread_after(self) -> float:
        return _spread(self.loads_after)


def _spread(loads):
    mean = loads.mean(axis=1)
    ok = mean > 0
    return float((loads.max(axis=1)[ok] / mean[ok]).mean()) if ok.any() else 1.0


class WindowExchanger:
    """Reorders windows of micro-batches for one rank of one module.

    grid: this rank's place (G, dp, rank); micro_batch_size: B; cost: the cost model; balancer: name;
    window_size: most slots per window (metadata is sized for it); collectives: the module's DP
    group (None only when dp == 1); batch_dims: overrides of per-field batch dims; device: where
    the reordered micro-batches go (counts are taken, and payloads copied straight from, where the
    batch lives, e.g. pinned host memory); min_gain / min_saving: cost-benefit gate
    (plan.gate_orders: relative gain / saving in cost units a slot must exceed to move); shadow: plan
    and report what reordering would do (WindowReport) but return the micro-batches unchanged;
    cross_slot: plan one equal-count assignment over the window's W x G (slot, group) cells;
    early_copy (with `device`): copy each micro-batch there as soon as it is counted, so the copy
    overlaps the metadata all-gather and planning (the fastest synchronous exchange from host memory)
    while the whole window sits on the device; False: copy straight from where the batch lives into
    the reordered output after planning (one window less on the device; with overlap the copy is
    hidden anyway). gate_backoff (needs min_gain or min_saving): after the k-th planned window in a
    row whose every slot the gate kept natural, skip the next min(2**(k-1), gate_backoff) windows:
    no counting, no collective, natural order, per-sample fields moved to `device` (what reorder off
    does, at almost no cost). Every rank and module skips the same windows (the decision depends only
    on gate results); in a skipped window a data-source error or an early end is raised on its own
    rank only, as with reorder off. 0 (default): every window is planned.
    """

    def __init__(self, *, grid: Grid, micro_batch_size: int, cost: CostModel, balancer: str = "balanced",
                 window_size: int = 1, collectives: Collectives | None = None, batch_dims: dict | None = None,
                 device: torch.device | str | None = None, profile_stages: bool = False,
                 min_gain: float | None = None, min_saving: float | None = None, shadow: bool = False,
                 cross_slot: bool = False, early_copy: bool = False, gate_backoff: int = 0):
        global_batch = micro_batch_size  # B, samples of one global micro-batch (Megatron's micro_batch_size)
        check_global_batch(global_batch, grid.groups)
        if not isinstance(window_size, int) or window_size < 1:
            raise ValueError(f"window_size={window_size!r} is invalid: must be an integer >= 1")
        if grid.dp > 1 and collectives is None:
            raise ValueError(f"dp={grid.dp} needs collectives over the module's DP group")
        if collectives is not None and (collectives.size != grid.dp or collectives.rank != grid.rank):
            raise ValueError(f"collectives has rank {collectives.rank} of {collectives.size} but the grid says "
                             f"rank {grid.rank} of dp {grid.dp}")
        plan_orders(np.zeros((1, global_batch)), grid.groups, balancer)  # validates the balancer name
        self.grid, self.global_batch, self.cost, self.balancer = grid, global_batch, cost, balancer
        self.window_size, self.collectives, self.batch_dims = window_size, collectives, batch_dims
        self.device = None if device is None else torch.device(device)
        self.profile_stages = profile_stages  # synchronize the device at stage boundaries (benchmarks only)
        if min_gain is not None and not 0 <= min_gain < 1:
            raise ValueError(f"min_gain={min_gain!r} is invalid: the relative gain threshold must be in [0, 1)")
        if min_saving is not None and (isinstance(min_saving, bool) or not isinstance(min_saving, (int, float))
                                       or not math.isfinite(min_saving) or min_saving < 0):
            raise ValueError(f"min_saving={min_saving!r} is invalid: the saving threshold (cost units) must be "
                             "a finite number >= 0")
        self.min_gain, self.min_saving = min_gain, min_saving  # cost-benefit gate (plan.gate_orders)
        if isinstance(gate_backoff, bool) or not isinstance(gate_backoff, int) or gate_backoff < 0:
            raise ValueError(f"gate_backoff={gate_backoff!r} is invalid: windows skipped after gated ones must "
                             "be an integer >= 0")
        if gate_backoff and min_gain is None and min_saving is None:
            raise ValueError(f"gate_backoff={gate_backoff} needs the cost-benefit gate: set min_gain or min_saving")
        self.gate_backoff = gate_backoff
        self._gated_run, self._skip, self._paths = 0, 0, None  # backoff state; per-sample field paths
        self._agreed = False  # the DP group's config frames matched (gathered before the first window)
        self.shadow = bool(shadow)  # plan and report, move nothing (must match across the DP group)
        # opt-in: balance over the whole window (samples may change micro-batch; still B/dp per rank
        # per slot). Valid only when the optimizer steps once per window and the loss is normalized
        # over the whole global batch, never per micro-batch (see README).
        self.cross_slot = bool(cross_slot)
        self.early_copy = bool(early_copy)
        self.local_batch = global_batch // grid.dp

    # ---- local part -------------------------------------------------------------------------

    def _prepare(self, batches):
        if not batches:
            return None
        if len(batches) > self.window_size:
            raise ValueError(f"window has {len(batches)} micro-batches: expected 1..window_size={self.window_size}")
        layouts, shards, counts = [], [], []
        for slot, batch in enumerate(batches):
            ids = batch.get("input_ids") if isinstance(batch, dict) else None
            if not isinstance(ids, torch.Tensor):
                raise LayoutError("field 'input_ids' must be a [B, S] tensor on every rank: the cost is computed from it")
            per_sample, grid = self.cost.counts(ids, batch.get("attention_mask"), grid_thw=grid_of(batch))
            placeholders, real, images, sq = per_sample
            layout, shard = describe(batch, self.local_batch, vision_start_token_id=self.cost.vision_start_token_id,
                                     batch_dims=self.batch_dims, image_counts=torch.from_numpy(images), grid_host=grid,
                                     where=f"micro-batch {slot} ")
            if layouts and layout != layouts[0]:
                raise LayoutError(f"micro-batch {slot} of the window has layout {layout.signature()!r} but "
                                  f"micro-batch 0 has {layouts[0].signature()!r}: pad to a fixed width")
            rows = np.zeros_like(placeholders) if shard.row_counts is None else shard.row_counts.numpy()
            if shard.row_counts is not None:
                merge2 = self.cost.spatial_merge_size ** 2
                bad = np.flatnonzero(placeholders * merge2 != rows)
                if len(bad):
                    i = int(bad[0])
                    raise LayoutError(f"micro-batch {slot} sample {i}: input_ids holds {int(placeholders[i])} image "
                                      f"placeholders (x{merge2} = {int(placeholders[i]) * merge2} patches) but grid_thw "
                                      f"gives it {int(rows[i])} patch rows: image counts are mis-sourced or "
                                      f"image_token_id / spatial_merge_size is wrong")
            if self.early_copy and self.device is not None:  # counted where it lives; copies start now
                shard.dense = {k: v.to(self.device, non_blocking=True) for k, v in shard.dense.items()}
                shard.ragged = {k: v.to(self.device, non_blocking=True) for k, v in shard.ragged.items()}
            blobs = shard.list_blobs()
            layouts.append(layout)
            shards.append((shard, blobs))
            c = np.empty((self.local_batch, COLS), dtype=np.int64)
            c[:, 0], c[:, 1], c[:, 2], c[:, 3], c[:, 5] = placeholders, real, images, rows, sq
            c[:, 4] = [len(x) for x in blobs]
            counts.append(c)
        return layouts[0], shards, np.stack(counts)

    def _plan(self, costs):
        """Per-slot orders [W, B] (slot-local indices), or with cross_slot one order over the window
        (entries are flat natural ids slot*B + j, output slot s = row s)."""
        w, batch = costs.shape
        if self.cross_slot and w > 1:
            order, gated = plan_gated_orders(costs.reshape(1, w * batch), self.grid.groups * w, self.balancer,
                                             self.min_gain, self.min_saving)
            return order.reshape(w, batch), np.repeat(gated, w)
        return plan_gated_orders(costs, self.grid.groups, self.balancer, self.min_gain, self.min_saving)

    def _config(self) -> dict:
        """Every setting that must match across the DP group, by wire.CONFIG name."""
        c = self.cost
        return dict(micro_batch_size=self.global_batch, groups=self.grid.groups, dp=self.grid.dp,
                    window_size=self.window_size, encoder_weight=c.encoder_weight, language_weight=c.language_weight,
                    encoder_quadratic_weight=c.encoder_quadratic_weight,
                    language_quadratic_weight=c.language_quadratic_weight, encoder_image_weight=c.encoder_image_weight,
                    spatial_merge_size=c.spatial_merge_size, image_token_id=c.image_token_id,
                    vision_start_token_id=c.vision_start_token_id, balancer=self.balancer, shadow=self.shadow,
                    cross_slot=self.cross_slot, min_gain=self.min_gain, min_saving=self.min_saving,
                    gate_backoff=self.gate_backoff)

    def _agree(self) -> None:
        """Before the first window: gather the fixed-size config frame, so ranks whose configs differ
        (even in what sizes the window frame: window_size, global micro-batch) all raise the same
        ReorderError naming the field and each rank's value, instead of a mismatched collective."""
        gathered = self.collectives.all_gather(torch.from_numpy(wire.encode_config(self._config()))).numpy()
        problem = wire.config_mismatch(gathered)
        if problem is not None:
            raise ReorderError(problem)
        self._agreed = True

    @staticmethod
    def _group_layout(layout, signatures):
        """This rank's layout as the DP group agreed it (fields left "any" take the kind another rank
        saw), or the same ReorderError on every rank when the ranks' layouts cannot agree."""
        kinds = {} if signatures is None else unify(signatures)
        if kinds is None:
            sigs = dict.fromkeys(signatures)
            detail = "; ".join(f"ranks {[q for q, v in enumerate(signatures) if v == s]}: {s}" for s in sigs)
            raise ReorderError(f"batch layout differs across ranks (fields, dtypes and per-sample shapes must "
                               f"match: pad to a fixed sequence length): {detail}")
        return layout.resolved(kinds)

    # ---- the exchange -----------------------------------------------------------------------

    def exchange(self, batches: list, error: BaseException | None = None) -> tuple[list, WindowReport | None]:
        """Reorder one window (1..window_size micro-batches of this rank); returns the reordered
        micro-batches (same structure, canonical order) and a report. Raises ReorderError on every
        rank together when any rank's input is bad. An empty window marks the end of the stream:
        every rank must pass one together (else all raise); it returns ([], None). `error` is a
        failure found while reading this rank's window (e.g. the data source raised): it is shared
        like a validation error, so every rank raises."""
        t0 = time.perf_counter()
        marks = [("start", t0)]

        def mark(name):
            if self.profile_stages and self.device is not None and self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            marks.append((name, time.perf_counter()))

        batches = list(batches)
        if self._skip:
            return self._skipped(batches, error, t0)
        local = None
        if error is None:
            try:
                local = self._prepare(batches)
            except (ValueError, TypeError, KeyError, IndexError) as e:
                error = e
        else:
            error = f"data source raised {type(error).__name__}: {error}"
            batches = batches or [None]
        dp, b, B, W = self.grid.dp, self.local_batch, self.global_batch, len(batches)
        if dp == 1:
            if error is not None:
                raise ReorderError(f"reorder failed on rank 0: {error}")
            return ([], None) if local is None else self._local(batches, local, t0)
        if not self._agreed:
            self._agree()
        frame = np.zeros(wire.window_words(self.window_size, b, COLS), dtype=np.int64)
        wire.encode_window(frame, error=None if error is None else str(error), slots=W,
                           layout="" if local is None else local[0].signature(),
                           counts=None if local is None else local[2])
        mark("prepare")
        gathered = self.collectives.all_gather(torch.from_numpy(frame)).numpy()
        mark("gather")
        problem, signatures = wire.window_problem(gathered)
        if problem is not None:
            raise ReorderError(problem)
        if W == 0:
            return [], None
        layout, shards, _ = local
        layout = self._group_layout(layout, signatures)
        counts = wire.counts_of(gathered, W, b, COLS)  # natural order per slot
        t_plan = time.perf_counter()
        costs = self.cost.costs(counts[..., 0], counts[..., 1], counts[..., 5], counts[..., 2])
        orders, gated = self._plan(costs)
        self._backoff(gated, layout)
        cross = self.cross_slot and W > 1
        plan_ms = (time.perf_counter() - t_plan) * 1e3
        mark("plan")
        flat = counts.reshape(W * B, COLS)
        moved = self._moved(orders)  # the same on every rank: it depends only on the plan
        if self.shadow:
            return batches, self._report(layout, flat, costs, orders, moved, gated, 0, plan_ms, t0, marks)
        if cross:
            out, sent = self._cross_slot(batches, layout, shards, flat, orders, moved.any())
            mark("assemble")
            return out, self._report(layout, flat, costs, orders, moved, gated, sent, plan_ms, t0, marks)
        r = self.grid.rank
        if not moved.any():  # the same decision on every rank: no transfer, at most a local reorder
            mark("pack")
            mark("all_to_all")
            out = [self._reassembled(batches[s], layout, [shards[s][0]], orders[s, r * b:(r + 1) * b] - r * b, s,
                                     "local reorder") for s in range(W)]
            mark("assemble")
            return out, self._report(layout, flat, costs, orders, moved, gated, 0, plan_ms, t0, marks)
        routes = window_routes(orders, dp, r)
        pieces = {}
        send_nat = [(ids // b) * B + r * b + ids % b for ids in routes.send_index]
        send_sizes, recv_sizes = np.split(_piece_sizes(layout, flat, send_nat + list(routes.recv_natural), W, B), 2)
        send = torch.empty(int(send_sizes.sum()), dtype=torch.uint8, device=self._device(shards))
        jobs = [(shards[s][0], ids[ids // b == s] % b, shards[s][1])
                for ids in routes.send_index for s in range(W)]  # wire order: peer-major, then slot
        written = packing.pack_many(layout, jobs, send)
        assert written == send_sizes.reshape(-1).tolist(), (written, send_sizes)
        mark("pack")
        recv = self.collectives.all_to_all(send, send_sizes.sum(axis=1).tolist(), recv_sizes.sum(axis=1).tolist())
        sent, send = len(send), None  # freed before the output is allocated (the collective keeps its own ref)
        if len(recv) != int(recv_sizes.sum()):
            raise ReorderError(f"rank {r} received {len(recv)} bytes, expected {int(recv_sizes.sum())}")
        mark("all_to_all")
        off = 0
        for q in range(dp):
            ids = routes.recv_natural[q]
            for s in range(W):
                sel = flat[ids[ids // B == s]]
                if len(sel):
                    pieces[q, s] = packing.Packed(layout, recv, off, len(sel), sel[:, 3], sel[:, 2], sel[:, 4])
                off += int(recv_sizes[q, s])
        out = []
        for s in range(W):
            sources = [shards[s][0]] + [pieces[q, s] for q in range(dp) if (q, s) in pieces]
            out.append(self._reassembled(batches[s], layout, sources, routes.gather[s], s, "reassembly"))
        mark("assemble")
        return out, self._report(layout, flat, costs, orders, moved, gated, sent, plan_ms, t0, marks)

    @property
    def skips_next(self) -> bool:
        """The next window will be skipped by the gate backoff (no collective, nothing to overlap)."""
        return self._skip > 0

    def _backoff(self, gated, layout):
        """After a planned window: how many windows to skip next (the same on every rank and module)."""
        if not self.gate_backoff:
            return
        self._gated_run = self._gated_run + 1 if gated.all() else 0
        self._skip = min(2 ** (self._gated_run - 1), self.gate_backoff) if self._gated_run else 0
        self._paths = [f.path for f in layout.dense] + [f.path for f in layout.ragged]

    def _skipped(self, batches, error, t0):
        """A window the gate backoff skips: the micro-batches in natural order, per-sample fields (the
        last planned window's layout) on `device` (as given in shadow mode); errors and the end of the
        stream stay local."""
        if error is not None:
            raise ReorderError(f"reorder failed on rank {self.grid.rank}: data source raised "
                               f"{type(error).__name__}: {error}")
        if not batches:
            return [], None
        self._skip -= 1
        dev = packing.resolved(self.device)
        out = batches if dev is None or self.shadow else [_fields_to(b, self._paths, dev) for b in batches]
        w, nan = len(batches), np.full((len(batches), self.grid.dp), np.nan)
        return out, WindowReport(slots=w, orders=np.tile(np.arange(self.global_batch), (w, 1)), loads_before=nan,
                                 loads_after=nan, moved_samples=0, total_samples=w * self.global_batch,
                                 moved_bytes=0, sent_bytes=0, plan_ms=0.0,
                                 exchange_ms=(time.perf_counter() - t0) * 1e3, gated_slots=w, shadow=self.shadow,
                                 skipped=True)

    def _reassembled(self, batch, layout, sources, idx, slot, what):
        """Micro-batch `batch` holding samples `idx` of the concatenated `sources`; raises the same
        ReorderError if idx is not local_batch distinct samples of them."""
        b = self.local_batch
        if len(np.unique(idx)) != b or idx.min() < 0 or idx.max() >= sum(x.n for x in sources):
            raise ReorderError(f"rank {self.grid.rank} slot {slot}: {what} index is not {b} unique samples")
        return rebuild(batch, layout, packing.take(layout, sources, idx, self.device))

    def _device(self, shards) -> torch.device:
        """Where payloads go: `device`, else where input_ids lives."""
        return self.device or shards[0][0].dense[("input_ids",)].device

    def _moved(self, orders) -> np.ndarray:
        """bool: which natural samples change rank (with cross_slot: change (slot, rank))."""
        w = len(orders)
        if self.cross_slot and w > 1:
            return orders_moved(orders.reshape(1, -1), self.grid.dp * w)
        return orders_moved(orders, self.grid.dp)

    def _report(self, layout, flat, costs, orders, moved, gated, sent_bytes, plan_ms, t0, marks):
        """The window's figures; module-wide moves from the plan (what would move, in shadow mode)."""
        dp = self.grid.dp
        w, batch = orders.shape
        before = rank_loads(costs, None, dp)
        if gated.all():  # natural order everywhere
            after = before
        elif self.cross_slot and w > 1:
            after = costs.reshape(-1)[orders.reshape(-1)].reshape(w, dp, batch // dp).sum(axis=2)
        else:
            after = rank_loads(costs, orders, dp)
        sample_bytes = (layout.dense_sample_bytes + flat[:, 3] * layout.row_bytes + flat[:, 2] * layout.image_bytes
                        + flat[:, 4])
        return WindowReport(slots=len(orders), orders=orders, loads_before=before,
                            loads_after=after, moved_samples=int(moved.sum()),
                            total_samples=orders.size, moved_bytes=int(sample_bytes[moved.reshape(-1)].sum()),
                            sent_bytes=sent_bytes, plan_ms=plan_ms, exchange_ms=(time.perf_counter() - t0) * 1e3,
                            stage_ms={n: (t - marks[i][1]) * 1e3 for i, (n, t) in enumerate(marks[1:])},
                            gated_slots=int(gated.sum()), shadow=self.shadow)

    def _cross_slot(self, batches, layout, shards, flat, orders, anyone_moves: bool):
        """Window-level exchange: the window is one batch of W*B samples over V = W*dp virtual ranks
        (virtual rank s*dp + q = rank q in slot s), so `window_routes` applies unchanged. Every piece
        virtual v -> v' travels from real rank v % dp to v' % dp (a cross-slot move inside one rank
        goes through this rank's own all_to_all chunk). Returns (micro-batches, bytes sent)."""
        dp, r, b = self.grid.dp, self.grid.rank, self.local_batch
        W, B = orders.shape
        V = W * dp
        perm = orders.reshape(1, W * B)
        mine = [s * dp + r for s in range(W)]
        rts = {v: window_routes(perm, V, v) for v in mine}

        def size(natural_ids):
            sel = flat[natural_ids]
            return int(packing.nbytes(layout, len(sel), int(sel[:, 3].sum()), int(sel[:, 2].sum()), int(sel[:, 4].sum())))

        send_pieces = []  # (dest real rank, src virtual, dest virtual, local idx, size), in wire order
        for q in range(dp):
            for v2 in range(q, V, dp):
                for v in mine:
                    if v2 != v and len(rts[v].send_index[v2]):
                        idx = rts[v].send_index[v2]
                        send_pieces.append((q, v, v2, idx, size(v * b + idx)))
        recv_pieces = []  # (src real rank, src virtual, dest virtual, natural ids, size), in wire order
        for q in range(dp):
            for v2 in mine:
                for v in range(q, V, dp):
                    if v != v2 and len(rts[v2].recv_natural[v]):
                        ids = rts[v2].recv_natural[v]
                        recv_pieces.append((q, v, v2, ids, size(ids)))
        send = torch.empty(sum(p[4] for p in send_pieces), dtype=torch.uint8, device=self._device(shards))
        written = packing.pack_many(layout, [(shards[v // dp][0], idx, shards[v // dp][1])
                                             for _, v, _, idx, _ in send_pieces], send)
        assert written == [p[4] for p in send_pieces], written
        send_splits = [sum(p[4] for p in send_pieces if p[0] == q) for q in range(dp)]
        recv_splits = [sum(p[4] for p in recv_pieces if p[0] == q) for q in range(dp)]
        # same decision on every rank (it depends only on the plan): skip the collective if nothing moves
        recv = self.collectives.all_to_all(send, send_splits, recv_splits) if anyone_moves else send
        pieces, off = {}, 0
        for _, v, v2, ids, sz in recv_pieces:
            sel = flat[ids]
            pieces[v, v2] = packing.Packed(layout, recv, off, len(sel), sel[:, 3], sel[:, 2], sel[:, 4])
            off += sz
        out = []
        for s, v2 in enumerate(mine):
            sources = [shards[s][0]] + [pieces[v, v2] for v in range(V) if v != v2 and (v, v2) in pieces]
            out.append(self._reassembled(batches[s], layout, sources, rts[v2].gather[0], s, "cross-slot reassembly"))
        return out, int(len(send))

    def _local(self, batches, local, t0):
        layout, shards, counts = local
        layout = layout.resolved()
        t_plan = time.perf_counter()
        costs = self.cost.costs(counts[..., 0], counts[..., 1], counts[..., 5], counts[..., 2])
        orders, gated = self._plan(costs)
        self._backoff(gated, layout)
        plan_ms = (time.perf_counter() - t_plan) * 1e3
        cross = self.cross_slot and len(batches) > 1
        if self.shadow:
            out = batches
        elif cross:  # orders hold flat ids into the window: take from all local micro-batches
            every = [shard for shard, _ in shards]
            out = [rebuild(batch, layout, packing.take(layout, every, orders[s], self.device))
                   for s, batch in enumerate(batches)]
        else:
            out = [rebuild(batch, layout, packing.take(layout, [shard], orders[s], self.device))
                   for s, (batch, (shard, _)) in enumerate(zip(batches, shards))]
        after = costs.reshape(-1)[orders.reshape(-1)].reshape(orders.shape).sum(axis=1, keepdims=True) if cross \
            else rank_loads(costs, orders, 1)
        report = WindowReport(slots=len(batches), orders=orders, loads_before=rank_loads(costs, None, 1),
                              loads_after=after, moved_samples=0,
                              total_samples=counts.shape[0] * counts.shape[1], moved_bytes=0, sent_bytes=0,
                              plan_ms=plan_ms, exchange_ms=(time.perf_counter() - t0) * 1e3,
                              gated_slots=int(gated.sum()), shadow=self.shadow)
        return out, report


def _fields_to(batch: dict, paths: list, device: torch.device) -> dict:
    """`batch` with the tensors at `paths` on `device` (non-blocking copies where they are elsewhere;
    the same objects where they are there already); dicts along the way are shallow copies."""
    if all(field_at(batch, p).device == device for p in paths):
        return batch
    out = dict(batch)
    for path in paths:
        d = out
        for k in path[:-1]:
            d[k] = d = dict(d[k])
        d[path[-1]] = d[path[-1]].to(device, non_blocking=True)
    return out


def _piece_sizes(layout, flat: np.ndarray, natural_ids: list, W: int, B: int) -> np.ndarray:
    """int64 [peers, W]: packed bytes of the samples natural_ids[q] (flat slot*B + j) per slot."""
    ids = np.concatenate(natural_ids)
    key = np.concatenate([q * W + x // B for q, x in enumerate(natural_ids)])
    sel = flat[ids]
    n = len(natural_ids) * W
    sums = [np.bincount(key, weights=sel[:, c], minlength=n).astype(np.int64) for c in (3, 2, 4)]
    return packing.nbytes_many(layout, np.bincount(key, minlength=n), *sums).reshape(len(natural_ids), W)


def orders_moved(orders: np.ndarray, dp: int) -> np.ndarray:
    """bool [W, B]: natural sample j changes rank in a module of DP size dp."""
    w, batch = orders.shape
    b = batch // dp
    pos = np.empty_like(orders)
    pos[np.arange(w)[:, None], orders] = np.arange(batch)[None, :]
    return (pos // b) != (np.arange(batch) // b)[None, :]
