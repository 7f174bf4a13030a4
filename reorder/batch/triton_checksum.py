"""The Triton kernel of the self-check's checksums on CUDA (`reorder.batch.checksum.kernel_checksums`):
one launch sums every (sample, field) of a window. This module imports triton at the top (Triton's
interpreter needs `triton.language` among a kernel's module globals); only `checksum` imports it,
and only for a CUDA launch or the interpreter.

Input (built by `checksum.launch_block`), one int64 array, the kernel's only runtime argument: it is
compiled once and launched through its compiled launcher, which binds nothing again, so an integer
argument would keep the specialization of the window it was compiled for (and the JIT's binding of
each argument costs host time a launch):
- from 0: the header [8]: buffers, F (fields), the offsets `programs_at`, `bufs_at`, `fields_at`,
  `counts_at`, `out_at` of the parts below, and the counts' columns C;
- `programs_at`: the first program of each buffer, then the number of programs ([buffers + 1]);
  buffer b is field b % F of part b // F, and takes programs [first[b], first[b + 1]), one per
  CHUNK words;
- `bufs_at`: rows [buffers, 4] of (absolute address, bytes, first sample, samples);
- `fields_at`: rows [F, 8] of (kind: 0 dense, 1 per row or image, 2 list; leading entries `pre`,
  entry bytes `unit`, word width, salt, checksum slot, counts column, 0);
- `counts_at`: [samples, C] the counts of every sample (`SampleCounts`, parts one after the other);
- `out_at`: [samples, SLOTS] the sums, zero, that the programs add to.

A program finds its buffer (a binary search over the first programs), then the runs of its CHUNK
words: a dense field's rows (entry e of sample j: `unit` bytes at (e * n + j) * unit) or a ragged
field's samples (their entries one after the other; where each starts, the program sums up from
the part's counts; a list sample is one entry of its bytes). Each run is part of one sample's
piece: its words w, at byte c of entry e, add (w + 1) * mix(c) * mix(e + salt) to the sample's sum
of the field's slot, atomically (integer addition: the order of the additions changes no bit). No
byte at or past a buffer's size is read: a buffer shorter than its counts gives other sums. So the
host writes what it holds (counts and addresses) and the device cuts the work.
"""

import triton
import triton.language as tl

_MIX = tl.constexpr(-7046029254386353131)  # 0x9E3779B97F4A7C15 as a signed int64, as in checksum.py


@triton.jit
def _mix(x):
    """checksum.mix on int64 lanes: multiply (wrapping), fold the high bits down (arithmetic shift,
    as torch's >> on int64), set the low bit."""
    return _folded(x * _MIX)


@triton.jit
def _folded(h):
    """`_mix`'s fold of h = x * 0x9E3779B97F4A7C15 (a running product: the callers step it by
    addition instead of multiplying x again)."""
    return (h ^ (h >> 29)) | 1


