"""Byte-segment copy executors: carry out a segment table (a "move list") between buffers.

A `Segments` table is pure data, five int64 numpy arrays of one length n: segment i copies
`nbytes[i]` bytes from byte offset `src_off[i]` of `sources[src_buf[i]]` to byte offset
`dst_off[i]` of `destinations[dst_buf[i]]`. Buffers are contiguous tensors of any dtype, read and
written as raw bytes, so every dtype travels bit for bit. Contract of every executor's `run`:
segments never overlap in the destinations, destinations do not alias the bytes being read,
bytes of the destinations outside the segments are left untouched, zero-byte segments are skipped,
and every segment lies inside its buffers (checked before anything is copied; `ValueError`).

Executors:
* `TorchExecutor`: any device, torch ops only. Segments of many words are one `copy_` of narrow
  views each; the small ones are gathered per (source, destination, word width) group by one
  `index_select` + `index_copy_` through a word index built with numpy (no Python call per segment).
* `TritonExecutor`: CUDA destinations, CUDA or pinned host sources; one host-to-device table copy
  and one kernel launch per `run`, whatever the number of segments. Triton is imported only when
  the executor is constructed, so this module imports without it.
* `select_executor(device)`: Triton on CUDA when it imports, torch otherwise; logs which and why once.
"""

from __future__ import annotations

import logging
import os
from typing import Callable, Protocol, Sequence, runtime_checkable

import numpy as np
import torch

from reorder.batch.keepalive import KeepAlive, current_stream
from reorder.plan.segments import Segments

log = logging.getLogger("reorder")

