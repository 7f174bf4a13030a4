"""Per-sample, per-field 64-bit checksums of a shard's buffers, on whatever device they live.

A field is read as entries of words (`reorder.plan.checksums.word_width`): a dense field's sample
has `pre` entries (one per leading index) of `unit` bytes, a ragged field's sample its rows or
images, the list field's sample one entry of its pickled bytes. A word w (little-endian, unsigned
for 1-byte words, sign-extended to int64 for wider ones) at byte c of entry e of its sample adds

    (w + 1) * mix(c) * mix(e + 2**32 * f)        (f: the field's index when it shares the last slot, else 0)

to the sample's checksum of that field; mix(x) is an odd 64-bit mix and every sum wraps modulo
2**64. Integer addition is associative, so the sums are bit-identical on the CPU and on a GPU,
whatever the order of the additions: a sender's checksums (where it reads its samples) and a
receiver's (on what it assembled) agree exactly when the bytes do. A flipped byte changes its
word's term by a nonzero multiple of an odd number; swapped samples, rows or entries, or a dropped
segment, change several. The mix factors into a column part and an entry part, so a field costs one
broadcast multiply and one row sum over its words: about one pass over the bytes, no index tensors.

`window_checksums` sums a whole window (every field of every sample of its micro-batches): on CUDA
with one Triton launch (`triton_checksum`, imported on first use) over the window's counts and
addresses (`launch_block`), else, or when the launch raises (logged once), with the torch ops of `checksums`.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import mmap
import operator
import os
import struct
import threading
import types

import numpy as np
import torch

from reorder.batch.keepalive import KeepAlive, current_stream
from reorder.plan.checksums import CHECKED_FIELDS, field_salt, field_slot, word_width
from reorder.plan.counts import COLUMNS, SampleCounts

_MIX = -7046029254386353131  # 0x9E3779B97F4A7C15 as a signed int64 (Fibonacci hashing)
_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# the kernel's lanes, and words per program (a buffer's last program: fewer); 512 lanes summed the round's
# windows fastest on an H200 (`bench/checksum_kernel.py`: 8 micro-batches in 0.49 ms, 0.58 with 1,024)
BLOCK, CHUNK = 512, 16384


def mix(x: torch.Tensor) -> torch.Tensor:
    """An odd int64 mix of int64 x: multiply, fold the high bits down, set the low bit."""
    h = x * _MIX
    return (h ^ (h >> 29)) | 1


def checksums(buffers: list, fields: tuple, counts: SampleCounts) -> torch.Tensor:
    """int64 [n, CHECKED_FIELDS] on `gathering_device(buffers)`: the checksums of the n samples
    (counts [n]) of a shard whose buffers (contiguous, one per `ByteField` of `fields`, in order) are
    `buffers`; a buffer None is left out (its field adds nothing). Each field is summed where its
    buffer lives."""
    n = counts.shape[0]
    dev = gathering_device(buffers)
    out = torch.zeros(n, CHECKED_FIELDS, dtype=torch.int64, device=dev)
    for f, (field, buf) in enumerate(zip(fields, buffers)):
        per = field_sums(f, field, buf, counts)
        if per is not None:
            out[:, field_slot(f)] += per.to(dev, non_blocking=True)
    return out


def gathering_device(buffers: list) -> torch.device:
    """Where the torch ops gather the sums of `buffers`: the first one's device that is not the host,
    else the host. The copies into it then go to a device, never from one: a non-blocking copy from
    a device to the host returns before its bytes land, and the host would add them up too early."""
    return next((t.device for t in buffers if t is not None and t.device.type != "cpu"), torch.device("cpu"))


def field_sums(f: int, field: tuple, buf: torch.Tensor, counts: SampleCounts) -> torch.Tensor | None:
    """int64 [n] on buf's device: the n samples' checksums of field number `f` (a `ByteField`) held
    by `buf`; None when the field holds no bytes or is left out (`buf` None)."""
    if buf is None:
        return None
    kind, pre, unit = field
    n = counts.shape[0]
    dev = buf.device
    salt = field_salt(f)
    if kind == "dense":
        if not n * pre * unit:
            return None
        words = _words(buf, word_width(kind, unit)).view(pre, n, -1)
        per = _entry_sums(words) * mix(torch.arange(pre, device=dev) + salt)[:, None]  # [pre, n]
        return per.sum(0)
    if kind == "list":  # one entry per sample, of 1-byte words: columns are byte positions in the sample
        sizes = np.asarray(counts.list_bytes, dtype=np.int64)
        total = int(sizes.sum())
        if not total:
            return None
        sample = np.repeat(np.arange(n, dtype=np.int64), sizes)
        column = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(sizes) - sizes, sizes)
        terms = (_words(buf, 1)[:total].to(torch.int64) + 1) * mix(_to(column, dev))
        return torch.zeros(n, dtype=torch.int64, device=dev).index_add_(0, _to(sample, dev), terms) * mix(
            torch.tensor(salt, device=dev))
    entries = np.asarray(counts.rows if kind == "row" else counts.images, dtype=np.int64)
    total = int(entries.sum())
    if not total or not unit:
        return None
    words = _words(buf, word_width(kind, unit)).view(total, -1)
    sample = np.repeat(np.arange(n, dtype=np.int64), entries)
    index = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(entries) - entries, entries)
    per = _entry_sums(words) * mix(_to(index + salt, dev))
    return torch.zeros(n, dtype=torch.int64, device=dev).index_add_(0, _to(sample, dev), per)


def _to(a: np.ndarray, dev) -> torch.Tensor:
    return torch.from_numpy(a).to(dev, non_blocking=True)


def _entry_sums(words: torch.Tensor) -> torch.Tensor:
    """Per entry (last dim: its words), sum of (w + 1) * mix(byte position of w in the entry)."""
    width = words.element_size()
    col = mix(torch.arange(words.shape[-1], device=words.device) * width)
    return ((words.to(torch.int64) + 1) * col).sum(-1)


def _words(t: torch.Tensor, width: int) -> torch.Tensor:
    """The bytes of contiguous tensor t as a flat tensor of `width`-byte words (a copy when its
    storage does not start at a whole word)."""
    b = t.reshape(-1).view(torch.uint8)
    if width == 1:
        return b
    if b.storage_offset() % width or b.data_ptr() % width:
        b = b.clone()
    return b.view(_WORDS[width])


# ---- a whole window: one launch on CUDA ------------------------------------------------------------

log = logging.getLogger("reorder")
_KERNEL = []  # [the Triton checksum kernel, or None where triton does not import or a launch failed]
_KERNEL_AGREED = []  # [True] once the kernel's first window equalled the torch ops' sums
_INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"  # Triton's interpreter, as triton reads it when imported


def window_checksums(parts: list, fields: tuple, device, *, host: bool = False, interpret: bool = False,
                     graphs: "Graphs | None" = None, placed: bool = False) -> torch.Tensor | np.ndarray:
    """int64 [N, CHECKED_FIELDS]: the checksums of every sample of a window's micro-batches, part
    after part (N: their samples); parts: per micro-batch (its buffers, one per `ByteField` of
    `fields`, or None for a field left out, and its SampleCounts [n]).

    On a CUDA `device` (where Triton imports): one kernel launch for every field whose buffer it
    can read by address (on that device, or pinned host memory), the others summed with torch ops
    where they live (e.g. the pickled lists of host micro-batches) and added in; the result is on
    `device`, and nothing waits for the device. Elsewhere, or once a launch has raised (logged
    once), torch ops on each part (`checksums`): the result is on `gathering_device` of the buffers. Either
    way bit for bit the same sums. `host`: the sums in host memory instead, as a numpy array; where
    they were summed on a device, in pinned memory that a non-blocking copy fills behind the
    device's work (record an event on `device`'s current stream after the call and wait for it
    before reading them).
    `interpret`: the kernel on CPU tensors through Triton's interpreter (TRITON_INTERPRET=1 set
    before triton is imported; tests). `graphs`: with `host`, the caller's captured launches
    (`Graphs`: the sums are then a view of its block, until its launch after next of that size).
    `placed`: every buffer is one the kernel reads by address (`kernel_checksums`).

    The kernel's first window in a process is also summed with torch ops and compared (one wait for
    the device, once): a kernel that disagrees (a compiler or GPU the kernel was never run on) is
    logged and replaced by the torch ops from then on, so the check never reports a mismatch that
    only its own kernel made."""
    got = kernel_checksums(parts, fields, device, host=host, interpret=interpret, graphs=graphs, placed=placed)
    if got is None:
        got = torch_checksums(parts, fields)
        return _to_host(got) if host else got
    if not _KERNEL_AGREED:
        if host and torch.device(device).type == "cuda":
            torch.cuda.current_stream(device).synchronize()  # the sums' copy to the host has landed
        want = torch_checksums(parts, fields)
        if not (np.array_equal(got, want.cpu().numpy()) if host else torch.equal(got, want.to(got.device))):
            _KERNEL[0] = None
            log.warning("reorder: the Triton checksum kernel's first window differs from the torch ops' sums; the "
                        "self-check sums with torch ops from now on")
            return _to_host(want) if host else want.to(got.device)
        _KERNEL_AGREED.append(True)
    return got


def _to_host(t: torch.Tensor) -> np.ndarray:
    """t's values in host memory, as a numpy array: its own when it is there, else a pinned copy's,
    filled behind the device's work."""
    if t.device.type == "cpu":
        return t.numpy()
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True).numpy()


