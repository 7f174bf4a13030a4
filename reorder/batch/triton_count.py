"""The Triton kernel of counting on CUDA (`reorder.batch.counting`): one launch counts a micro-batch.
This module imports triton at the top (Triton's interpreter needs `triton.language` among a
kernel's module globals); only `counting` imports it, and only for CUDA tensors or the interpreter.
"""

import triton
import triton.language as tl


# The integers change with the micro-batch (n_thw) or the model (S, the token ids), and grid_thw may be
# any view: specialized (Triton's default: multiple of 16 or not, equal to 1; 16-byte aligned or
# not), each new case would compile a variant mid-run. The dtypes, the flags and the alignment of
# ids, mask and out stay specialized (aligned loads; a caller's misaligned view compiles once).
@triton.jit(do_not_specialize=["thw", "S", "n_thw", "image_id", "start_id"])
def count_rows(ids, mask, thw, out, S, n_thw, image_id, start_id, HAS_MASK: tl.constexpr,
               HAS_THW: tl.constexpr, BLOCK: tl.constexpr):
    """Program b counts row b of the contiguous `ids` [B, S] into out[4b : 4b + 4]: image
    placeholders (== image_id), vision starts (== start_id), and with HAS_MASK the entries of row b
    of the contiguous `mask` [B, S] equal to 1 and equal to 0 (else 0, 0). With HAS_THW, program 0
    also copies the `n_thw` integers of the contiguous `thw` to out[4B :] as int64."""
    b = tl.program_id(0).to(tl.int64)
    row = b * S
    lane = tl.arange(0, BLOCK)
    placeholders = tl.zeros([BLOCK], tl.int32)
    starts = tl.zeros([BLOCK], tl.int32)
    ones = tl.zeros([BLOCK], tl.int32)
    zeros = tl.zeros([BLOCK], tl.int32)
    for at in range(0, S, BLOCK):
        o = at + lane
        inside = o < S
        t = tl.load(ids + row + o, mask=inside, other=0)
        placeholders += ((t == image_id) & inside).to(tl.int32)
        starts += ((t == start_id) & inside).to(tl.int32)
        if HAS_MASK:
            a = tl.load(mask + row + o, mask=inside, other=0)
            ones += ((a == 1) & inside).to(tl.int32)
            zeros += ((a == 0) & inside).to(tl.int32)
    tl.store(out + 4 * b, tl.sum(placeholders, axis=0).to(tl.int64))
    tl.store(out + 4 * b + 1, tl.sum(starts, axis=0).to(tl.int64))
    tl.store(out + 4 * b + 2, tl.sum(ones, axis=0).to(tl.int64))
    tl.store(out + 4 * b + 3, tl.sum(zeros, axis=0).to(tl.int64))
    if HAS_THW:
        if b == 0:
            tail = out + 4 * tl.num_programs(0).to(tl.int64)
            for at in range(0, n_thw, BLOCK):
                o = at + lane
                tl.store(tail + o, tl.load(thw + o, mask=o < n_thw, other=0).to(tl.int64), mask=o < n_thw)