def byte_view(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor as a flat uint8 view (shares storage; no copy)."""
    if not t.is_contiguous():
        raise ValueError(f"buffers must be contiguous, got a tensor of shape {tuple(t.shape)} "
                         f"and strides {t.stride()}")
    return t.reshape(-1).view(torch.uint8)


def _addresses(side: str, buffers: Sequence[torch.Tensor]) -> tuple[np.ndarray, np.ndarray]:
    """(address, bytes) of every buffer, int64; ValueError for one that is not contiguous."""
    ptr, size = [], []
    for t in buffers:
        if not t.is_contiguous():
            raise ValueError(f"{side} buffers must be contiguous, got shape {tuple(t.shape)} strides {t.stride()}")
        ptr.append(t.data_ptr())
        size.append(t.nbytes)
    return np.array(ptr, dtype=np.int64), np.array(size, dtype=np.int64)


def check_bounds(segments: Segments, sources: Sequence[torch.Tensor],
                 destinations: Sequence[torch.Tensor]) -> tuple[np.ndarray, np.ndarray]:
    """Raise ValueError unless every segment names existing buffers and lies inside them, and every
    buffer is contiguous. Vectorized over segments; one pass over the buffers. Returns the sources'
    and the destinations' addresses (int64 arrays), which a launch table needs."""
    out = []
    for side, bufs, which, off in (("src", sources, segments.src_buf, segments.src_off),
                                   ("dst", destinations, segments.dst_buf, segments.dst_off)):
        ptr, sizes = _addresses(side, bufs)
        out.append(ptr)
        if not len(segments):
            continue
        bad = which >= len(bufs)
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(f"Segments.{side}_buf[{i}] = {int(which[i])}: only {len(bufs)} {side} buffers")
        over = off + segments.nbytes > sizes[which]
        if over.any():
            i = int(np.argmax(over))
            raise ValueError(f"segment {i}: Segments.{side}_off[{i}] = {int(off[i])} + nbytes "
                             f"{int(segments.nbytes[i])} exceeds {side} buffer {int(which[i])} of "
                             f"{int(sizes[which[i]])} bytes")
    return out[0], out[1]


def word_width(*values) -> np.ndarray:
    """Per element: the widest word in (8, 4, 2, 1) bytes dividing all the given integers/arrays."""
    acc = np.zeros(np.broadcast(*values).shape, dtype=np.int64)
    for v in values:
        acc = acc | np.asarray(v, dtype=np.int64)
    acc = acc | 8  # caps the width at 8 bytes
    return (acc & -acc).astype(np.int64)  # lowest set bit


_WORD_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@runtime_checkable
class Executor(Protocol):
    """Carries out a segment table; `run` follows the contract in the module docstring and returns
    once the copy is enqueued (on CUDA: on the current stream, ordered with later work there)."""

    name: str

    def run(self, segments: Segments, sources: list[torch.Tensor],
            destinations: list[torch.Tensor], held: tuple | None = None) -> None: ...


class TorchExecutor:
    """Torch-only executor for any device (also the CUDA fallback, where a source may be a host
    tensor). A segment of at least `gather_below_words` words (its natural width: the widest word
    dividing its offsets, length and buffer addresses) is one `copy_` of narrow uint8 views, which
    is a memcpy; smaller ones are gathered per (source, destination, width) group by one
    `index_select` + `index_copy_` of that word type, when the group holds at least
    `gather_min_segments` of them (else they are copied one by one too). On 2 CPU cores a
    Python-level copy_ costs about 5 us, a gathered word about 2-5 ns (index build included) and a
    group about 45 us whatever its size: ~512 words is where a segment's two ways break even, and a
    group pays from about 10 segments. On CUDA each copy_ is a launch, so larger thresholds may pay."""

    name = "torch"
    reads_pinned_host = False  # sources must live on the destinations' device

    def __init__(self, gather_below_words: int = 512, gather_min_segments: int = 10):
        self.gather_below_words = int(gather_below_words)
        self.gather_min_segments = int(gather_min_segments)

    def run(self, segments: Segments, sources: list[torch.Tensor],
            destinations: list[torch.Tensor], held: tuple | None = None) -> None:
        """held is not needed here: torch's copies are readers the caching allocators see."""
        check_bounds(segments, sources, destinations)
        s = segments.merged()  # each segment costs a copy_ here: fuse the contiguous ones first
        if not len(s):
            return
        src_at, dst_at = _placement(sources), _placement(destinations)
        width = word_width(s.src_off, s.dst_off, s.nbytes, src_at[s.src_buf], dst_at[s.dst_buf])
        small = s.nbytes // width < self.gather_below_words
        key = np.where(small, _group_key(s, width, len(destinations)), -1)
        _, group, size = np.unique(key, return_inverse=True, return_counts=True)
        small &= size[group] >= self.gather_min_segments
        src_bytes = [byte_view(t) for t in sources]
        dst_bytes = [byte_view(t) for t in destinations]
        self._copy_big(s.take(~small), src_bytes, dst_bytes)
        self._gather_small(s.take(small), width[small], src_bytes, dst_bytes)

    @staticmethod
    def _copy_big(s: Segments, src_bytes, dst_bytes) -> None:
        for sb, so, db, do, n in zip(s.src_buf.tolist(), s.src_off.tolist(), s.dst_buf.tolist(),
                                     s.dst_off.tolist(), s.nbytes.tolist()):
            d = dst_bytes[db]  # non-blocking into CUDA: a pinned host source then copies async
            d.narrow(0, do, n).copy_(src_bytes[sb].narrow(0, so, n), non_blocking=d.is_cuda)

    @staticmethod
    def _gather_small(s: Segments, width: np.ndarray, src_bytes, dst_bytes) -> None:
        """One index_select + index_copy_ per (source, destination, width) group."""
        if not len(s):
            return
        key = _group_key(s, width, len(dst_bytes))
        order = np.argsort(key, kind="stable")
        key_sorted = key[order]
        bounds = np.flatnonzero(np.concatenate([[True], key_sorted[1:] != key_sorted[:-1], [True]]))
        for lo, hi in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
            g = s.take(order[lo:hi])
            w = int(width[order[lo]])
            src_idx, dst_idx = _word_indices(g.src_off // w, g.dst_off // w, g.nbytes // w)
            src = _as_words(src_bytes[int(g.src_buf[0])], w)
            dst = _as_words(dst_bytes[int(g.dst_buf[0])], w)
            vals = src.index_select(0, torch.from_numpy(src_idx).to(src.device))
            dst.index_copy_(0, torch.from_numpy(dst_idx).to(dst.device), vals.to(dst.device))


def _group_key(s: Segments, width: np.ndarray, destinations: int) -> np.ndarray:
    """Per segment, one integer per (source, destination, word width) (widths are below 16)."""
    return (s.src_buf * destinations + s.dst_buf) * 16 + width


def _placement(buffers) -> np.ndarray:
    """Per buffer, its address OR its byte offset in its storage: a word width dividing both is one
    that the buffer's memory is aligned to and that `Tensor.view(dtype)` accepts."""
    return np.array([t.data_ptr() | t.storage_offset() * t.element_size() for t in buffers], dtype=np.int64)


def _word_indices(src_start: np.ndarray, dst_start: np.ndarray, count: np.ndarray):
    """Source and destination word indices of every word of the segments, in segment order."""
    total = int(count.sum())
    first = np.cumsum(count) - count  # position of each segment's first word in the output
    rel = np.arange(total, dtype=np.int64)
    return rel + np.repeat(src_start - first, count), rel + np.repeat(dst_start - first, count)


def _as_words(b: torch.Tensor, w: int) -> torch.Tensor:
    """A uint8 view as words of w bytes (the trailing partial word cut off: no segment of this
    width reaches into it, since its offset and length are multiples of w)."""
    return b if w == 1 else b.narrow(0, 0, b.numel() // w * w).view(_WORD_DTYPES[w])


def launch_table(segments: Segments, src_ptr: np.ndarray, dst_ptr: np.ndarray, block_bytes: int,
                 alloc: Callable[[int], np.ndarray] | None = None) -> tuple[np.ndarray, int, int]:
    """The Triton kernel's input as one int64 array, and (n segments, n blocks): rows [blocks, 2] of
    (segment row, byte start in the segment), then rows [n, 3] of (absolute source address,
    absolute destination address, nbytes) for the non-empty segments. src_ptr / dst_ptr: the
    buffers' addresses (from `check_bounds`). Program p copies bytes [start, min(start +
    block_bytes, nbytes)) of its segment, so the kernel needs no search. Block rows first: the
    segment rows then start 16-byte aligned, at element 2 * blocks. `alloc(size)`
    gives the int64 array to fill (default np.empty; a pinned staging buffer's numpy view saves a
    copy)."""
    s = segments.take(segments.nbytes > 0)
    n = len(s)
    per_seg = (s.nbytes + block_bytes - 1) // block_bytes
    first = np.cumsum(per_seg)
    blocks = int(first[-1]) if n else 0
    first -= per_seg  # first block of each segment
    out = (alloc or (lambda k: np.empty(k, dtype=np.int64)))(3 * n + 2 * blocks)
    blk = out[:2 * blocks].reshape(blocks, 2)
    seg = out[2 * blocks:].reshape(n, 3)
    seg[:, 0] = src_ptr[s.src_buf] + s.src_off
    seg[:, 1] = dst_ptr[s.dst_buf] + s.dst_off
    seg[:, 2] = s.nbytes
    blk[:, 0] = np.repeat(np.arange(n, dtype=np.int64), per_seg)
    blk[:, 1] = (np.arange(blocks, dtype=np.int64) - first[blk[:, 0]]) * block_bytes
    return out, n, blocks


class TritonExecutor:
    """One Triton kernel launch per `run`. Destinations must be CUDA tensors on one device; sources
    CUDA tensors on that device or pinned host tensors (device-addressable under unified addressing,
    so their raw addresses are used as is). The pinned host sources of a launch are held (`KeepAlive`)
    until an event recorded after it completes: the kernel reads them by address, which the caching
    host allocator cannot see. The table from `launch_table` is staged in pinned host
    memory and copied to the device non-blocking on the current stream, then one program per block
    of `block_bytes` copies its bytes with the widest word the relative alignment of its source and
    destination allows (16-byte aligned int64 pairs, int32, int16, else bytes), head and tail bytes
    apart. Under TRITON_INTERPRET=1 (set before construction) it runs on CPU tensors instead, through
    Triton's interpreter: that is how the kernel is tested without a GPU. A launch that raises (e.g.
    no Triton compiler for this GPU) is logged once; that run and every later one go through the
    torch executor."""

    name = "triton"
    reads_pinned_host = True  # pinned host memory is device-addressable: the kernel reads it directly

    def __init__(self, block_bytes: int = 16384, num_warps: int = 4):
        if block_bytes < 64 or block_bytes & (block_bytes - 1):
            raise ValueError(f"block_bytes must be a power of two >= 64, got {block_bytes}")
        self.block_bytes = block_bytes
        self.num_warps = num_warps
        self.interpret = os.environ.get("TRITON_INTERPRET") == "1"
        from reorder.exchange import triton_copy  # ImportError here when triton is missing

        self._kernel = triton_copy.copy_segments
        self._fallback = None  # the torch executor, once a launch has failed
        self.alive = KeepAlive()  # pinned host sources of launches that may still be reading them

    def __del__(self):
        alive = getattr(self, "alive", None)
        if alive is not None:
            alive.wait()  # a held block must not return to the host allocator while a kernel reads it

    def run(self, segments: Segments, sources: list[torch.Tensor],
            destinations: list[torch.Tensor], held: tuple | None = None) -> None:
        """held: per source, keep it referenced until the launch completes (the window's
        `Placement.held`); None: every host source (a caller without a placement)."""
        src_ptr, dst_ptr = check_bounds(segments, sources, destinations)
        live = segments.nbytes > 0
        if not live.any():
            return
        device = self._check_devices(segments, live, sources, destinations)
        if self._fallback is not None:
            return self._fallback.run(segments, sources, destinations)
        try:
            self._launch(segments, src_ptr, dst_ptr, device)
            if not self.interpret:
                keep = [t for t in sources if not t.is_cuda] if held is None else \
                    [t for t, h in zip(sources, held, strict=True) if h]
                if keep:
                    self.alive.hold(keep, current_stream(device))
        except Exception as e:  # e.g. no Triton compiler for this GPU: nothing was copied yet
            self._fallback = TorchExecutor()
            log.warning("reorder: the Triton copy kernel failed (%s: %s); segment copies run the torch "
                        "executor from now on", type(e).__name__, e)
            self._fallback.run(segments, sources, destinations)

    def _launch(self, segments: Segments, src_ptr: np.ndarray, dst_ptr: np.ndarray, device: int) -> None:
        staged = []

        def stage(size):
            # Fresh pinned staging each run: the caching host allocator does not hand the block out
            # again until the non-blocking copy that reads it has completed.
            staged.append(torch.empty(size, dtype=torch.int64, pin_memory=not self.interpret))
            return staged[0].numpy()

        _, _, blocks = launch_table(segments, src_ptr, dst_ptr, self.block_bytes, alloc=stage)
        if self.interpret:
            self._kernel[(blocks,)](staged[0], 2 * blocks, BLOCK=self.block_bytes)
            return
        with torch.cuda.device(device):  # Triton launches on the current device and stream
            table = staged[0].to(device, non_blocking=True)
            self._kernel[(blocks,)](table, 2 * blocks, BLOCK=self.block_bytes, num_warps=self.num_warps)

    def _check_devices(self, segments: Segments, live: np.ndarray, sources, destinations) -> int:
        """The index of the device to launch on (-1: the CPU, interpreted); ValueError for buffers
        the kernel cannot address. live: the segments that copy bytes."""
        used_dst = sorted(set(segments.dst_buf[live].tolist()))
        used_src = sorted(set(segments.src_buf[live].tolist()))
        first = destinations[used_dst[0]]
        device = first.get_device()
        want = "cpu" if self.interpret else "cuda"

        def on_device(t):  # on the launch device (interpreted: the CPU); few attribute reads when on CUDA
            return t.device.type == "cpu" if self.interpret else t.is_cuda and t.get_device() == device

        for i in used_dst:
            t = destinations[i]
            if not on_device(t):
                raise ValueError(f"TritonExecutor: destination {i} is on {t.device}; all "
                                 f"destinations must be on one {want} device")
        for i in used_src:
            t = sources[i]
            if on_device(t):
                continue
            if not (t.device.type == "cpu" and not self.interpret and t.is_pinned()):
                raise ValueError(f"TritonExecutor: source {i} is on {t.device} (pinned: "
                                 f"{t.is_pinned() if t.device.type == 'cpu' else 'n/a'}); sources must be on "
                                 f"{first.device} or pinned host memory")
        return device


_NOTICES: set[tuple[str, str]] = set()


def select_executor(device) -> Executor:
    """The executor for buffers on `device`: Triton for CUDA when triton imports, else torch. Logs
    (logger "reorder", INFO) which one runs and why, once per distinct choice in this process."""
    device = torch.device(device)
    if device.type == "cuda":
        try:
            executor: Executor = TritonExecutor()
            why = "CUDA device and triton importable: one kernel launch per segment table"
        except ImportError as e:
            executor, why = TorchExecutor(), f"triton not installed ({e})"
        except Exception as e:  # a broken install (e.g. mismatched versions) must not stop training
            executor, why = TorchExecutor(), f"triton failed to import ({type(e).__name__}: {e})"
    else:
        executor, why = TorchExecutor(), f"{device.type} device (the Triton kernel needs CUDA)"
    if (executor.name, why) not in _NOTICES:
        _NOTICES.add((executor.name, why))
        log.info("reorder: segment copies on %s run the %s executor: %s", device, executor.name, why)
    return executor
