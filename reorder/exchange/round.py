"""One rank's window exchange as a round with no I/O: frames and byte buffers in, frames and byte
buffers out. The driver (`reorder.exchange.exchanger.WindowExchanger`) carries them over the DP
group's collectives; tests hand them over by hand.

Per window, on every rank of a module's DP group, in this order:

    frame = round.read(batches, error)       # count; the window frame to all-gather (None: the gate
                                             #   backoff skips this window: no collective at all)
    texts = round.gathered(frames)           # frames: every rank's window frame [dp, words]; the
                                             #   text frame to all-gather when some rank's text was
                                             #   too long for its window frame, else None
    round.gathered_texts(text_frames)        # only when `gathered` asked for it
    outgoing = round.pack()                  # Outgoing (send buffer and splits), or None: nothing
                                             #   moves between ranks in this window
    out, report = round.finish(received)     # received: the all_to_all's receive buffer (None when
                                             #   nothing was sent)

and once, before the first window of a DP group larger than one, `round.agree(config_frames)` with
every rank's `round.config_frame()`. When the all_to_all fails, the driver calls
`round.verify_last()` before it re-raises: the self-check's comparison of the last checked window,
which `finish` makes after this window's launches, comes first (a corrupted window is the worse
news), as it does before the round's own errors. A bad input of any rank, found by `read`, travels in its frame;
`gathered` raises the same ReorderError on every rank. The round holds the rank's state between
windows: the agreed config, the gate backoff, the last planned layout.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from reorder.batch.checksum import Graphs, window_checksums
from reorder.batch.counting import count_samples
from reorder.batch.keepalive import current_stream
from reorder.batch.blocks import byte_fields, empty_shard, field_buffers, read_lists, resolved, unit_bytes
from reorder.batch.layout import (LayoutError, describe, field_at, first_difference, grid_thw_of, rebuild, unify,
                                  window_layout)
from reorder.exchange.executors import select_executor
from reorder.exchange.placement import Placement, place
from reorder.plan import wire
from reorder.plan.backoff import Backoff
from reorder.plan.checksums import CHECKED_FIELDS
from reorder.plan.cost import CostModel
from reorder.plan.counts import COLUMNS, SampleCounts
from reorder.plan.grid import Grid, check_micro_batch_size
from reorder.plan.moves import MoveList, build_moves
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
    def of(cls, plan: WindowPlan, *, sent_bytes: int, plan_ms: float, marks: list) -> "WindowReport":
        """The report of a planned window, from its plan and this rank's stage marks [(name, time)]."""
        return cls(slots=plan.slots, orders=plan.orders, loads_before=plan.loads_before, loads_after=plan.loads_after,
                   moved_samples=int(plan.moved.sum()), total_samples=plan.orders.size, moved_bytes=plan.moved_bytes,
                   sent_bytes=sent_bytes, plan_ms=plan_ms, exchange_ms=(time.perf_counter() - marks[0][1]) * 1e3,
                   stage_ms={n: (t - marks[i][1]) * 1e3 for i, (n, t) in enumerate(marks[1:])},
                   gated_slots=int(plan.gated.sum()), shadow=plan.shadow)


@dataclass(frozen=True, slots=True)
class Outgoing:
    """What this rank sends in the window's all_to_all: the uint8 send buffer on the placement's
    target, bytes per peer to send and to receive."""

    buffer: torch.Tensor
    send_splits: list
    recv_splits: list


@dataclass
class _Window:
    """This rank's window as read: its layout, per slot the shard and pickled list entries, and counts."""

    layout: object
    shards: list
    blobs: list
    counts: SampleCounts  # [W, B/dp]