def torch_checksums(parts: list, fields: tuple) -> torch.Tensor:
    """`window_checksums` with torch ops only: each part's `checksums`, on `gathering_device` of all
    their buffers."""
    if not parts:
        return torch.zeros(0, CHECKED_FIELDS, dtype=torch.int64)
    dev = gathering_device([t for bufs, _ in parts for t in bufs])
    return torch.cat([checksums(bufs, fields, counts).to(dev, non_blocking=True) for bufs, counts in parts])


def kernel_checksums(parts: list, fields: tuple, device, *, host: bool = False, interpret: bool = False,
                     block: int = BLOCK, chunk: int = CHUNK, graphs: "Graphs | None" = None,
                     grid: int | None = None, placed: bool = False) -> torch.Tensor | np.ndarray | None:
    """`window_checksums` through the Triton kernel (one launch), or None where it does not apply:
    not a CUDA device (unless `interpret`: CPU tensors, Triton's interpreter; with TRITON_INTERPRET=1
    in the environment, `interpret` alone), triton missing, no buffer the kernel can read, or a
    kernel that failed to launch once (logged; torch ops from then on). block: lanes of a program
    (a power of two); chunk: words per program (a multiple of block). graphs: with `host`, the
    caller's captured launches (`Graphs`), replayed where one fits the window. grid: launch that
    many programs, each taking every grid-th of the window's (interpreted; default one per
    program). placed: the caller vouches that every buffer given is one the kernel reads by address
    (contiguous, on `device` or in pinned host memory; interpreted: on the CPU), so none is asked
    (host time a buffer); else each is, and the others are summed with torch ops."""
    if not isinstance(device, torch.device):
        device = torch.device(device)
    if not interpret and (device.type != "cuda" or _INTERPRETER):
        return None  # (an interpreted kernel would read the table's device addresses on the host)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    kernel = _kernel()
    if kernel is None:
        return None
    readable = None if placed else [[t is not None and _readable(t, device, interpret) for t in bufs]
                                    for bufs, _ in parts]
    if readable is not None and not any(map(any, readable)):
        return None
    # the input, then the sums' words (the torch sums of the buffers the kernel does not read, else
    # zero): one pinned block, one copy to the device, and the sums copied back into its own words.
    # Fresh each launch, or a captured launch's own: the caching host allocator does not hand a
    # fresh block out again before the non-blocking copies that use it have completed
    captured = graphs is not None and host and not interpret
    slot, staged = None, []

    def alloc(size):
        nonlocal slot
        slot = graphs.take(device, size) if captured else None
        if slot is not None:
            return slot.words[:size]
        staged.append(torch.empty(size, dtype=torch.int64, pin_memory=not interpret))
        return staged[0].numpy()

    words, programs, at = launch_block(parts, fields, readable, chunk, alloc=alloc)
    out_at, size = at["out_at"], len(words)
    n = (size - out_at) // CHECKED_FIELDS  # the sums' words come last
    data = staged[0] if slot is None else slot.host
    rest = None if readable is None else _unread_sums(parts, fields, readable, n)
    if rest is not None:
        words[out_at:] = rest.numpy().ravel()
    consts = dict(SLOTS=CHECKED_FIELDS, CHUNK=chunk, BLOCK=block, SAMPLES=at["samples"])
    try:
        if interpret:
            if programs:
                kernel[(min(programs, grid or programs),)](data, **consts)
        else:
            with _current(device):  # Triton launches on the current device and stream
                if slot is None or not slot.replay(kernel, consts):  # a replay: the copies, launch and copy back
                    on_host = data[:size]
                    data = on_host.to(device, non_blocking=True)
                    if programs:
                        _launch(kernel, programs, data, consts)
                    if host:  # the whole block back into its own words: one copy, no slice of the device block
                        data = on_host.copy_(data, non_blocking=True)
                if programs:
                    held = [t for bufs, _ in parts for t in bufs if t is not None and not t.is_cuda] \
                        if readable is None else \
                        [t for (bufs, _), r in zip(parts, readable) for t, ok in zip(bufs, r) if ok and not t.is_cuda]
                    # every launch lets go of the holds that are done, one with nothing to hold too:
                    # a hold kept longer would keep the sources of a copy that forgot its own, and hide that defect
                    _HELD.hold(held, current_stream(device) if held else None)
    except Exception as e:  # e.g. no Triton compiler for this GPU: the torch ops sum from now on
        _KERNEL[0] = None
        log.warning("reorder: the Triton checksum kernel failed (%s: %s); the self-check sums with torch "
                    "ops from now on", type(e).__name__, e)
        return None
    if host:  # the block's own words, written back by the copy
        return words[out_at:].reshape(n, CHECKED_FIELDS)
    return data[out_at:size].view(n, CHECKED_FIELDS)


