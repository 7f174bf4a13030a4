"""ReorderingBuffer: wraps a rank's micro-batch iterator and yields reordered micro-batches.

Reads windows of W micro-batches (a short last window when the source ends), exchanges each
window with one WindowExchanger call, and yields its micro-batches in order. At the end every rank
passes one empty window together so an early-ending rank makes all ranks raise instead of hang.

overlap=True prepares the next window on a background thread: its own CUDA stream (and
`torch.cuda.set_device` in the thread: the exchanger's device, or, given as "cuda" without an index,
the consumer thread's current device when the worker starts), its own process groups (the exchanger
passed in must use them), at most `ahead` windows queued or being prepared beyond the one being
consumed (default 1: the worker starts window k+1 when the consumer takes the last micro-batch of
window k, so the device holds that micro-batch plus one window in flight or queued, and the exchange
hides behind that micro-batch's step; ahead=2 also prepares k+2 while k+1 waits, which absorbs
jitter at the cost of one more window resident), `record_stream` + an event wait on the consumer
side, worker exceptions re-raised on the consumer's next `next()`, and a thread that ends on its own
when the source is exhausted or on `close()` / context-manager exit. Windows the gate backoff skips
have nothing to overlap: the worker hands each run of them to the consumer, which reads and passes
them through itself (a thread hand-off per window costs more than the window, and the training
thread would lose the GIL to the worker for it), then resumes the worker for the next planned window
while it consumes the last one.

Checkpoints: `state_dict()` / `load_state_dict()` (torch.distributed.checkpoint's Stateful protocol)
count the micro-batches served to the caller; a source given as a factory `consumed_samples ->
iterable` is built at the first `next()`, at the resume point (`_Consumption`).
"""

from __future__ import annotations

import contextlib
import logging
import numbers
import os
import queue
import threading
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, fields

import torch

from reorder.batch.blocks import resolved
from reorder.batch.checksum import uncaptured_here
from reorder.batch.layout import tensors
from reorder.exchange.exchanger import WindowExchanger, WindowReport

log = logging.getLogger("reorder")
_END = object()
_INLINE = object()  # queued by the worker: the consumer exchanges the coming run of skipped windows itself


def check_overlap_allowed(device) -> None:
    """Refuse overlap where a second communicator on another thread can deadlock (docs/design.md, Overlap)."""
    if device is not None and torch.device(device).type == "cuda" and \
            os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1":
        raise ValueError("megatron_mimo_reorder_overlap=True with CUDA_DEVICE_MAX_CONNECTIONS=1: collectives "
                         "issued from the overlap thread on a second NCCL communicator can be ordered "
                         "differently on each rank and deadlock; set megatron_mimo_reorder_overlap=False "
                         "(--no-overlap-intra-microbatch-reorder) or unset CUDA_DEVICE_MAX_CONNECTIONS")


def _is_factory(source) -> bool:
    """A source given as `consumed_samples -> iterable` rather than as an iterable."""
    return callable(source) and not hasattr(source, "__iter__") and not hasattr(source, "__next__")


class _Deferred:
    """The source a factory builds, on its first read: at the resume point, if any."""

    def __init__(self, factory, owner):
        self._factory, self._owner, self._it = factory, owner, None

    def __iter__(self):
        return self

    def __next__(self):
        if self._it is None:
            self._it = iter(self._factory(self._owner._start_samples))
        return next(self._it)