@dataclass
class _Pending:
    """The window between `read` and `finish`."""

    batches: list
    marks: list  # [(stage, perf_counter)], from ("start", t0)
    window: _Window | None = None
    error: str | None = None
    signature: str = ""  # this rank's layout signature as sent ("" without a window)
    frames: np.ndarray | None = None
    layout: object = None
    fields: tuple = ()  # `byte_fields(layout)`
    plan: WindowPlan | None = None
    plan_ms: float = 0.0
    moves: MoveList | None = None
    placement: Placement | None = None
    sources: list | None = None
    outgoing: Outgoing | None = None
    skipped: bool = False
    checked: bool = False  # the self-check covers this window
    sent: torch.Tensor | None = None  # checked: this rank's sums of its held sources [W, B/dp, CHECKED_FIELDS], host
    sums: np.ndarray | None = None  # the last checked window's sums, sent in this window's frame
    last: "_Check | None" = None  # that window, compared once every rank's frames are here (`_verify_last`)
    made: dict | None = None  # output slot -> (its assembled buffers, their SampleCounts) (slots not kept): a checked part


def check_verify(verify) -> None:
    """Raise ValueError naming `verify` unless it is a schedule of the self-check: an int >= 0."""
    if isinstance(verify, bool) or not isinstance(verify, int) or verify < 0:
        raise ValueError(f"verify={verify!r} is invalid: 0 (off), 1 (every window) or N (every N-th window)")