class Graphs:
    """One caller's captured checksum launches on CUDA (a round keeps one): per device and block
    size (a power of two, at least a page), two pinned blocks, each with a device block and a CUDA
    graph that copies the pinned block to the device, runs the kernel over a fixed grid (its
    programs take every grid-th of the window's) and copies the block back. A launch through one
    is a single host call instead of three, and nothing is allocated. A block's graph is captured
    at its first launch, which runs uncaptured.

    The two blocks of a size are taken in turn, so a launch's sums (a view of its block) stay as
    they are until the launch after next of that size: the caller reads them before (the round
    reads a window's sums at the start of the next window, and a window launches at most twice).
    A graph that cannot be captured (logged once) leaves the uncaptured launches to every caller
    from then on."""

    def __init__(self):
        self._slots = {}  # (device index, words) -> [_Captured, _Captured]
        self._turn = {}

    def take(self, device: torch.device, size: int) -> "_Captured | None":
        """The next captured block of at least `size` words on `device` (None once capturing has
        failed, and on a thread that `uncaptured_here` marked)."""
        if not _CAPTURE[0] or getattr(_THREAD, "uncaptured", False):
            return None
        key = (device.index, max(512, 1 << (size - 1).bit_length()))
        slots = self._slots.get(key)
        if slots is None:
            slots = self._slots[key] = [_Captured(*key), _Captured(*key)]
        turn = self._turn.get(key, 0)
        self._turn[key] = 1 - turn
        return slots[turn]


