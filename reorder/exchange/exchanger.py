"""The window driver: one rank's reorder of W micro-batches, and the only code that calls collectives.

Per window: count (`reorder.batch`), one metadata all-gather of the window frame (`reorder.plan.wire`;
before the first window, once, the config frame), the same plan on every rank
(`reorder.plan.window`), this rank's move list (`reorder.plan.moves`), pack by an executor
(`reorder.exchange.executors`), one ragged all_to_all, assemble by the executor into output fields
allocated as typed tensors, report. A local
validation error travels in the all-gather so every rank raises the same ReorderError. A module of
DP size 1 runs the same steps without collectives.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from reorder.batch.blocks import byte_fields, empty_shard, field_buffers, read_lists, resolved, unit_bytes
from reorder.batch.layout import (LayoutError, describe, field_at, first_difference, grid_thw_of, rebuild, unify,
                                  window_layout)
from reorder.exchange.collectives import Collectives
from reorder.exchange.executors import select_executor
from reorder.exchange.placement import Placement, place
from reorder.plan import wire
from reorder.plan.backoff import Backoff
from reorder.plan.cost import CostModel
from reorder.plan.counts import COLUMNS, SampleCounts
from reorder.plan.grid import Grid, check_global_batch
from reorder.plan.moves import build_moves
from reorder.plan.window import LoadFigures, PlanSettings, WindowPlan, plan_window


class ReorderError(ValueError):
    """Raised identically on every rank of a DP group when any rank found bad input or config."""


@dataclass(frozen=True, slots=True, kw_only=True)
class WindowReport(LoadFigures):
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

    @classmethod
    def of(cls, plan: WindowPlan, *, sent_bytes: int, plan_ms: float, t0: float, marks: list) -> "WindowReport":
        """The report of a planned window, from its plan and this rank's timings."""
        return cls(slots=plan.slots, orders=plan.orders, loads_before=plan.loads_before, loads_after=plan.loads_after,
                   moved_samples=int(plan.moved.sum()), total_samples=plan.orders.size, moved_bytes=plan.moved_bytes,
                   sent_bytes=sent_bytes, plan_ms=plan_ms, exchange_ms=(time.perf_counter() - t0) * 1e3,
                   stage_ms={n: (t - marks[i][1]) * 1e3 for i, (n, t) in enumerate(marks[1:])},
                   gated_slots=int(plan.gated.sum()), shadow=plan.shadow)


