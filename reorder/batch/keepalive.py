"""Host buffers that queued device work reads by raw address, held until that work is done.

torch's caching allocators learn of pending work on a block only from torch's own operations (a
non-blocking copy records an event on a pinned host block; a stream records itself on a device
block). A kernel that reads a tensor through its address is invisible to them: once the caller
drops the tensor, its block can be handed to the next allocation (the next `pin_memory()`) and
overwritten before the kernel has read it. Both Triton launches that read pinned host memory (the
exchange's copy kernel and the self-check's checksum kernel) hold their sources here.
"""

from __future__ import annotations

import collections
import functools
import threading

import torch


def current_stream(device: torch.device | int):
    """`torch.cuda.current_stream(device)` (a CUDA device with its index, or the index), its Stream
    object made once per stream: making one costs several µs of host time (more inside a window, run
    cold), asking for the current stream's handle a fraction of one. The object is looked up by that
    handle, so a stream set with `torch.cuda.stream(...)` is the one returned."""
    index = device if isinstance(device, int) else device.index
    return _stream(index, torch._C._cuda_getCurrentRawStream(index))


def _stream(index: int, raw: int):
    """The current stream of device `index`, whose raw handle is `raw`."""
    return torch.cuda.current_stream(index)


# the streams seen last (a caller that makes streams without end: the old ones are forgotten); a plain
# function wrapped, not a decorator: mutmut mutates no decorated function
_stream = functools.lru_cache(maxsize=64)(_stream)


class KeepAlive:
    """Tensors held until a CUDA event recorded after their launch completes; completed entries are
    let go, in launch order, at every later `hold` and all of them at `wait`. Their events are
    recorded again by later holds: making and destroying an event costs host time a launch (two
    driver calls), recording a done one again does not. Locked: one holder may serve several
    threads (an overlap worker launches too)."""

    def __init__(self):
        self._pending = collections.deque()  # (stream's device index, event, tensors), in launch order
        self._done = {}  # device index of the stream -> events whose work has completed, recorded again there
        self._lock = threading.Lock()

    def hold(self, tensors: list, stream) -> None:
        """Keep `tensors` until the work queued so far on `stream` is done (no event when there is
        nothing to keep, and then `stream` may be None); let go of those whose launches have completed."""
        with self._lock:
            while self._pending and self._pending[0][1].query():
                self._let_go()
            if tensors:
                # an event is recorded on streams of the device it was first recorded on only
                device = getattr(stream, "device_index", None)
                done = self._done.get(device)
                event = done.pop() if done else torch.cuda.Event()
                event.record(stream)
                self._pending.append((device, event, tensors))

    def __len__(self) -> int:
        return len(self._pending)

    def wait(self) -> None:
        """Block until every held tensor's work is done, then let them go."""
        with self._lock:
            while self._pending:
                self._pending[0][1].synchronize()
                self._let_go()

    def _let_go(self) -> None:
        """Let go of the first entry (its work is done) and keep its event for a later hold."""
        device, event, _ = self._pending.popleft()
        self._done.setdefault(device, []).append(event)