_CAPTURE = [True]  # [False] once a graph could not be captured (logged once)
_REGISTERED = []  # (host memory, device block) of every block registered with CUDA: kept to the end of the process
_THREAD = threading.local()  # .uncaptured: this thread's launches are never captured (`uncaptured_here`)


def uncaptured_here() -> None:
    """Never capture a checksum launch on the calling thread: one that runs windows beside the
    training's own device work (the overlap worker). A device-wide synchronize on another thread
    (Megatron's batched P2P does one after its sends) invalidates a capture in progress on the same
    device, whatever the capture's mode: on such a thread a capture could fail at any time. Its
    launches run uncaptured (two host calls more each); a thread that runs windows between its own
    steps still captures."""
    _THREAD.uncaptured = True


class _Captured:
    """A pinned block, its device block and the graph of a launch over them (`Graphs`)."""

    def __init__(self, index: int, words: int):
        self.device, self.graph, self.consts = torch.device("cuda", index), None, None
        self._memory = mmap.mmap(-1, 8 * words)  # whole pages: registered with CUDA as they are
        self.host = torch.frombuffer(self._memory, dtype=torch.int64)
        self.words = np.frombuffer(self._memory, dtype=np.int64)  # the same words, for the host to write
        self.device_block = None

    def replay(self, kernel, consts: dict) -> bool:
        """Launch the block through the graph, captured first when there is none (then the launch
        itself is not run: False, the caller launches); False too when the graph was captured with
        other constants."""
        if self.graph is None:
            self._capture(kernel, consts)
            return False
        if consts != self.consts:
            return False
        self.graph.replay()
        return True

    def _capture(self, kernel, consts: dict) -> None:
        try:
            cudart = torch.cuda.cudart()
            error = int(cudart.cudaHostRegister(self.host.data_ptr(), self.host.nbytes, 0))
            if error:
                cudart.cudaGetLastError()  # or the next CUDA call of anyone would raise it
                raise RuntimeError(f"cudaHostRegister failed with cudaError {error}")
            self.device_block = torch.empty(len(self.host), dtype=torch.int64, device=self.device)
            # kept to the end of the process, even when the caller goes: registered pages must never be
            # unmapped (the driver keeps mapping the address to them, and a later mapping there would
            # reach the device through the old pages), and a replay still queued writes both blocks
            _REGISTERED.append((self._memory, self.device_block))
            # programs striding over the window's: 16 a multiprocessor ran a window of 8 micro-batches
            # (6,898 programs) within 5 % of one program each and one of 1 (550) alike; 4 were 38 % slower
            grid = 16 * torch.cuda.get_device_properties(self.device).multi_processor_count
            compiled = _compiled(kernel, self.device_block, consts, grid)
            compiled._init_handles()  # the kernel's module loaded before the capture, not in it
            graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream(self.device)
            with torch.cuda.stream(stream):
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    self.device_block.copy_(self.host, non_blocking=True)
                    compiled[(grid, 1, 1)](self.device_block, *consts.values())
                    self.host.copy_(self.device_block, non_blocking=True)
                finally:
                    graph.capture_end()
            self.graph, self.consts = graph, dict(consts)
        except Exception as e:  # the uncaptured launches serve every caller from now on
            _CAPTURE[0] = False
            log.warning("reorder: the self-check's checksum launch could not be captured in a CUDA graph (%s: %s); "
                        "it launches uncaptured from now on", type(e).__name__, e)


