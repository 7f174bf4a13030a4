"""ReorderingBuffer: wraps a rank's micro-batch iterator and yields reordered micro-batches.

Reads windows of W micro-batches (a short last window when the source ends), exchanges each
window with one WindowExchanger call, and yields its micro-batches in order. At the end every rank
passes one empty window together so an early-ending rank makes all ranks raise instead of hang.

overlap=True prepares the next window on a background thread: its own CUDA stream (and
`torch.cuda.set_device` in the thread), its own process groups (the exchanger passed in must use
them), at most `ahead` windows queued or being prepared beyond the one being consumed (default 1:
the worker starts window k+1 when the consumer takes the last micro-batch of window k, so the device
holds that micro-batch plus one window in flight or queued, and the exchange hides behind that
micro-batch's step; ahead=2 also prepares k+2 while k+1 waits, which absorbs jitter at the cost of
one more window resident), `record_stream` + an event wait on the consumer side, worker exceptions re-raised
on the consumer's next `next()`, and a thread that ends on its own when the source is exhausted or
on `close()` / context-manager exit. Windows the gate backoff skips have nothing to overlap: the
worker hands each run of them to the consumer, which reads and passes them through itself (a thread
hand-off per window costs more than the window, and the training thread would lose the GIL to the
worker for it), then resumes the worker for the next planned window while it consumes the last one.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
from collections import deque

import torch

from reorder.exchange.exchanger import WindowExchanger, WindowReport
from reorder.batch.layout import tensors

log = logging.getLogger("reorder")
_END = object()
_INLINE = object()  # queued by the worker: the consumer exchanges the coming run of skipped windows itself


def check_overlap_allowed(device) -> None:
    """Refuse overlap where a second communicator on another thread can deadlock (DESIGN section 6)."""
    if device is not None and torch.device(device).type == "cuda" and \
            os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1":
        raise ValueError("megatron_mimo_reorder_overlap=True with CUDA_DEVICE_MAX_CONNECTIONS=1: collectives "
                         "issued from the overlap thread on a second NCCL communicator can be ordered "
                         "differently on each rank and deadlock; set megatron_mimo_reorder_overlap=False "
                         "(--no-overlap-intra-microbatch-reorder) or unset CUDA_DEVICE_MAX_CONNECTIONS")


class ReorderingBuffer:
    """Iterator of reordered micro-batches over `source` (this rank's micro-batch iterator).

    exchanger: this rank's WindowExchanger (window size W = exchanger.window_size); with overlap it
    must be bound to the side process groups and is used only by the worker thread.
    log_every: log a metrics line every N windows (0 = never). `reports` keeps the last 1000
    WindowReports; `last_report` the newest.
    """

    def __init__(self, source, exchanger: WindowExchanger, *, overlap: bool = False, log_every: int = 0,
                 get_timeout: float = 1.0, ahead: int = 1):
        if isinstance(ahead, bool) or not isinstance(ahead, int) or ahead < 1:
            raise ValueError(f"ahead={ahead!r} is invalid: windows prepared ahead of the consumer must be an integer >= 1")
        self._source = iter(source)
        self._ex = exchanger
        self.ahead = ahead
        self._ready: deque = deque()
        self.reports: deque = deque(maxlen=1000)
        self.log_every = log_every
        self._done = False
        self._windows = 0
        self._thread = None
        self._get_timeout = get_timeout
        self.overlap = overlap
        self._inline = False  # the consumer is exchanging a run of skipped windows itself
        self._from_worker = False  # the ready micro-batches came from the worker (their slot is released)
        if overlap:
            check_overlap_allowed(exchanger.device)
            self._queue: queue.Queue = queue.Queue()
            self._slots = threading.Semaphore(ahead)  # one per window queued or being prepared
            self._stop = threading.Event()
            self._inline_done = threading.Event()  # the consumer has exchanged the run of skipped windows
            self._thread = threading.Thread(target=self._worker, name="reorder-overlap", daemon=True)
            self._thread.start()

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

    def _record(self, report: WindowReport | None):
        if report is None:
            return
        self.reports.append(report)
        self._windows += 1
        if self.log_every and self._windows % self.log_every == 0:
            log.info("reorder window %d: spread %.3f -> %.3f, moved %d/%d samples (%.1f MiB), plan %.2f ms, "
                     "exchange %.2f ms", self._windows, report.spread_before, report.spread_after,
                     report.moved_samples, report.total_samples, report.moved_bytes / 2**20, report.plan_ms,
                     report.exchange_ms)

    @property
    def last_report(self) -> WindowReport | None:
        return self.reports[-1] if self.reports else None

    def __iter__(self):
        return self

    def __next__(self):
        if self._ready:
            return self._take()
        if self._done:
            raise StopIteration
        if self.overlap:
            return self._exchange_inline() if self._inline else self._next_overlap()
        window, error = self._read_window()
        try:
            out, report = self._ex.exchange(window, error)
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

    def _worker(self):
        device = self._ex.device
        cuda = device is not None and device.type == "cuda"
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
        out, report = self._ex.exchange(window, error)
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
            out, report = self._ex.exchange(window, error)
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


class PassThroughBuffer:
    """What `reorder.integrations.megatron.wrap` returns with reordering off: the source's micro-batches
    unchanged, behind the interface of ReorderingBuffer (iterator, context manager, `close()`,
    `reports` (always empty), `last_report` (None)), so a training loop holds one type either way."""

    overlap = False
    worker_alive = False

    def __init__(self, source):
        self._source = iter(source)
        self.reports: deque = deque(maxlen=1000)
        self._done = False

    @property
    def last_report(self) -> WindowReport | None:
        return None

    def __iter__(self):
        return self

    def __next__(self):
        if self._done:
            raise StopIteration
        try:
            return next(self._source)
        except StopIteration:
            self._done = True
            raise

    def close(self, timeout: float = 30.0) -> None:
        """End the stream (nothing runs in the background)."""
        self._done = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