@dataclass
class _Window:
    """This rank's window as read: its layout, per slot the shard and pickled list entries, and counts."""

    layout: object
    shards: list
    blobs: list
    counts: SampleCounts  # [W, B/dp]


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
    """

    def __init__(self, *, grid: Grid, micro_batch_size: int, cost: CostModel, balancer: str = "balanced",
                 window_size: int = 1, collectives: Collectives | None = None, batch_dims: dict | None = None,
                 device: torch.device | str | None = None, profile_stages: bool = False,
                 min_gain: float | None = None, min_saving: float | None = None, shadow: bool = False,
                 cross_slot: bool = False, early_copy: bool = False, gate_backoff: int = 0,
                 sample_costs=None, image_counts=None):
        check_global_batch(micro_batch_size, grid.groups)
        if isinstance(window_size, bool) or not isinstance(window_size, int) or window_size < 1:
            raise ValueError(f"window_size={window_size!r} is invalid: must be an integer >= 1")
        if grid.dp > 1 and collectives is None:
            raise ValueError(f"dp={grid.dp} needs collectives over the module's DP group")
        if collectives is not None and (collectives.size != grid.dp or collectives.rank != grid.rank):
            raise ValueError(f"collectives has rank {collectives.rank} of {collectives.size} but the grid says "
                             f"rank {grid.rank} of dp {grid.dp}")
        self.settings = PlanSettings(balancer=balancer, min_gain=min_gain, min_saving=min_saving,
                                     cross_slot=bool(cross_slot), shadow=bool(shadow),
                                     given_costs=sample_costs is not None)
        self.sample_costs, self.image_counts = sample_costs, image_counts
        self.backoff = Backoff(gate_backoff)
        if gate_backoff and not self.settings.gated:
            raise ValueError(f"gate_backoff={gate_backoff} needs the cost-benefit gate: set min_gain or min_saving")
        self.grid, self.global_batch, self.cost = grid, micro_batch_size, cost
        self.window_size, self.collectives, self.batch_dims = window_size, collectives, batch_dims
        self.device = None if device is None else torch.device(device)
        self.profile_stages = profile_stages  # synchronize the device at stage boundaries (benchmarks only)
        self.early_copy = bool(early_copy)
        self.local_batch = micro_batch_size // grid.dp
        self._agreed = False  # the DP group's config frames matched (gathered before the first window)
        self._paths = None  # per-sample field paths of the last planned window (moved in skipped windows)
        self._executors = {}
        self._empty = {}  # device -> an empty uint8 tensor there

    # the settings by their config names (read by wire's config frame, the buffer and the adapters)
    balancer = property(lambda self: self.settings.balancer)
    min_gain = property(lambda self: self.settings.min_gain)
    min_saving = property(lambda self: self.settings.min_saving)
    shadow = property(lambda self: self.settings.shadow)
    cross_slot = property(lambda self: self.settings.cross_slot)
    gate_backoff = property(lambda self: self.backoff.cap)

    @property
    def skips_next(self) -> bool:
        """The next window will be skipped by the gate backoff (no collective, nothing to overlap)."""
        return self.backoff.skip > 0

    # ---- the driver ---------------------------------------------------------------------------

    def exchange(self, batches: list, error: BaseException | None = None) -> tuple[list, WindowReport | None]:
        """Reorder one window (1..window_size micro-batches of this rank); returns the reordered
        micro-batches (same structure, canonical order) and a report. Raises ReorderError on every
        rank together when any rank's input is bad. An empty window marks the end of the stream:
        every rank must pass one together (else all raise); it returns ([], None). `error` is a
        failure found while reading this rank's window (e.g. the data source raised): it is shared
        like a validation error, so every rank raises."""
        t0, batches = time.perf_counter(), list(batches)
        marks = [("start", t0)]
        if self.backoff.skip:
            return self._skipped(batches, error, t0)
        window, error = self._read(batches, error)
        mark = self._marker(marks)
        mark("prepare")
        counts, signatures = self._all_gather_window(window, error, len(batches))
        mark("gather")
        if window is None:
            return [], None
        layout = self._group_layout(window.layout, signatures)
        t_plan = time.perf_counter()
        plan = plan_window(counts, self.cost, self.grid, self.settings, unit_bytes(layout))
        self.backoff, self._paths = self.backoff.planned(plan.fully_gated), _paths(layout)
        plan_ms = (time.perf_counter() - t_plan) * 1e3
        mark("plan")
        if plan.shadow:
            return batches, WindowReport.of(plan, sent_bytes=0, plan_ms=plan_ms, t0=t0, marks=marks)
        if plan.natural:  # nothing to move or permute anywhere: no move list, no buffers
            dev = self._target(window)
            out = [self._kept(b, layout, shard, dev) for b, shard in zip(batches, window.shards)]
            for stage in ("pack", "all_to_all", "assemble"):
                mark(stage)
            return out, WindowReport.of(plan, sent_bytes=0, plan_ms=plan_ms, t0=t0, marks=marks)
        fields = byte_fields(layout)
        moves = build_moves(fields, counts, plan, self.grid.rank)
        placement, sources = self._sources(layout, window)
        send = self._pack(moves, sources, placement) if plan.moves_anything and self.grid.dp > 1 else None
        mark("pack")
        recv = self._all_to_all(send, moves) if send is not None else self._nothing_received(placement.target)
        mark("all_to_all")
        out = self._assemble(batches, layout, window, moves, [recv] + sources)
        mark("assemble")
        return out, WindowReport.of(plan, sent_bytes=0 if send is None else len(send), plan_ms=plan_ms, t0=t0,
                                    marks=marks)

    def _marker(self, marks):
        def mark(name):
            if self.profile_stages and self.device is not None and self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            marks.append((name, time.perf_counter()))
        return mark

    # ---- reading and agreeing -----------------------------------------------------------------

    def _read(self, batches, error):
        """(this rank's window or None, the error to share or None)."""
        if error is not None:
            return None, f"data source raised {type(error).__name__}: {error}"
        try:
            return self._prepare(batches), None
        except (ValueError, TypeError, KeyError, IndexError) as e:
            return None, str(e)

    def _prepare(self, batches) -> _Window | None:
        if not batches:
            return None
        if len(batches) > self.window_size:
            raise ValueError(f"window has {len(batches)} micro-batches: expected 1..window_size={self.window_size}")
        layouts, shards, blobs, counts = [], [], [], []
        early = self.early_copy and self.device is not None
        for slot, batch in enumerate(batches):
            started = self._start_copies(batch) if early else {}
            layout, shard, c = self._count(slot, batch)
            if early:  # counted where it lives; the copies not started before counting start now
                shard.dense = {k: self._copy_of(v, started) for k, v in shard.dense.items()}
                shard.ragged = {k: self._copy_of(v, started) for k, v in shard.ragged.items()}
            b = shard.list_blobs()
            c[:, COLUMNS.index("list_bytes")] = [len(x) for x in b]
            layouts.append(layout)
            shards.append(shard)
            blobs.append(b)
            counts.append(c)
        return _Window(window_layout(layouts), shards, blobs, SampleCounts(np.stack(counts)))

    def _start_copies(self, batch) -> dict:
        """early_copy: {id(tensor): its copy on `device`} for the per-sample fields of the last
        planned window's layout found in `batch`, started before counting so the copies overlap it
        (the first window, or fields the layout does not name, start after counting)."""
        out = {}
        for path in self._paths or ():
            try:
                t = field_at(batch, path)
            except (KeyError, TypeError, IndexError):
                continue
            if isinstance(t, torch.Tensor):
                out[id(t)] = t.to(self.device, non_blocking=True)
        return out

    def _copy_of(self, t, started: dict):
        copy = started.get(id(t))
        return t.to(self.device, non_blocking=True) if copy is None else copy

    def _count(self, slot, batch):
        """(layout, shard, counts table [B/dp, columns]) of one micro-batch; raises LayoutError."""
        ids = batch.get("input_ids") if isinstance(batch, dict) else None
        if not isinstance(ids, torch.Tensor):
            raise LayoutError("field 'input_ids' must be a [B, S] tensor on every rank: the cost is computed from it")
        (placeholders, real, images, sq), grid_thw = self.cost.counts(ids, batch.get("attention_mask"),
                                                                        grid_thw=grid_thw_of(batch))
        if self.image_counts is not None:
            images = _per_sample(self.image_counts(batch), len(placeholders), "image_counts", np.int64)
        layout, shard = describe(batch, self.local_batch, vision_start_token_id=self.cost.vision_start_token_id,
                                 batch_dims=self.batch_dims, image_counts=images,
                                 grid_thw_host=grid_thw, where=f"micro-batch {slot} ")
        rows = np.zeros_like(placeholders) if shard.row_counts is None else shard.row_counts
        given = np.zeros(len(placeholders), np.float64)
        if self.sample_costs is not None:
            given = _per_sample(self.sample_costs(batch), len(placeholders), "sample_costs", np.float64)
        elif shard.row_counts is not None:
            self._check_placeholders(slot, placeholders, rows)
        return layout, shard, SampleCounts.of(placeholders=placeholders, real_tokens=real, images=images, rows=rows,
                                              square_patches=sq, cost_bits=given.view(np.int64)).table

    def _check_placeholders(self, slot, placeholders, rows):
        """The cost counts image placeholders; they must account for the patch rows that travel."""
        merge2 = self.cost.spatial_merge_size ** 2
        bad = np.flatnonzero(placeholders * merge2 != rows)
        if len(bad):
            i = int(bad[0])
            raise LayoutError(f"micro-batch {slot} sample {i}: input_ids holds {int(placeholders[i])} image "
                              f"placeholders (x{merge2} = {int(placeholders[i]) * merge2} patches) but grid_thw "
                              f"gives it {int(rows[i])} patch rows: image counts are mis-sourced or "
                              f"image_token_id / spatial_merge_size is wrong")

    def _all_gather_window(self, window, error, slots):
        """(gathered counts [W, B] or None, the ranks' layout signatures when they differ, else None);
        raises the same ReorderError on every rank for any rank's error."""
        if self.grid.dp == 1:
            if error is not None:
                raise ReorderError(f"reorder failed on rank 0: {error}")
            return (None if window is None else window.counts), None
        if not self._agreed:
            self._agree()
        frame = np.zeros(wire.window_words(self.window_size, self.local_batch, len(COLUMNS)), dtype=np.int64)
        layout = "" if window is None else window.layout.signature()
        wire.encode_window(frame, error=error, slots=slots, layout=layout,
                           counts=None if window is None else window.counts.table)
        gathered = self.collectives.all_gather(torch.from_numpy(frame)).numpy()
        texts, words = None, wire.long_text_words(gathered)
        if words:  # some rank's error or layout did not fit its frame: every rank gathers them whole
            text = wire.encode_text(wire.window_text(error, layout), words)
            texts = [wire.text_of(row) for row in self.collectives.all_gather(torch.from_numpy(text)).numpy()]
        problem, signatures = wire.window_problem(gathered, texts)
        if problem is not None:
            raise ReorderError(problem)
        if window is None:
            return None, None
        return SampleCounts(wire.counts_of(gathered, slots, self.local_batch, len(COLUMNS))), signatures

    def _config(self) -> dict:
        """Every setting that must match across the DP group, by wire.CONFIG name."""
        c, s = self.cost, self.settings
        return dict(micro_batch_size=self.global_batch, groups=self.grid.groups, dp=self.grid.dp,
                    window_size=self.window_size, encoder_weight=c.encoder_weight, language_weight=c.language_weight,
                    encoder_quadratic_weight=c.encoder_quadratic_weight,
                    language_quadratic_weight=c.language_quadratic_weight, encoder_image_weight=c.encoder_image_weight,
                    spatial_merge_size=c.spatial_merge_size, image_token_id=c.image_token_id,
                    vision_start_token_id=c.vision_start_token_id, balancer=s.balancer, shadow=int(s.shadow),
                    cross_slot=int(s.cross_slot), min_gain=s.min_gain, min_saving=s.min_saving,
                    gate_backoff=self.backoff.cap, given_costs=int(s.given_costs),
                    given_image_counts=int(self.image_counts is not None))

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
            path, held = first_difference(signatures)
            detail = ", ".join(f"{what} on ranks {[q for q, h in enumerate(held) if h == what]}"
                               for what in dict.fromkeys(held))
            raise ReorderError(f"batch layout differs across ranks: field {path!r} is {detail}; fields, dtypes "
                               f"and per-sample shapes must match (pad to a fixed sequence length)")
        return layout.resolved(kinds)

    # ---- moving the bytes ---------------------------------------------------------------------

    def _target(self, window: _Window) -> torch.device:
        """Where the reordered micro-batches go: `device`, else where input_ids lives."""
        return resolved(self.device) or window.shards[0].dense[("input_ids",)].device

    def _executor(self, device):
        ex = self._executors.get(device)
        if ex is None:
            ex = self._executors[device] = select_executor(device)
        return ex

    def _sources(self, layout, window: _Window) -> tuple[Placement, list]:
        """The window's placement and this rank's buffers, [slot * F + field], readable by the
        executor on the target device (the others, e.g. host buffers that are not pinned, are moved
        there whole, by DMA)."""
        dev = self._target(window)
        reads_pinned = getattr(self._executor(dev), "reads_pinned_host", False)
        bufs = [t for shard, blobs in zip(window.shards, window.blobs) for t in field_buffers(layout, shard, blobs)]
        placement = place(dev, [(t.device, reads_pinned and t.device.type == "cpu" and t.is_pinned()) for t in bufs],
                          reads_pinned_host=reads_pinned)
        return placement, [t if direct else t.to(dev, non_blocking=True) for t, direct in zip(bufs, placement.direct)]

    def _nothing_received(self, device) -> torch.Tensor:
        """An empty receive buffer on `device` (made once per device; the assemble table reads
        nothing from it)."""
        t = self._empty.get(device)
        if t is None:
            t = self._empty[device] = torch.empty(0, dtype=torch.uint8, device=device)
        return t

    def _pack(self, moves, sources, placement: Placement) -> torch.Tensor:
        """The send buffer, on the placement's target (where the data group's collective reads it),
        whichever device the first source lives on."""
        send = torch.empty(sum(moves.send_splits), dtype=torch.uint8, device=placement.target)
        self._executor(placement.target).run(moves.pack, sources, [send])
        return send

    def _all_to_all(self, send, moves) -> torch.Tensor:
        recv = self.collectives.all_to_all(send, moves.send_splits, moves.recv_splits)
        if len(recv) != sum(moves.recv_splits):
            raise ReorderError(f"rank {self.grid.rank} received {len(recv)} bytes, expected {sum(moves.recv_splits)}")
        return recv

    def _assemble(self, batches, layout, window, moves, buffers) -> list:
        """The output micro-batches: slots that are this rank's own, in order, stay as they are (moved
        to `device` as reorder off would); the others are allocated field by field and written."""
        dev = self._target(window)
        out = list(batches)
        for s in np.flatnonzero(moves.kept).tolist():  # the others are written into new tensors below
            out[s] = self._kept(batches[s], layout, window.shards[s], dev)
        todo = np.flatnonzero(~moves.kept).tolist()
        if todo:
            counts = [SampleCounts(moves.out_counts.table[s]) for s in todo]
            made = [empty_shard(layout, c, dev) for c in counts]
            self._executor(dev).run(moves.assemble, buffers, [t for _, bufs in made for t in bufs])
            for s, c, (shard, bufs) in zip(todo, counts, made):
                if layout.lists:
                    read_lists(shard, bufs[-1], c)
                out[s] = rebuild(batches[s], layout, shard)
        return out

    def _kept(self, batch, layout, shard, dev):
        """A micro-batch this rank keeps as it is: as given, or, with `device`, its per-sample
        fields there as reorder off would move them (with early_copy: the copies made at counting)."""
        if self.device is None:
            return batch
        return rebuild(batch, layout, shard) if self.early_copy else _fields_to(batch, self._paths, dev)

    def _skipped(self, batches, error, t0):
        """A window the gate backoff skips: the micro-batches in natural order, per-sample fields (the
        last planned window's layout) on `device` (as given in shadow mode); errors and the end of the
        stream stay local."""
        if error is not None:
            raise ReorderError(f"reorder failed on rank {self.grid.rank}: data source raised "
                               f"{type(error).__name__}: {error}")
        if not batches:
            return [], None
        self.backoff = self.backoff.skipped()
        dev = resolved(self.device)
        out = batches if dev is None or self.shadow else [_fields_to(b, self._paths, dev) for b in batches]
        w, nan = len(batches), np.full((len(batches), self.grid.dp), np.nan)
        return out, WindowReport(slots=w, orders=np.tile(np.arange(self.global_batch), (w, 1)), loads_before=nan,
                                 loads_after=nan, moved_samples=0, total_samples=w * self.global_batch,
                                 moved_bytes=0, sent_bytes=0, plan_ms=0.0,
                                 exchange_ms=(time.perf_counter() - t0) * 1e3, gated_slots=w, shadow=self.shadow,
                                 skipped=True)


def _per_sample(values, n: int, name: str, dtype) -> np.ndarray:
    """A caller's per-sample values as a [n] array of `dtype`; ValueError naming `name` otherwise
    (costs must be finite and >= 0, counts integers >= 0)."""
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().numpy()
    a = np.asarray(values)
    if a.shape != (n,) or not (np.issubdtype(a.dtype, np.number) or a.dtype == bool):
        raise ValueError(f"{name} returned {a.dtype} of shape {a.shape}: expected {n} numbers, one per sample")
    a = a.astype(dtype)
    bad = np.flatnonzero(~np.isfinite(a) | (a < 0)) if dtype == np.float64 else np.flatnonzero(a < 0)
    if len(bad):
        raise ValueError(f"{name} gave sample {int(bad[0])} the value {a[bad[0]].item()!r}: every value must be "
                         f"{'finite and ' if dtype == np.float64 else ''}>= 0")
    return a


def _paths(layout) -> list:
    return [f.path for f in layout.dense] + [f.path for f in layout.ragged]


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