def _current(device: torch.device):
    """A context that makes CUDA `device` the current one: none when it is already (the common case;
    entering torch's device context costs host time a launch)."""
    return contextlib.nullcontext() if torch.cuda.current_device() == device.index else torch.cuda.device(device)


def _kernel():
    if not _KERNEL:
        try:
            from reorder.batch.triton_checksum import checksum_window
        except Exception:  # not installed, or a broken install: the self-check must not stop training
            checksum_window = None
        _KERNEL.append(checksum_window)
    return _KERNEL[0]


def _launch(kernel, programs: int, data: torch.Tensor, consts: dict) -> None:
    """Launch `kernel` over `programs` programs on the current device and stream, through its
    compiled launcher (`_compiled`). The kernel's first window in the process is compared with
    the torch ops through this same path."""
    _compiled(kernel, data, consts, programs)[(programs, 1, 1)](data, *consts.values())


def _compiled(kernel, data: torch.Tensor, consts: dict, programs: int):
    """`kernel` compiled for data's device and `consts`, once (`warmup`: Triton binds and
    specializes the arguments, compiles, and returns the compiled kernel). Its own launcher binds
    nothing again: no JIT binding and cache look-up at each launch (host time a launch)."""
    key = (kernel, data.device.index, *consts.values())
    compiled = _COMPILED.get(key)
    if compiled is None:
        compiled = _COMPILED[key] = kernel.warmup(data, **consts, grid=(programs,), num_warps=4)
    return compiled


