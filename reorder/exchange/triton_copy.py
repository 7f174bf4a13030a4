"""The Triton kernel of `reorder.exchange.executors.TritonExecutor`. This module imports triton at
the top (Triton's interpreter needs `triton.language` among a kernel's module globals, so the kernel
cannot be defined inside a function); only `TritonExecutor.__init__` imports it.

Input (built by `executors.launch_table`), one int64 array: rows [programs, 2] of (segment row,
byte start), then from element `rows_at` on rows [n, 3] of (absolute source address, absolute
destination address, nbytes): program p copies bytes [start, min(start + BLOCK, nbytes)) of its
segment. Addresses are raw int64s cast to pointers, so sources may be pinned host memory as well as
device memory.
"""

import triton
import triton.language as tl


@triton.jit
def _copy_run(src, dst, length, WTYPE: tl.constexpr, WORD: tl.constexpr, ALIGN: tl.constexpr,
              BLOCK: tl.constexpr):
    """Copy `length` (<= BLOCK) bytes from address src to address dst, given src = dst (mod ALIGN):
    the bytes before the first ALIGN boundary of src and after the last one byte by byte, the body
    between as WORD-byte words of type WTYPE (ALIGN-aligned on both sides)."""
    head = tl.minimum((ALIGN - src % ALIGN) % ALIGN, length)
    body = (length - head) // ALIGN * ALIGN
    w = tl.arange(0, BLOCK // WORD)
    if head == 0 and body == BLOCK:  # a whole aligned block (most of a big segment): no masks, full-width vectors
        fs = tl.multiple_of(tl.cast(src, tl.pointer_type(WTYPE)), ALIGN)
        fd = tl.multiple_of(tl.cast(dst, tl.pointer_type(WTYPE)), ALIGN)
        tl.store(fd + w, tl.load(fs + w))
        return
    # the body is a whole number of ALIGN-byte vectors: the hints let ALIGN 16 load 16 bytes at once
    words = tl.multiple_of(body // WORD, ALIGN // WORD)
    ws = tl.multiple_of(tl.cast(src + head, tl.pointer_type(WTYPE)), ALIGN)
    wd = tl.multiple_of(tl.cast(dst + head, tl.pointer_type(WTYPE)), ALIGN)
    tl.store(wd + w, tl.load(ws + w, mask=w < words), mask=w < words)
    # head bytes in lanes [0, ALIGN), tail bytes in lanes [ALIGN, 2 ALIGN)
    e = tl.arange(0, 2 * ALIGN)
    off = tl.where(e < ALIGN, e, head + body + e - ALIGN)
    m = tl.where(e < ALIGN, e < head, e - ALIGN < length - head - body)
    bs = tl.cast(src, tl.pointer_type(tl.uint8))
    bd = tl.cast(dst, tl.pointer_type(tl.uint8))
    tl.store(bd + off, tl.load(bs + off, mask=m), mask=m)


# rows_at changes with every table: specialized (Triton's default for integers: multiple of 16 or
# not, equal to 1), it would compile a new variant mid-run the first time each case appears
@triton.jit(do_not_specialize=["rows_at"])
def copy_segments(blocks, rows_at, BLOCK: tl.constexpr):
    """One program per block row: copy its bytes with the widest word that the relative alignment of
    source and destination allows (blocks start at multiples of BLOCK inside a segment, so a block's
    source and destination are as (mis)aligned relative to each other as its segment's)."""
    pid = tl.program_id(0).to(tl.int64)
    table = blocks + rows_at
    seg = tl.load(blocks + 2 * pid)
    start = tl.load(blocks + 2 * pid + 1)
    src = tl.load(table + 3 * seg) + start
    dst = tl.load(table + 3 * seg + 1) + start
    length = tl.minimum(tl.load(table + 3 * seg + 2) - start, BLOCK)
    rel = src ^ dst
    if rel % 16 == 0:
        _copy_run(src, dst, length, tl.int64, 8, 16, BLOCK)
    elif rel % 4 == 0:
        _copy_run(src, dst, length, tl.int32, 4, 4, BLOCK)
    elif rel % 2 == 0:
        _copy_run(src, dst, length, tl.int16, 2, 2, BLOCK)
    else:
        _copy_run(src, dst, length, tl.uint8, 1, 1, BLOCK)