class WindowRound:
    """The state of one rank of one module across windows, and the steps of a window (module
    docstring). Arguments: see `WindowExchanger`, which builds the round from its own."""

    def __init__(self, *, grid: Grid, micro_batch_size: int, cost: CostModel, balancer: str = "balanced",
                 window_size: int = 1, batch_dims: dict | None = None, device: torch.device | str | None = None,
                 profile_stages: bool = False, min_gain: float | None = None, min_saving: float | None = None,
                 shadow: bool = False, cross_slot: bool = False, early_copy: bool = False, gate_backoff: int = 0,
                 sample_costs=None, image_counts=None, verify: int = 0):
        check_micro_batch_size(micro_batch_size, grid.size)
        check_verify(verify)
        if isinstance(window_size, bool) or not isinstance(window_size, int) or window_size < 1:
            raise ValueError(f"window_size={window_size!r} is invalid: must be an integer >= 1")
        self.settings = PlanSettings(balancer=balancer, min_gain=min_gain, min_saving=min_saving,
                                     cross_slot=bool(cross_slot), shadow=bool(shadow),
                                     given_costs=sample_costs is not None)
        if gate_backoff and not self.settings.gated:
            raise ValueError(f"gate_backoff={gate_backoff} needs the cost-benefit gate: set min_gain or min_saving")
        self.grid, self.micro_batch_size, self.cost = grid, micro_batch_size, cost
        self.window_size, self.batch_dims = window_size, batch_dims
        self.sample_costs, self.image_counts = sample_costs, image_counts
        self.device = None if device is None else torch.device(device)
        self.profile_stages = profile_stages  # synchronize the device at stage boundaries (benchmarks only)
        self.early_copy = bool(early_copy)
        self.local_batch = micro_batch_size // grid.dp
        self.backoff = Backoff(gate_backoff)
        self.verify = verify
        self._sum_words = 2 * CHECKED_FIELDS if verify else 0  # per sample: the sender's sums, the receiver's
        self._sums_at = self._sum_index() if verify else None
        self._windows = 0  # windows read so far (planned or skipped): the self-check's schedule
        self._check = None  # the last checked window's sums, sent in the next window frame
        self.verified_windows = 0  # checked windows whose sums every rank compared and found equal
        self.verified_samples = 0  # their samples, module-wide (each compared field by field)
        self._graphs = Graphs()  # the checksum launches, captured (on CUDA): their sums are read a window later
        self._events = {}  # CUDA device -> the event after a checked window's sums (one waits at a time)
        self.agreed = grid.dp == 1  # the DP group's config frames matched (nothing to agree on alone)
        self._paths = None  # per-sample field paths of the last planned window (moved in skipped windows)
        self._executors = {}
        self._empty = {}  # device -> an empty uint8 tensor there
        self._now = None

    @property
    def skips_next(self) -> bool:
        """The next window will be skipped by the gate backoff (no collective, nothing to overlap)."""
        return self.backoff.skip > 0

    # ---- agreeing on the config (once) ------------------------------------------------------------

    def config(self) -> dict:
        """Every setting that must match across the DP group, by wire.CONFIG name."""
        c, s = self.cost, self.settings
        return dict(micro_batch_size=self.micro_batch_size, grid_size=self.grid.size, dp=self.grid.dp,
                    window_size=self.window_size, encoder_weight=c.encoder_weight, language_weight=c.language_weight,
                    encoder_quadratic_weight=c.encoder_quadratic_weight,
                    language_quadratic_weight=c.language_quadratic_weight, encoder_image_weight=c.encoder_image_weight,
                    spatial_merge_size=c.spatial_merge_size, image_token_id=c.image_token_id,
                    vision_start_token_id=c.vision_start_token_id, balancer=s.balancer, shadow=int(s.shadow),
                    cross_slot=int(s.cross_slot), min_gain=s.min_gain, min_saving=s.min_saving,
                    gate_backoff=self.backoff.cap, given_costs=int(s.given_costs),
                    given_image_counts=int(self.image_counts is not None), verify=self.verify)

    def config_frame(self) -> np.ndarray:
        """This rank's config frame (fixed size whatever the config)."""
        return wire.encode_config(self.config())

    def agree(self, frames: np.ndarray) -> None:
        """Check every rank's config frame [dp, CONFIG_WORDS]: ranks whose configs differ (even in
        what sizes the window frame) all raise the same ReorderError naming the field and each
        rank's value, instead of a mismatched collective later."""
        problem = wire.config_mismatch(np.asarray(frames))
        if problem is not None:
            raise ReorderError(problem)
        self.agreed = True

    # ---- the window's steps -----------------------------------------------------------------------

    def read(self, batches: list, error: BaseException | None = None) -> np.ndarray | None:
        """Count this rank's window (1..window_size micro-batches; an empty one marks the end of the
        stream) and return its window frame, or None when the gate backoff skips the window (then
        `finish(None)` hands the micro-batches back; a source error or an early end is raised here,
        on this rank only, as with reordering off). `error`: what the data source raised while this
        window was read; it travels like a validation error, so every rank raises it."""
        t0 = time.perf_counter()
        self._now = now = _Pending(list(batches), [("start", t0)])
        now.checked = bool(self.verify) and self._windows % self.verify == 0
        self._windows += 1
        if self.backoff.skip:  # no collective; a skip follows fully gated windows only, which move nothing
            return self._read_skipped(error)  # and so leave no checked window's sums waiting
        if error is not None:
            now.error = f"data source raised {type(error).__name__}: {error}"
        else:
            try:
                now.window = self._prepare(now.batches)
            except (ValueError, TypeError, KeyError, IndexError) as e:
                now.error = str(e)
        now.sums = self._check_words()
        now.last, self._check = self._check, None
        self._mark("prepare")
        window = now.window
        now.signature = "" if window is None else window.layout.signature()
        frame = np.zeros(wire.window_words(self.window_size, self.local_batch, len(COLUMNS), self._sum_words),
                         dtype=np.int64)
        counts = None if window is None else window.counts.table
        if counts is None and now.sums is not None:  # the sums of the last checked window still travel
            counts = np.zeros((0, self.local_batch, len(COLUMNS)), dtype=np.int64)
        return wire.encode_window(frame, error=now.error, slots=len(now.batches), layout=now.signature,
                                  counts=counts, sums=now.sums)

    def gathered(self, frames: np.ndarray) -> np.ndarray | None:
        """Take every rank's window frame [dp, words] (the all-gather of `read`'s). Returns the text
        frame to all-gather when some rank's error or layout did not fit its window frame (then
        call `gathered_texts`), else plans the window and returns None. Raises the same
        ReorderError on every rank for any rank's error, differing micro-batch counts or layouts."""
        now = self._now
        now.frames = np.asarray(frames)
        words = wire.long_text_words(now.frames)
        if words:
            return wire.encode_text(wire.window_text(now.error, now.signature), words)
        self._plan(None)
        return None

    def gathered_texts(self, text_frames: np.ndarray) -> None:
        """Take every rank's text frame (the all-gather of what `gathered` returned), then plan."""
        self._plan([wire.text_of(row) for row in np.asarray(text_frames)])

    def pack(self) -> Outgoing | None:
        """The send buffer and splits of this window's all_to_all, or None when no rank sends
        anything (every rank decides alike from the same plan: no collective then). An error is
        raised after the last checked window's comparison (`verify_last`)."""
        try:
            return self._packed()
        except Exception:
            self.verify_last()
            raise

    def verify_last(self) -> None:
        """Compare the last checked window's sums, which travelled in this window's frames, if they
        have not been (`finish` does, after this window's launches): the driver calls it before it
        raises an error of its own between `pack` and `finish` (a failed all_to_all), as the round
        does before its own errors, since a corrupted window is the worse news. Raises the
        self-check's ReorderError at the first mismatch, the same on every rank that calls it."""
        if self._now is not None:
            self._verify_last(self._now)

    def _packed(self) -> Outgoing | None:
        now = self._now
        if now.moves is None or not now.plan.moves_anything or self.grid.dp == 1:  # skipped, ended, shadow, natural
            return None
        moves, target = now.moves, now.placement.target
        send = torch.empty(sum(moves.send_splits), dtype=torch.uint8, device=target)
        self._executor(target).run(moves.pack, now.sources, [send], held=now.placement.held)
        now.outgoing = Outgoing(send, list(moves.send_splits), list(moves.recv_splits))
        self._mark("pack")
        return now.outgoing

    def finish(self, received: torch.Tensor | None) -> tuple[list, WindowReport | None]:
        """The window's micro-batches in canonical order (same structure as given) and its report;
        ([], None) at the end of the stream. received: the all_to_all's receive buffer (None when
        `pack` returned None)."""
        now, self._now = self._now, None
        if now.skipped:
            return self._finish_skipped(now)
        try:
            done = self._finished(now, received)
        except Exception:
            self._verify_last(now)  # a corrupted window is the worse news: its error first
            raise
        # after this window's own launches: on CUDA the host compares while the device sums
        self._verify_last(now)
        return done

    def _finished(self, now: _Pending, received: torch.Tensor | None) -> tuple[list, WindowReport | None]:
        """`finish` of a window that is not skipped."""
        if now.window is None:
            return [], None
        plan, layout = now.plan, now.layout
        if plan.shadow:
            return now.batches, WindowReport.of(plan, sent_bytes=0, plan_ms=now.plan_ms, marks=now.marks)
        if plan.natural:  # nothing to move or permute anywhere: no move list, no buffers
            dev = self._target(now.window)
            out = [self._kept(b, layout, shard, dev) for b, shard in zip(now.batches, now.window.shards)]
            for stage in ("pack", "all_to_all", "assemble"):
                self._mark(stage, now)
            return out, WindowReport.of(plan, sent_bytes=0, plan_ms=now.plan_ms, marks=now.marks)
        if now.outgoing is None:
            self._mark("pack", now)
        want = sum(now.moves.recv_splits)
        if received is None:
            received = self._nothing_received(now.placement.target)
        elif len(received) != want:
            raise ReorderError(f"rank {self.grid.rank} received {len(received)} bytes, expected {want}")
        self._mark("all_to_all", now)
        out = self._assemble(now, [received] + now.sources)
        self._mark("assemble", now)
        sent = 0 if now.outgoing is None else len(now.outgoing.buffer)
        return out, WindowReport.of(plan, sent_bytes=sent, plan_ms=now.plan_ms, marks=now.marks)

    # ---- reading ----------------------------------------------------------------------------------

    def _mark(self, stage: str, now: _Pending | None = None) -> None:
        if self.profile_stages and self.device is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        (now or self._now).marks.append((stage, time.perf_counter()))

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
        (placeholders, real, images, sq), grid_thw = count_samples(self.cost, ids, batch.get("attention_mask"),
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

    # ---- planning ---------------------------------------------------------------------------------

    def _plan(self, texts: list | None) -> None:
        """Every rank's frames (and whole texts) → the same error everywhere, or this rank's plan,
        move list, placement and sources. An error is raised after the last checked window's
        comparison (`verify_last`): a corrupted window is the worse news."""
        try:
            self._planned(texts)
        except Exception:
            self.verify_last()
            raise

    def _planned(self, texts: list | None) -> None:
        now = self._now
        problem, signatures = wire.window_problem(now.frames, texts)
        if problem is not None:
            raise ReorderError(problem)
        self._mark("gather")
        if now.window is None:
            return
        slots = len(now.batches)
        counts = SampleCounts(wire.counts_of(now.frames, slots, self.local_batch, len(COLUMNS), self._sum_words))
        now.layout = layout = self._group_layout(now.window.layout, signatures)
        t_plan = time.perf_counter()
        now.plan = plan = plan_window(counts, self.cost, self.grid, self.settings, unit_bytes(layout))
        self.backoff, self._paths = self.backoff.planned(plan.fully_gated), _paths(layout)
        now.plan_ms = (time.perf_counter() - t_plan) * 1e3
        self._mark("plan")
        if plan.shadow or plan.natural:
            return
        now.fields = byte_fields(layout)
        now.moves = build_moves(now.fields, counts, plan, self.grid.rank)
        bufs = [field_buffers(layout, shard, blobs) for shard, blobs in zip(now.window.shards, now.window.blobs)]
        now.placement, now.sources = self._sources(now.window, [t for b in bufs for t in b])
        if now.checked:  # before the executor's kernels read the same sources (on the same stream)
            now.sent = self._sent_sums(now)

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

    # ---- moving the bytes -------------------------------------------------------------------------

    def _target(self, window: _Window) -> torch.device:
        """Where the reordered micro-batches go: `device`, else where input_ids lives."""
        return resolved(self.device) or window.shards[0].dense[("input_ids",)].device

    def _executor(self, device):
        ex = self._executors.get(device)
        if ex is None:
            ex = self._executors[device] = select_executor(device)
        return ex

    def _sources(self, window: _Window, bufs: list) -> tuple[Placement, list]:
        """The window's placement and this rank's buffers `bufs` ([slot * F + field], `field_buffers`
        of each slot), readable by the executor on the target device (the others, e.g. host buffers
        that are not pinned, are moved there whole, by DMA)."""
        dev = self._target(window)
        executor = self._executor(dev)
        reads_pinned = getattr(executor, "reads_pinned_host", False)
        placement = place(dev, [(t.device, reads_pinned and t.device.type == "cpu" and t.is_pinned()) for t in bufs],
                          executor=executor.name, reads_pinned_host=reads_pinned)
        return placement, [t if direct else t.to(dev, non_blocking=True) for t, direct in zip(bufs, placement.direct)]

    def _nothing_received(self, device) -> torch.Tensor:
        """An empty receive buffer on `device` (made once per device; the assemble table reads
        nothing from it)."""
        t = self._empty.get(device)
        if t is None:
            t = self._empty[device] = torch.empty(0, dtype=torch.uint8, device=device)
        return t

    def _assemble(self, now: _Pending, buffers) -> list:
        """The output micro-batches: slots that are this rank's own, in order, stay as they are (moved
        to `device` as reorder off would); the others are allocated field by field and written. A
        checked window's sums are launched right behind the writes, before the outputs are rebuilt:
        the device sums while the host rebuilds (on CUDA), and its read ends that much sooner."""
        layout, window, moves, dev = now.layout, now.window, now.moves, now.placement.target
        out = list(now.batches)
        for s in np.flatnonzero(moves.kept).tolist():  # the others are written into new tensors below
            out[s] = self._kept(now.batches[s], layout, window.shards[s], dev)
        todo = np.flatnonzero(~moves.kept).tolist()
        made = []
        if todo:
            counts = [SampleCounts(moves.out_counts.table[s]) for s in todo]
            made = [empty_shard(layout, c, dev) for c in counts]
            now.made = {s: (bufs, c) for s, (_, bufs), c in zip(todo, made, counts)}
            self._executor(dev).run(moves.assemble, buffers, [t for _, bufs in made for t in bufs],
                                    held=(False,) + now.placement.held)  # buffers: the received one, then the sources
            if layout.lists:  # a wait for the device: before the sums' launch, which it would wait for too
                for c, (shard, bufs) in zip(counts, made):
                    read_lists(shard, bufs[-1], c)
        if now.checked:
            self._check = self._checked(now)
        for s, (shard, _) in zip(todo, made):
            out[s] = rebuild(now.batches[s], layout, shard)
        return out

    def _kept(self, batch, layout, shard, dev):
        """A micro-batch this rank keeps as it is: as given, or, with `device`, its per-sample
        fields there as reorder off would move them (with early_copy: the copies made at counting)."""
        if self.device is None:
            return batch
        return rebuild(batch, layout, shard) if self.early_copy else _fields_to(batch, self._paths, dev)

    # ---- the self-check ---------------------------------------------------------------------------

    def _sent_sums(self, now: _Pending) -> torch.Tensor | None:
        """int64 [W, B/dp, CHECKED_FIELDS] on their way to the host (`_checked` records the event
        after which they are there; nothing waits), or None when no source is `held`: this rank's
        checksums of the sources that the executor's kernels read in place from host memory (the
        placement's `held`), the other fields left out. These are read now, by their own launch (on
        CUDA one kernel for the window), which holds them until it is done, before the executor
        reads them: a reader of the same host memory whose hold is missing then reads bytes that
        differ from the summed ones, and the check sees it. Read later, under the checksum's own
        hold, they would be kept alive for that reader too, and its defect hidden. The sources on
        the device are summed with what this rank assembled, in `_checked`'s launch."""
        parts = self._sender_parts(now, held=True)
        if parts is None:
            return None
        # placed: `_sources` left every source on the target or in pinned memory the executor reads in
        # place, contiguous (`field_buffers`), and the outputs are made on the target
        return window_checksums(parts, now.fields, now.placement.target, host=True, graphs=self._graphs,
                                placed=True).reshape(len(parts), -1, CHECKED_FIELDS)

    def _sender_parts(self, now: _Pending, *, held: bool) -> list | None:
        """Per slot (its sources whose placement `held` is `held`, None for the others; its
        SampleCounts), or None when no source is."""
        nf, which = len(now.fields), now.placement.held
        if held not in which:
            return None
        table, sources = now.window.counts.table, now.sources
        if (not held) not in which:  # every source is: the slots' sources as they are
            return [(sources[s * nf:(s + 1) * nf], SampleCounts(table[s])) for s in range(len(table))]
        return [([t if h == held else None for t, h in zip(sources[s * nf:(s + 1) * nf], which[s * nf:(s + 1) * nf])],
                 SampleCounts(table[s])) for s in range(len(table))]

    def _checked(self, now: _Pending) -> "_Check":
        """The checked window's sums, both sides, on their way to the host (read at the next `read`,
        without a wait of their own by then: the device has long passed them): what this rank read
        of the sources that are not `held`, then what it assembled, and `now.sent` (the held ones),
        all but `now.sent` summed in one call (on CUDA one kernel launch). A kept slot with no held
        source is summed once: what it hands out are its sources, which the same call reads as the
        sender's, so its assembled sums are those."""
        dev, nf, held = now.placement.target, len(now.fields), now.placement.held
        late = self._sender_parts(now, held=False)  # per slot, or None when every source is held
        first = 0 if late is None else len(late)
        parts, rows = late or [], []  # the late parts, then the assembled ones; rows: per slot, its assembled sums' part
        for s, kept in enumerate(now.moves.kept.tolist()):
            if not kept:
                rows.append(len(parts))
                parts.append(now.made[s])
            elif late is not None and not any(held[s * nf:(s + 1) * nf]):
                rows.append(s)  # its late part: nothing of it is held
            else:
                rows.append(len(parts))
                parts.append((now.sources[s * nf:(s + 1) * nf], SampleCounts(now.window.counts.table[s])))
        sums = window_checksums(parts, now.fields, dev, host=True, graphs=self._graphs, placed=True)
        # one event for every copy to the host: the window's steps run on one thread, and so on one
        # stream of the target device
        return _Check(window=self._windows - 1, orders=now.plan.orders[:len(rows)], cross=now.plan.cross_slot,
                      layout=now.layout, held=now.sent, late=first,
                      sums=sums.reshape(-1, self.local_batch, CHECKED_FIELDS), rows=rows,
                      event=self._recorded(dev) if dev.type == "cuda" else None)

    def _check_words(self) -> np.ndarray | None:
        """int64 [W, B/dp, 2 * CHECKED_FIELDS] of the last checked window (the sender's sums, then the
        receiver's) for this window's frame, or None when no checked window waits."""
        check = self._check
        if check is None:
            return None
        if check.event is not None:
            check.event.synchronize()
        late = check.sums[:check.late] if check.late else None
        sent = late if check.held is None else check.held if late is None else late + check.held  # wraps, as the sums
        return np.concatenate([sent, check.sums[check.rows]], axis=-1)

    def _verify_last(self, now: _Pending) -> None:
        """Compare the last checked window's sums, which travelled in `now`'s frames (once: at
        `finish`, after this window's launches, or before an error of this window's is raised):
        the same ReorderError on every rank at the first mismatch, else the window and its samples
        are counted as verified."""
        check, now.last = now.last, None
        if check is None:
            return
        failed = self._compared(check, now.frames)
        if failed is not None:
            raise ReorderError(failed)
        self.verified_windows += 1
        self.verified_samples += check.orders.size

    def _compared(self, check: "_Check", frames: np.ndarray) -> str | None:
        """Every rank's sums of `check`'s window, from the gathered frames: every rank compares what
        each rank assembled with what its senders read, alike, so the error text (the first
        mismatch, else None) is the same on every rank."""
        b, f = self.local_batch, CHECKED_FIELDS
        sent_at, got_at, first = self._sums_at
        w = len(check.orders)
        flat = frames.ravel()
        ids = check.orders if check.cross else check.orders + first[:w]  # flat natural ids (slot * B + j)
        # [W, B, F]: at output position p, the receiver's sums and the sender's of its natural sample
        got, want = flat[got_at[:w]], flat[sent_at[ids]]
        if (got == want).all():
            return None
        bad = np.argwhere(got != want)
        s, p, slot = (int(x) for x in bad[0])
        source, i = divmod(int(ids[s, p]), self.micro_batch_size)
        names = _field_names(check.layout)
        field = names[slot] if slot < f - 1 else "one of " + ", ".join(names[slot:])
        sample = f"micro-batch {source}, natural position {i}" if check.cross else f"natural position {i}"
        return (f"self-check failed: window {check.window}, micro-batch {s}: rank {p // b} holds at position {p % b} "
                f"the sample of {sample} (read by rank {i // b}), and it differs in field {field!r} from "
                f"what rank {i // b} read ({len(bad)} (sample, field) checksum(s) differ)")

    def _sum_index(self) -> tuple:
        """Where the gathered window frames [dp, words], flattened, hold each sample's sums: (the
        sender's, [window_size * B, F], natural position s * B + i of slot s at row s * B + i; the
        receiver's, [window_size, B, F], output position p of each slot; s * B per slot s,
        [window_size, 1]). Fixed by the config: made once."""
        shape = (self.grid.dp, wire.window_words(self.window_size, self.local_batch, len(COLUMNS), self._sum_words))
        at = wire.sums_of(np.arange(shape[0] * shape[1]).reshape(shape), self.window_size, self.local_batch,
                          len(COLUMNS), self._sum_words)
        b = self.micro_batch_size
        return (at[..., :CHECKED_FIELDS].reshape(-1, CHECKED_FIELDS), at[..., CHECKED_FIELDS:],
                np.arange(0, self.window_size * b, b)[:, None])

    def _recorded(self, device: torch.device):
        """The round's event on `device`, recorded on its current stream (after the work enqueued there
        so far). One event a device serves every window: the next window waits for it (`_check_words`)
        before it is recorded again."""
        event = self._events.get(device)
        if event is None:
            event = self._events[device] = torch.cuda.Event()
        event.record(current_stream(device))
        return event

    # ---- windows the gate backoff skips -----------------------------------------------------------

    def _read_skipped(self, error):
        if error is not None:
            raise ReorderError(f"reorder failed on rank {self.grid.rank}: data source raised "
                               f"{type(error).__name__}: {error}")
        self._now.skipped = True
        return None

    def _finish_skipped(self, now: _Pending):
        """A window the gate backoff skips: the micro-batches in natural order, per-sample fields (the
        last planned window's layout) on `device` (as given in shadow mode)."""
        batches = now.batches
        if not batches:
            return [], None
        self.backoff = self.backoff.skipped()
        dev = resolved(self.device)
        out = batches if dev is None or self.settings.shadow else [_fields_to(b, self._paths, dev) for b in batches]
        w, nan = len(batches), np.full((len(batches), self.grid.dp), np.nan)
        return out, WindowReport(slots=w, orders=np.tile(np.arange(self.micro_batch_size), (w, 1)), loads_before=nan,
                                 loads_after=nan, moved_samples=0, total_samples=w * self.micro_batch_size,
                                 moved_bytes=0, sent_bytes=0, plan_ms=0.0,
                                 exchange_ms=(time.perf_counter() - now.marks[0][1]) * 1e3, gated_slots=w,
                                 shadow=self.settings.shadow, skipped=True)


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


@dataclass(slots=True)
class _Check:
    """A checked window whose sums wait for the next window frame: its window number, canonical
    orders [W, B] (flat natural ids when `cross`: a cross-slot plan's) and layout (the field names
    of an error); `sums`, host [parts, B/dp, CHECKED_FIELDS], the call's: first `late` parts, per
    slot the sender's sums of its sources that are not held (late 0: every source is held), then the
    assembled parts; `held`, the sender's sums of its held sources [W, B/dp, CHECKED_FIELDS] (None
    when none is), added to the late ones; `rows`, per slot, the part holding its assembled sums;
    the event after which the sums are readable (None when no device wrote them). `sums` may be a
    view of a captured launch's block (`Graphs`), valid until the next window's launches: it is read
    at the next `read`, and the comparison reads the gathered frames only."""

    window: int
    orders: np.ndarray
    cross: bool
    layout: object
    held: np.ndarray | None
    late: int
    sums: np.ndarray
    rows: list
    event: object


def _field_names(layout) -> list:
    """The byte fields' names in `byte_fields` order ('/'-joined paths; 'per-sample lists')."""
    return ["/".join(p) for p in _paths(layout)] + (["per-sample lists"] if layout.lists else [])


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