_COMPILED = {}  # (kernel, device index, constants) -> the compiled kernel


def _readable(t: torch.Tensor, device: torch.device, interpret: bool) -> bool:
    """The kernel reads t by address: contiguous, and on the launch device or in pinned host memory
    (interpreted: on the CPU)."""
    if not t.is_contiguous():
        return False
    if interpret:
        return t.is_cpu
    if t.is_cuda:  # its flag and index, not `t.device`: a torch.device made per buffer costs host time
        return device.type == "cuda" and t.get_device() == device.index
    return t.device == device or (t.is_cpu and t.is_pinned())


def _unread_sums(parts, fields, readable, n) -> torch.Tensor | None:
    """int64 [n, CHECKED_FIELDS] on the host: the torch sums of the buffers the kernel does not
    read (None when it reads every buffer that is not left out)."""
    if all(ok or t is None for (bufs, _), r in zip(parts, readable) for t, ok in zip(bufs, r)):
        return None
    out = torch.zeros(n, CHECKED_FIELDS, dtype=torch.int64)
    at = 0
    for (bufs, counts), r in zip(parts, readable):
        m = counts.shape[0]
        for f, (field, buf, ok) in enumerate(zip(fields, bufs, r)):
            per = None if ok else field_sums(f, field, buf, counts)
            if per is not None:
                out[at:at + m, field_slot(f)] += per.cpu()
        at += m
    return out


def launch_block(parts: list, fields: tuple, readable: list | None, chunk: int,
                 alloc=None) -> tuple[np.ndarray, int, dict]:
    """The kernel's input as one int64 array, its number of programs, and the offsets of the array's
    parts with `samples`, the kernel's SAMPLES (`triton_checksum` documents the layout; the header
    holds the offsets and the sizes the kernel reads). Buffer b is field b % F of part b // F; the
    kernel reads it when `readable[part][field]` (a buffer it does not read may be None; readable
    None: every buffer that is not None), in programs of `chunk` words over its bytes. The host
    writes what it holds: two reads a buffer (address, size) into the rows laid out once per
    layout and part sizes (`_block_plan`), the header, programs, rows and field rows packed in one
    call, then the counts and the zero output words (they come last) as two array writes, whatever
    the window's micro-batches and samples; the device cuts the work. `alloc(size)` gives the int64
    array to fill (default np.empty). parts: at least one."""
    fields = tuple(fields)
    nf = len(fields)
    for p, (held, _) in enumerate(parts):
        if len(held) != nf:
            raise ValueError(f"part {p} has {len(held)} buffers for {nf} fields")
    tables = [c.table for _, c in parts]
    adds, divs, bufs, rows, head, at, pack, samples = _block_plan(fields, tuple(map(len, tables)), chunk)
    bufs = list(bufs)
    flat = [t for held, _ in parts for t in held]
    bufs[0::4] = [0 if t is None else t.data_ptr() for t in flat]
    if readable is None:
        bufs[1::4] = sizes = [0 if t is None else t.nbytes for t in flat]
    else:
        bufs[1::4] = sizes = [t.nbytes if ok else 0 for t, ok in zip(flat, itertools.chain.from_iterable(readable))]
    # a buffer's programs: ceil(words / chunk) = (bytes + w (chunk - 1)) // (w chunk), w its word
    # width (a last partial word is not read), with no Python step a buffer
    first = list(itertools.accumulate(map(operator.floordiv, map(operator.add, sizes, adds), divs), initial=0))
    out = (alloc or (lambda k: np.empty(k, dtype=np.int64)))(at["out_at"] + samples * CHECKED_FIELDS)
    # everything the host knows as Python ints in one call; the counts and the zero sums as arrays
    pack.pack_into(out, 0, *head, *first, *bufs, *rows)
    out[at["counts_at"]:at["out_at"]] = np.concatenate(tables).ravel() if len(tables) > 1 else tables[0].ravel()
    out[at["out_at"]:] = 0
    return out, first[-1], at


