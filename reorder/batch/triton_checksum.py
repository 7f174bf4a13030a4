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
    h = x * _MIX
    return (h ^ (h >> 29)) | 1


@triton.jit
def _piece_sum(addr, stride, wpe, salt, first, count, WTYPE: tl.constexpr, W: tl.constexpr,
               BLOCK: tl.constexpr):
    """The sum over `count` words from word `first` of a piece of W-byte words (the wrapping int64
    sum of (w + 1) * mix(c) * mix(e + salt)). A word is read as checksum.py reads it: W = 1
    unsigned, wider ones signed. With address and stride multiples of W the words are loaded as
    WTYPE; otherwise byte by byte, little-endian, then sign-extended. Aligned, the next BLOCK words
    are loaded before these are summed: each lane has two loads in flight, where one kept the H200
    waiting on memory (on an H200 a window of 8 micro-batches summed in 0.451 ms against 0.483 with
    one, `bench/checksum_kernel.py`; 128 registers a lane against 151 compiled for sm_90)."""
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
    if aligned:
        ws = stride // W
        m = lane < count
        w = tl.load(typed + e * ws + c, mask=m, other=0)
        for at in range(0, count, BLOCK):
            c2 = c + step_c
            e2 = e + step_e
            wrap = c2 >= wpe
            c2 = tl.where(wrap, c2 - wpe, c2)
            e2 = tl.where(wrap, e2 + 1, e2)
            m2 = lane < count - at - BLOCK
            w2 = tl.load(typed + e2 * ws + c2, mask=m2, other=0)
            acc += tl.where(m, (w.to(tl.int64) + 1) * _mix(c * W) * _mix(e + salt), 0)
            w, c, e, m = w2, c2, e2, m2
    else:
        for at in range(0, count, BLOCK):
            m = lane < count - at
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
def _run_sum(addr, stride, wpe, salt, first, count, width, BLOCK: tl.constexpr):
    """`_piece_sum` in the field's word width."""
    if width == 8:
        s = _piece_sum(addr, stride, wpe, salt, first, count, tl.int64, 8, BLOCK)
    elif width == 4:
        s = _piece_sum(addr, stride, wpe, salt, first, count, tl.int32, 4, BLOCK)
    elif width == 2:
        s = _piece_sum(addr, stride, wpe, salt, first, count, tl.int16, 2, BLOCK)
    else:
        s = _piece_sum(addr, stride, wpe, salt, first, count, tl.uint8, 1, BLOCK)
    return s


@triton.jit
def checksum_window(block, SLOTS: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr, SAMPLES: tl.constexpr):
    """The block's programs, one per CHUNK words of a buffer, each summing its runs (the parts of
    samples' pieces it holds), BLOCK lanes at a time, and adding each run's sum to its sample's
    output word. Launched program k takes programs k, k + grid, k + 2 grid, ... below the block's
    number of programs: one each when the grid is that number, and a grid fixed whatever the
    window (a captured CUDA graph's) covers them all. SAMPLES: a power of two, at least every
    part's samples."""
    total = tl.load(block + tl.load(block + 2) + tl.load(block))  # the last buffer's end: every program
    for pid in range(tl.program_id(0).to(tl.int64), total, tl.num_programs(0).to(tl.int64)):
        _program(block, pid, SLOTS, CHUNK, BLOCK, SAMPLES)


@triton.jit
def _program(block, pid, SLOTS: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr, SAMPLES: tl.constexpr):
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
            s = _run_sum(addr + j * unit, n * unit, wpr, salt, (r // n) * wpr + at - r * wpr, count, width, BLOCK)
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
                s = _run_sum(addr + start * width, unit, wpe, salt, at - start, count, width, BLOCK)
                tl.atomic_add(out + (row0 + j) * SLOTS, s, sem="relaxed")
            j += 1
            start += size
