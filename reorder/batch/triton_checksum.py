"""The Triton kernel of the self-check's checksums on CUDA (`reorder.batch.checksum.kernel_checksums`):
one launch sums every (sample, field) of a window. This module imports triton at the top (Triton's
interpreter needs `triton.language` among a kernel's module globals); only `checksum` imports it,
and only for a CUDA launch or the interpreter.

Input (built by `checksum.launch_table`), one int64 array: rows [programs, 2] of (piece row, first
word), then from element `rows_at` on rows [pieces, 8] of (absolute address, entry stride in bytes,
words per entry, words, word width, salt, output index, 0). A piece is one sample's entries of one
field: `words / words per entry` entries of `words per entry` words of `width` bytes, entry e
starting at address + e * stride. Program p sums words [first, min(first + CHUNK, words)) of its
piece, each word w at byte c of entry e as (w + 1) * mix(c) * mix(e + salt), and adds the sum to
out[output index] atomically (integer addition: the order of the additions changes no bit).
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


# rows_at changes with every table: specialized (Triton's default for integers: multiple of 16 or
# not, equal to 1), it would compile a new variant mid-run the first time each case appears
@triton.jit(do_not_specialize=["rows_at"])
def checksum_pieces(table, rows_at, out, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """One program per block row: sum up to CHUNK words of its piece, BLOCK lanes at a time, in
    the piece's word width, and add the sum to its output word."""
    pid = tl.program_id(0).to(tl.int64)
    piece = tl.load(table + 2 * pid)
    first = tl.load(table + 2 * pid + 1)
    row = table + rows_at + 8 * piece
    addr = tl.load(row)
    stride = tl.load(row + 1)
    wpe = tl.load(row + 2)
    count = tl.minimum(tl.load(row + 3) - first, CHUNK)
    width = tl.load(row + 4)
    salt = tl.load(row + 5)
    dst = out + tl.load(row + 6)
    if width == 8:
        tl.atomic_add(dst, _piece_sum(addr, stride, wpe, salt, first, count, tl.int64, 8, BLOCK), sem="relaxed")
    elif width == 4:
        tl.atomic_add(dst, _piece_sum(addr, stride, wpe, salt, first, count, tl.int32, 4, BLOCK), sem="relaxed")
    elif width == 2:
        tl.atomic_add(dst, _piece_sum(addr, stride, wpe, salt, first, count, tl.int16, 2, BLOCK), sem="relaxed")
    else:
        tl.atomic_add(dst, _piece_sum(addr, stride, wpe, salt, first, count, tl.uint8, 1, BLOCK), sem="relaxed")