class _Consumption:
    """What training consumed, as a checkpoint: the micro-batches served to the caller by `next()`,
    never those read from the source (a DataLoader with workers, and the overlap thread, read ahead).

    `state_dict()` / `load_state_dict()` follow the Stateful protocol of torch.distributed.checkpoint,
    so the buffer can sit in the state dict handed to `dcp.save` / `dcp.load`. The state is global
    (the same on every rank of every module at a step boundary): the consumed micro-batches, B, and
    consumed_samples = consumed micro-batches x B.

    Resuming needs the source as a factory: `consumed_samples -> iterable` of this rank's micro-batches
    from that many consumed global samples on (e.g. a DataLoader whose CanonicalBatchSampler is built
    with `consumed_samples=`). It is called at the first `next()`, after `load_state_dict`, with the
    start of the window the checkpoint fell in (a multiple of W micro-batches); the buffer exchanges
    that window again and drops the micro-batches consumed before the checkpoint, so every window,
    and every plan, is the continuous run's. One exception: the gate backoff's schedule (which windows
    it skips) starts afresh, so with gate_backoff > 0 a micro-batch after the resume point may be planned
    where the continuous run kept it natural, or the reverse (the same samples either way).
    """

    def _consumption(self, source, micro_batch_size: int, window_size: int):
        self.consumed_micro_batches = 0
        self.micro_batch_size = micro_batch_size
        self._resume_window = window_size
        self._start_samples = 0  # where the factory builds the source
        self._discard = 0  # micro-batches of the first window consumed before the checkpoint
        self._begun = False
        self._factory = source if _is_factory(source) else None
        return iter(source) if self._factory is None else _Deferred(source, self)

    @property
    def consumed_samples(self) -> int:
        """Global samples consumed: what a sampler built for the rest of the run takes."""
        return self.consumed_micro_batches * self.micro_batch_size

    def state_dict(self) -> dict:
        return {"consumed_micro_batches": self.consumed_micro_batches, "consumed_samples": self.consumed_samples,
                "micro_batch_size": self.micro_batch_size}

    def load_state_dict(self, state) -> None:
        """Resume where `state` (a `state_dict()`) was taken; only before the first `next()`. The
        source must be a factory (an iterator cannot be repositioned) unless nothing was consumed."""
        if self._begun:
            raise RuntimeError("load_state_dict after iteration started: call it before the first next(), so "
                               "the source is built at the resume point")
        if not isinstance(state, Mapping) or "consumed_micro_batches" not in state:
            raise ValueError(f"state {state!r} has no 'consumed_micro_batches': give what state_dict() returned")
        n, b = state["consumed_micro_batches"], state.get("micro_batch_size", self.micro_batch_size)
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 0:
            raise ValueError(f"consumed_micro_batches={n!r} in the state: must be an integer >= 0")
        if b != self.micro_batch_size:
            raise ValueError(f"micro_batch_size={b!r} in the state does not match this run's micro_batch_size="
                             f"{self.micro_batch_size}: every global micro-batch would hold other samples")
        if state.get("consumed_samples", n * b) != n * b:
            raise ValueError(f"consumed_samples={state['consumed_samples']!r} in the state is not "
                             f"consumed_micro_batches x micro_batch_size = {n * b}")
        if n and self._factory is None:
            raise ValueError(f"cannot resume after {n} consumed micro-batches from an iterator, which cannot be "
                             "repositioned: give the source as a factory `consumed_samples -> iterable` (e.g. "
                             "building the sampler with consumed_samples=...) instead of an iterator")
        n = int(n)
        start = n // self._resume_window * self._resume_window
        self.consumed_micro_batches, self._discard, self._start_samples = n, n - start, start * b

    def _begin(self):
        self._begun = True

    def __next__(self):
        if not self._begun:
            self._begin()
        while self._discard:
            self._next_micro_batch()  # consumed before the checkpoint: exchanged again, not served
            self._discard -= 1
        mb = self._next_micro_batch()
        self.consumed_micro_batches += 1
        return mb