def _block_plan(fields: tuple, samples: tuple, chunk: int) -> tuple:
    """What a launch block holds for `fields` over parts of `samples` samples each, whatever their
    buffers: every buffer's w (chunk - 1) and w chunk (w: its word width; `launch_block` counts its
    programs with them), the buffer rows with their first sample and samples filled in (address
    and bytes: 0), the field rows, the header, the packing of the header, programs, rows and field
    rows, the offsets (`launch_block`'s mapping) and the window's samples, all of it read-only. The
    same every window of a layout and part sizes: made once (cached below)."""
    rows, widths = _field_constants(fields)
    nf, parts = len(fields), len(samples)
    buffers, row0 = nf * parts, [0, *itertools.accumulate(samples)]
    bufs = [0] * (4 * buffers)  # rows (address, bytes, first sample, samples), filled column by column
    bufs[2::4] = [r for r in row0[:-1] for _ in range(nf)]
    bufs[3::4] = [m for m in samples for _ in range(nf)]
    at = {"programs_at": _HEADER}
    at["bufs_at"] = _HEADER + buffers + 1
    at["fields_at"] = at["bufs_at"] + 4 * buffers
    at["counts_at"] = at["fields_at"] + len(rows)
    at["out_at"] = at["counts_at"] + row0[-1] * len(COLUMNS)
    head = (buffers, nf, *at.values(), len(COLUMNS))
    # SAMPLES a power of two, at least 16: one compiled variant for most windows
    at["samples"] = 1 << (max(16, *samples) - 1).bit_length()
    pack = struct.Struct(f"={at['counts_at']}q")
    widths = widths * parts
    return (tuple(w * (chunk - 1) for w in widths), tuple(w * chunk for w in widths), tuple(bufs), rows, head,
            types.MappingProxyType(at), pack, row0[-1])


# the layouts of the windows seen last (layouts and part sizes without end: the old ones are forgotten);
# a plain function wrapped, not a decorator: mutmut mutates no decorated function
_block_plan = functools.lru_cache(maxsize=256)(_block_plan)


_HEADER = 8  # the block's header words: buffers, fields, the five offsets, the counts' columns
_KINDS = {"dense": 0, "row": 1, "image": 1, "list": 2}
_ENTRY_COLUMN = {"row": COLUMNS.index("rows"), "image": COLUMNS.index("images"), "list": COLUMNS.index("list_bytes")}


def _field_constants(fields: tuple) -> tuple:
    """The kernel's rows of `fields` [F, 8], flat, (kind, pre, unit, word width, salt, checksum slot,
    counts column of its entries (a dense field's: any), 0) and their word widths. Its one caller
    is `_block_plan`, whose result is cached."""
    rows = np.array([[_KINDS[f.kind], f.pre, f.unit, word_width(f.kind, f.unit), field_salt(i), field_slot(i), _ENTRY_COLUMN.get(f.kind, 0), 0] for i, f in enumerate(fields)],
                    dtype=np.int64).reshape(len(fields), 8)
    return tuple(rows.ravel().tolist()), tuple(rows[:, 3].tolist())


_HELD = KeepAlive()  # one per process: every round and thread (an overlap worker too) launches