@triton.jit
def _piece_sum(addr, stride, wpe, salt, first, count, WTYPE: tl.constexpr, W: tl.constexpr,
               BLOCK: tl.constexpr):
    """The sum over `count` words from word `first` of a piece of W-byte words (the wrapping int64
    sum of (w + 1) * mix(c) * mix(e + salt)). A word is read as checksum.py reads it: W = 1
    unsigned, wider ones signed. With address and stride multiples of W the words are loaded as
    WTYPE; otherwise byte by byte, little-endian, then sign-extended."""
    lane = tl.arange(0, BLOCK)
    k = first + lane
    e = k // wpe  # entry and word in the entry of each lane, advanced by BLOCK words per step
    c = k - e * wpe
    step_e = BLOCK // wpe
    step_c = BLOCK - step_e * wpe
    aligned = (addr % W == 0) & (stride % W == 0)
    typed = tl.cast(addr, tl.pointer_type(WTYPE))
    raw = tl.cast(addr, tl.pointer_type(tl.uint8))
    acc = tl.zeros([BLOCK], tl.int64)
    for at in range(0, count, BLOCK):
        m = lane < count - at
        if aligned:
            w = tl.load(typed + e * (stride // W) + c, mask=m, other=0).to(tl.int64)
        else:
            off = e * stride + c * W
            w = tl.zeros([BLOCK], tl.int64)
            for b in tl.static_range(W):
                w = w | (tl.load(raw + off + b, mask=m, other=0).to(tl.int64) << (8 * b))
            if W > 1 and W < 8:
                w = (w << (64 - 8 * W)) >> (64 - 8 * W)
        acc += tl.where(m, (w + 1) * _mix(c * W) * _mix(e + salt), 0)
        c += step_c
        e += step_e
        wrap = c >= wpe
        c = tl.where(wrap, c - wpe, c)
        e = tl.where(wrap, e + 1, e)
    return tl.sum(acc, axis=0)


@triton.jit
def _entry_sum(addr, stride, wpe, salt, first, count, WTYPE: tl.constexpr, W: tl.constexpr, BLOCK: tl.constexpr):
    """`_piece_sum` of words all in one entry, aligned: mix(e + salt) is the same for each, so it
    multiplies their sum once; a lane steps its address and its column's product by addition, and
    loads its next word before it sums this one (two loads in flight a lane, for a kernel that may
    wait on memory more than it computes: not yet timed on a GPU)."""
    lane = tl.arange(0, BLOCK).to(tl.int64)  # int64: the products wrap in 64 bits
    e = first // wpe
    c = first - e * wpe + lane
    at = tl.cast(addr, tl.pointer_type(WTYPE)) + e * (stride // W) + c
    h = c * W * _MIX
    step = tl.full([], BLOCK * W, tl.int64) * _MIX
    acc = tl.zeros([BLOCK], tl.int64)
    m = lane < count
    w = tl.load(at, mask=m, other=0)
    for done in range(BLOCK, count + BLOCK, BLOCK):
        m_next = lane < count - done
        w_next = tl.load(at + BLOCK, mask=m_next, other=0)  # all masked after the last: no read
        acc += tl.where(m, (w.to(tl.int64) + 1) * _folded(h), 0)
        at += BLOCK
        h += step
        m, w = m_next, w_next
    return tl.sum(acc, axis=0) * _mix(e + salt)


@triton.jit
def _tile_sum(addr, stride, wpe, salt, e0, e1, WTYPE: tl.constexpr, W: tl.constexpr, BLOCK: tl.constexpr,
              COLS: tl.constexpr):
    """`_piece_sum` of whole entries e0 .. e1 - 1, aligned, in tiles of [BLOCK // COLS entries, COLS
    words]: for each COLS columns, a lane adds (w + 1) * mix(e + salt) down its column, and
    multiplies that sum by mix(c * W) once. A tile row's address and entry product step by addition
    (one multiply a word), and a lane loads its next rows' words before it sums these
    (`_entry_sum`)."""
    ROWS: tl.constexpr = BLOCK // COLS
    r = tl.arange(0, ROWS).to(tl.int64)[:, None]  # int64: the products wrap in 64 bits
    col = tl.arange(0, COLS).to(tl.int64)
    pitch = stride // W
    step_h = tl.full([], ROWS, tl.int64) * _MIX
    acc = tl.zeros([COLS], tl.int64)
    for c0 in range(0, wpe, COLS):
        c = c0 + col[None, :]
        ok = c < wpe  # a column past the entry's last would be the next entry's
        e = e0 + r
        row = tl.cast(addr, tl.pointer_type(WTYPE)) + e * pitch
        h = (e + salt) * _MIX
        m = ok & (e < e1)
        w = tl.load(row + c, mask=m, other=0)
        down = tl.zeros([ROWS, COLS], tl.int64)
        for _ in range(e0, e1, ROWS):
            e += ROWS
            row += ROWS * pitch
            m_next = ok & (e < e1)
            w_next = tl.load(row + c, mask=m_next, other=0)  # all masked after the last rows: no read
            down += tl.where(m, (w.to(tl.int64) + 1) * _folded(h), 0)
            h += step_h
            m, w = m_next, w_next
        acc += tl.sum(down, axis=0) * _mix((c0 + col) * W)
    return tl.sum(acc, axis=0)


@triton.jit
def _shaped_sum(addr, stride, wpe, salt, first, count, WTYPE: tl.constexpr, W: tl.constexpr, BLOCK: tl.constexpr):
    """`_piece_sum`'s sum by the cheapest path for the piece's shape, where it is word-aligned: one
    entry (`_entry_sum`); or, where its whole entries fill at least a tile's rows and are at least
    half a tile wide, those in tiles (`_tile_sum`) and the parts of entries before and after them by
    `_entry_sum`; else `_piece_sum`."""
    COLS: tl.constexpr = 64 if BLOCK >= 256 else BLOCK // 4  # tiles of 8 x 64 at BLOCK 512, 4 x 4 at 16
    aligned = (addr % W == 0) & (stride % W == 0) & (wpe > 0)
    per = tl.maximum(wpe, 1)
    end = first + count
    e0 = (first + per - 1) // per  # the whole entries: e0 .. e1 - 1
    e1 = end // per
    if aligned & ((first + count - 1) // per == first // per):
        s = _entry_sum(addr, stride, wpe, salt, first, count, WTYPE, W, BLOCK)
    elif aligned & (e1 - e0 >= BLOCK // COLS) & (2 * wpe >= COLS):
        s = _tile_sum(addr, stride, wpe, salt, e0, e1, WTYPE, W, BLOCK, COLS)
        if first < e0 * wpe:
            s += _entry_sum(addr, stride, wpe, salt, first, e0 * wpe - first, WTYPE, W, BLOCK)
        if e1 * wpe < end:
            s += _entry_sum(addr, stride, wpe, salt, e1 * wpe, end - e1 * wpe, WTYPE, W, BLOCK)
    else:
        s = _piece_sum(addr, stride, wpe, salt, first, count, WTYPE, W, BLOCK)
    return s


@triton.jit
def _width_sum(addr, stride, wpe, salt, first, count, WTYPE: tl.constexpr, W: tl.constexpr, BLOCK: tl.constexpr,
               SHAPED: tl.constexpr):
    """The sum of the library's kernel (`_piece_sum`), or of the candidate's (SHAPED: `_shaped_sum`)."""
    if SHAPED:
        s = _shaped_sum(addr, stride, wpe, salt, first, count, WTYPE, W, BLOCK)
    else:
        s = _piece_sum(addr, stride, wpe, salt, first, count, WTYPE, W, BLOCK)
    return s


@triton.jit
def _run_sum(addr, stride, wpe, salt, first, count, width, BLOCK: tl.constexpr, SHAPED: tl.constexpr):
    """`_piece_sum` (SHAPED: `_shaped_sum`) in the field's word width."""
    if width == 8:
        s = _width_sum(addr, stride, wpe, salt, first, count, tl.int64, 8, BLOCK, SHAPED)
    elif width == 4:
        s = _width_sum(addr, stride, wpe, salt, first, count, tl.int32, 4, BLOCK, SHAPED)
    elif width == 2:
        s = _width_sum(addr, stride, wpe, salt, first, count, tl.int16, 2, BLOCK, SHAPED)
    else:
        s = _width_sum(addr, stride, wpe, salt, first, count, tl.uint8, 1, BLOCK, SHAPED)
    return s


@triton.jit
def checksum_window(block, SLOTS: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr, SAMPLES: tl.constexpr):
    """The block's programs, one per CHUNK words of a buffer, each summing its runs (the parts of
    samples' pieces it holds), BLOCK lanes at a time, and adding each run's sum to its sample's
    output word. Launched program k takes programs k, k + grid, k + 2 grid, ... below the block's
    number of programs: one each when the grid is that number, and a grid fixed whatever the
    window (a captured CUDA graph's) covers them all. SAMPLES: a power of two, at least every
    part's samples."""
    _programs(block, SLOTS, CHUNK, BLOCK, SAMPLES, False)


@triton.jit
def checksum_window_shaped(block, SLOTS: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                           SAMPLES: tl.constexpr):
    """`checksum_window` with the sums of aligned pieces taken by their shape (`_shaped_sum`): fewer
    integer operations a word. The same sums, bit for bit. A candidate: `bench/checksum_kernel.py`
    and `bench/verify_cost.py --paths kernel,shaped` time it against `checksum_window`; the library
    launches `checksum_window`."""
    _programs(block, SLOTS, CHUNK, BLOCK, SAMPLES, True)


@triton.jit
def _programs(block, SLOTS: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr, SAMPLES: tl.constexpr,
              SHAPED: tl.constexpr):
    total = tl.load(block + tl.load(block + 2) + tl.load(block))  # the last buffer's end: every program
    for pid in range(tl.program_id(0).to(tl.int64), total, tl.num_programs(0).to(tl.int64)):
        _program(block, pid, SLOTS, CHUNK, BLOCK, SAMPLES, SHAPED)


@triton.jit
def _program(block, pid, SLOTS: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr, SAMPLES: tl.constexpr,
             SHAPED: tl.constexpr):
    """Program `pid` of the block: find its buffer, then sum its runs into their samples' words."""
    buffers = tl.load(block)
    fields = tl.load(block + 1)
    first = block + tl.load(block + 2)  # each buffer's first program
    bufs_at = tl.load(block + 3)
    fields_at = tl.load(block + 4)
    counts_at = tl.load(block + 5)
    out_at = tl.load(block + 6)
    columns = tl.load(block + 7)
    lo = pid * 0  # the last buffer whose first program is at most pid
    hi = lo + buffers
    while hi - lo > 1:
        mid = (lo + hi) // 2
        below = tl.load(first + mid) <= pid
        lo = tl.where(below, mid, lo)
        hi = tl.where(below, hi, mid)
    buf = block + bufs_at + 4 * lo
    addr = tl.load(buf)
    row0 = tl.load(buf + 2)
    n = tl.load(buf + 3)
    fld = block + fields_at + 8 * (lo % fields)
    kind = tl.load(fld)
    pre = tl.load(fld + 1)
    unit = tl.load(fld + 2)
    width = tl.load(fld + 3)
    salt = tl.load(fld + 4)
    slot = tl.load(fld + 5)
    column = tl.load(fld + 6)
    w0 = (pid - tl.load(first + lo)) * CHUNK
    w1 = tl.minimum(w0 + CHUNK, tl.load(buf + 1) // width)  # no word past the buffer's end
    out = block + out_at + slot
    if kind == 0:  # dense: rows of `unit` bytes, entry-major: row r is entry r // n of sample r % n
        wpr = unit // width
        r = w0 // wpr
        while (r * wpr < w1) & (r < pre * n):
            j = r % n
            at = tl.maximum(w0, r * wpr)
            count = tl.minimum(w1, (r + 1) * wpr) - at
            s = _run_sum(addr + j * unit, n * unit, wpr, salt, (r // n) * wpr + at - r * wpr, count, width, BLOCK,
                         SHAPED)
            tl.atomic_add(out + (row0 + j) * SLOTS, s, sem="relaxed")
            r += 1
    else:  # per row or image (entries of `unit` bytes), or list (one entry: the sample's bytes)
        listed = kind == 2
        per = tl.where(listed, 1, unit // width)  # words per count
        lane = tl.arange(0, SAMPLES)
        words = tl.load(block + counts_at + (row0 + lane) * columns + column, mask=lane < n, other=0) * per
        ends = tl.cumsum(words, 0)
        starts = ends - words
        j = tl.sum(((ends <= w0) & (lane < n)).to(tl.int64), 0)  # the first sample ending past w0
        start = tl.sum(tl.where(lane == j, starts, 0), 0)
        while (j < n) & (start < w1):
            size = tl.sum(tl.where(lane == j, words, 0), 0)
            at = tl.maximum(w0, start)
            count = tl.minimum(w1, start + size) - at
            if count > 0:
                wpe = tl.where(listed, size, per)
                s = _run_sum(addr + start * width, unit, wpe, salt, at - start, count, width, BLOCK, SHAPED)
                tl.atomic_add(out + (row0 + j) * SLOTS, s, sem="relaxed")
            j += 1
            start += size


# the kernels by the names the benchmarks and GPU checks take: the library's (launched by `checksum`)
# and the candidate
KERNELS = {"window": checksum_window, "shaped": checksum_window_shaped}