class ReorderingBuffer(_Consumption):
    """Iterator of reordered micro-batches over `source` (this rank's micro-batch iterator, or a
    factory `consumed_samples -> iterable` that a resume rebuilds it with: see `load_state_dict`).

    exchanger: this rank's WindowExchanger (window size W = exchanger.window_size); with overlap it
    must be bound to the side process groups and is used only by the worker thread.
    log_every: log a metrics line every N windows (0 = never) to the logger "reorder" (INFO), on DP
    rank 0 only unless log_all_ranks; the line names `log_module` (the module) and the DP rank.
    `reports` keeps the last 1000 WindowReports; `last_report` the newest. `verified_windows` and
    `verified_samples`: what the runtime self-check found intact so far (the exchanger's).
    calibration: a `reorder.runtime.calibration.Calibration` to attach before any window is exchanged
    (see `calibrate`); the reports are then CalibratedWindowReports.
    """

    def __init__(self, source, exchanger: WindowExchanger, *, overlap: bool = False, log_every: int = 0,
                 get_timeout: float = 1.0, ahead: int = 1, log_module: str | None = None,
                 log_all_ranks: bool = False, calibration=None):
        if isinstance(ahead, bool) or not isinstance(ahead, int) or ahead < 1:
            raise ValueError(f"ahead={ahead!r} is invalid: windows prepared ahead of the consumer must be an integer >= 1")
        self._source = self._consumption(source, exchanger.micro_batch_size, exchanger.window_size)
        self._ex = exchanger
        self.ahead = ahead
        self._ready: deque = deque()
        self.reports: deque = deque(maxlen=1000)
        self.log_every = log_every
        self.log_module, self.log_all_ranks = log_module, log_all_ranks
        self._done = False
        self._windows = 0
        self._thread = None
        self._get_timeout = get_timeout
        self.overlap = overlap
        self._inline = False  # the consumer is exchanging a run of skipped windows itself
        self._from_worker = False  # the ready micro-batches came from the worker (their slot is released)
        self.calibration = None  # reorder.runtime.calibration.Calibration, set by `calibrate`
        self._serving = (-1, 0)  # (window, slots) of the ready micro-batches
        if calibration is not None:
            self._attach(calibration)
        if overlap:
            check_overlap_allowed(exchanger.device)
            self._queue: queue.Queue = queue.Queue()
            self._slots = threading.Semaphore(ahead)  # one per window queued or being prepared
            self._stop = threading.Event()
            self._inline_done = threading.Event()  # the consumer has exchanged the run of skipped windows
            if self._factory is None:  # a factory's source is built at the first next(), after any resume
                self._start_worker()

    # ---- shared ----------------------------------------------------------------------------

    def _read_window(self):
        """(micro-batches, error): up to W micro-batches, or the exception the source raised."""
        window = []
        for _ in range(self._ex.window_size):
            try:
                window.append(next(self._source))
            except StopIteration:
                break
            except Exception as e:  # noqa: BLE001 - shared with the DP group, then raised everywhere
                return window, e
        return window, None

    def _exchange(self, window, error):
        """One window's exchange; first, on every rank alike, the calibration's fit (when one is due),
        whose new cost model the round plans this window and the next ones with. With a calibration
        the report is a CalibratedWindowReport carrying that fit's report (None without a fit)."""
        cal = self.calibration
        if cal is None:
            return self._ex.exchange(window, error)
        fits = len(cal.reports)
        cost = cal.before_window(self._ex.round.cost)
        if cost is not None:
            self._ex.round.cost = cost
        out, report = self._ex.exchange(window, error)
        if report is not None:
            report = CalibratedWindowReport.of(report, cal.reports[-1] if len(cal.reports) > fits else None,
                                               cal.active_since)
        return out, report

    def calibrate(self, calibration) -> None:
        """Attach a `reorder.runtime.calibration.Calibration` before any window is exchanged: before
        the first next(), and, with overlap over an iterator (whose worker starts in the constructor),
        through the constructor's `calibration=` instead. Every rank must count the same windows from
        the first, or their fits would gather at different windows and hang."""
        if self._begun or self._thread is not None:
            raise RuntimeError("calibrate after windows may have been exchanged: attach the calibration before the "
                               "first next(); with overlap over an iterator the worker starts in the constructor, "
                               "so pass ReorderingBuffer(..., calibration=...) instead")
        self._attach(calibration)

    def _attach(self, calibration) -> None:
        """Its lag follows this buffer (1 window, ahead + 1 with overlap, one more on CUDA)."""
        cuda = self._ex.device is not None and self._ex.device.type == "cuda"
        calibration.lag = (self.ahead + 1 if self.overlap else 1) + int(cuda)
        self.calibration = calibration

    def __next__(self):
        mb = super().__next__()
        if self.calibration is not None:
            window, slots = self._serving
            self.calibration.served(window, slots - len(self._ready) - 1, mb)
        return mb

    def timed_step(self):
        """`with buf.timed_step():` around forward + backward of the micro-batch just taken: its time
        and features feed the calibration (a no-op context without one)."""
        if self.calibration is None:
            return contextlib.nullcontext()
        return self.calibration.timed_step(self._ex.round.cost)

    def record_step_ms(self, ms) -> bool:
        """The measured step time (ms) of the micro-batch just taken; False when refused or not calibrating."""
        return False if self.calibration is None else self.calibration.record_step_ms(ms, self._ex.round.cost)

    def _record(self, report: WindowReport | None):
        if report is None:
            return
        self.reports.append(report)
        self._windows += 1
        self._serving = (self._windows - 1, report.slots)
        if self.log_every and self._windows % self.log_every == 0 and (self.log_all_ranks or self._ex.grid.rank == 0):
            fit = getattr(report, "calibration", None)
            log.info("%sdp rank %d of %d, window %d: spread %.3f -> %.3f, moved %d/%d samples (%.1f MiB), "
                     "plan %.2f ms, exchange %.2f ms%s%s", f"{self.log_module} " if self.log_module else "",
                     self._ex.grid.rank, self._ex.grid.dp, self._windows, report.spread_before,
                     report.spread_after, report.moved_samples, report.total_samples, report.moved_bytes / 2**20,
                     report.plan_ms, report.exchange_ms,
                     f"; self-check: {self._ex.verified_windows} windows ({self._ex.verified_samples} samples) intact"
                     if self._ex.verify else "",
                     "" if fit is None else f"; calibration: {fit.reason} (R^2 {fit.r2:.3f}, predicted spread "
                                            f"{fit.predicted_spread_current:.3f} -> {fit.predicted_spread_fit:.3f})")

    @property
    def last_report(self) -> WindowReport | None:
        return self.reports[-1] if self.reports else None

    verified_windows = property(lambda self: self._ex.verified_windows, doc=WindowExchanger.verified_windows.__doc__)
    verified_samples = property(lambda self: self._ex.verified_samples, doc=WindowExchanger.verified_samples.__doc__)

    def __iter__(self):
        return self

    def _begin(self):
        super()._begin()
        if self.overlap and self._thread is None and not self._done:
            self._start_worker()

    def _start_worker(self):
        # a CUDA device without an index is the current device of this thread, the consumer's: the
        # worker's own is torch's default until it sets this one
        device = resolved(self._ex.device)
        self._thread = threading.Thread(target=self._worker, args=(device,), name="reorder-overlap", daemon=True)
        self._thread.start()

    def _next_micro_batch(self):
        if self._ready:
            return self._take()
        if self._done:
            raise StopIteration
        if self.overlap:
            return self._exchange_inline() if self._inline else self._next_overlap()
        window, error = self._read_window()
        try:
            out, report = self._exchange(window, error)
        except BaseException:
            self._done = True
            raise
        if not window:
            self._done = True
            raise StopIteration
        self._record(report)
        self._ready.extend(out)
        return self._ready.popleft()

    def _take(self):
        """The next ready micro-batch; with overlap, taking a window's last one lets the worker start
        the next window (its memory is then one micro-batch in use plus one window in flight)."""
        mb = self._ready.popleft()
        if self.overlap and not self._ready and self._from_worker:
            self._slots.release()
        return mb

    # ---- overlap ---------------------------------------------------------------------------

    def _put(self, item) -> bool:
        if self._stop.is_set():
            return False
        self._queue.put(item)
        return True

    def _worker(self, device):
        cuda = device is not None and device.type == "cuda"
        uncaptured_here()  # beside the consumer's steps, which may synchronize the device
        try:
            if cuda:
                torch.cuda.set_device(device)
                stream = torch.cuda.Stream(device)
            ctx = torch.cuda.stream(stream) if cuda else contextlib.nullcontext()
            with ctx:
                while not self._stop.is_set():
                    if not self._slots.acquire(timeout=0.1):  # the consumer has not taken enough yet
                        continue
                    if not self._prepare_one(stream if cuda else None):
                        return
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            self._put(e)

    def _prepare_one(self, stream) -> bool:
        """Exchange one window on the worker and queue it; False when the worker is done. Its
        micro-batches are referenced only by the queue once this returns (never kept by the worker
        while it prepares the next window)."""
        if self._ex.skips_next:  # the consumer takes the run; wait until it has (it reads the source)
            self._inline_done.clear()
            if not self._put(_INLINE):
                return False
            while not self._inline_done.wait(0.1):
                if self._stop.is_set():
                    return False
            return not self._stop.is_set()
        window, error = self._read_window()
        out, report = self._exchange(window, error)
        if not window:
            self._put(_END)
            return False
        event = None
        if stream is not None:
            event = torch.cuda.Event()
            event.record(stream)
        return self._put((out, report, event))

    def _next_overlap(self):
        while True:
            try:
                item = self._queue.get(timeout=self._get_timeout)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    self._done = True
                    raise RuntimeError("reorder overlap worker ended without a result") from None
        if item is _END:
            self._finish()
            raise StopIteration
        if isinstance(item, BaseException):
            self._finish()
            raise item
        if item is _INLINE:
            self._inline = True
            return self._exchange_inline()
        out, report, event = item
        if event is not None:
            current = torch.cuda.current_stream()
            current.wait_event(event)
            for t in tensors(out):
                if t.is_cuda:
                    t.record_stream(current)
        self._from_worker = True
        self._record(report)
        self._ready.extend(out)
        return self._take()

    def _exchange_inline(self):
        """Read and exchange a window the gate backoff skips, on the consumer's thread and stream;
        after the run's last one, hand the worker its slot back for the next planned window."""
        try:
            window, error = self._read_window()
            out, report = self._exchange(window, error)
        except BaseException:
            self._finish()
            raise
        if not window:
            self._finish()
            raise StopIteration
        if not self._ex.skips_next:  # the run ends: the worker prepares the next window meanwhile
            self._inline = False
            self._inline_done.set()
            self._slots.release()
        self._from_worker = False
        self._record(report)
        self._ready.extend(out)
        return self._take()

    def _finish(self):
        """The stream ended or failed: stop the worker (wherever it waits) and wait for it."""
        self._done = True
        self._stop.set()
        self._inline_done.set()
        self._thread.join()

    def close(self, timeout: float = 30.0) -> None:
        """Stop the worker (if any) and wait for it; no thread outlives this call unless it is stuck
        in a collective, which then ends at the process group's timeout."""
        self._done = True
        if self._thread is not None:
            self._stop.set()
            with contextlib.suppress(queue.Empty):
                while True:
                    self._queue.get_nowait()
            self._thread.join(timeout)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @property
    def worker_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()


@dataclass(frozen=True, slots=True, kw_only=True)
class CalibratedWindowReport(WindowReport):
    """A WindowReport of a buffer that calibrates its cost model: `calibration` is the fit made right
    before this window's exchange (a `reorder.runtime.calibration.CalibrationReport`: weights, R^2,
    predicted and measured spreads, the decision, a completed switch outcome), None where no fit was
    due; `calibrated_since` the window the cost weights this window was planned with hold since (0:
    the configured ones)."""

    calibration: object = None
    calibrated_since: int = 0

    @classmethod
    def of(cls, report: WindowReport, calibration, since: int) -> "CalibratedWindowReport":
        return cls(**{f.name: getattr(report, f.name) for f in fields(report)}, calibration=calibration,
                   calibrated_since=since)


class PassThroughBuffer(_Consumption):
    """What `reorder.integrations.megatron.wrap` returns with reordering off: the source's micro-batches
    unchanged, behind the interface of ReorderingBuffer (iterator, context manager, `close()`,
    `reports` (always empty), `last_report` (None), `verified_windows` and `verified_samples` (0),
    `state_dict` / `load_state_dict`), so a training
    loop holds one type either way. micro_batch_size: B, for `consumed_samples`."""

    overlap = False
    worker_alive = False
    verified_windows = verified_samples = 0  # no self-check without reordering

    def __init__(self, source, *, micro_batch_size: int):
        if isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, int) or micro_batch_size < 1:
            raise ValueError(f"micro_batch_size={micro_batch_size!r}: must be an integer >= 1")
        self._source = self._consumption(source, micro_batch_size, 1)
        self.reports: deque = deque(maxlen=1000)
        self._done = False

    @property
    def last_report(self) -> WindowReport | None:
        return None

    def __iter__(self):
        return self

    def _next_micro_batch(self):
        if self._done:
            raise StopIteration
        try:
            return next(self._source)
        except StopIteration:
            self._done = True
            raise

    calibration = None

    def calibrate(self, calibration) -> None:
        """Reordering off plans nothing: there is no cost model to calibrate (a no-op, so a training
        script runs the same with reordering on or off)."""

    def timed_step(self):
        """No calibration with reordering off: a no-op context."""
        return contextlib.nullcontext()

    def record_step_ms(self, ms) -> bool:
        return False

    def close(self, timeout: float = 30.0) -> None:
        """End the stream (nothing runs in the background)."""
        self._done = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
