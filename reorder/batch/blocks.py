"""Micro-batches as byte buffers and back: what an executor reads and what it writes.

`byte_fields(layout)` is the layout as numbers (`ByteField`s, in the order of the data wire
format); `field_buffers` gives one shard's buffers in that order (each field's contiguous bytes,
plus its pickled list entries); `view_block` turns an output block written in the wire format back
into a shard of typed views (no copy; lists unpickled from the block's list region).
"""

from __future__ import annotations

import math
import pickle

import numpy as np
import torch

from reorder.batch.layout import BatchLayout, DenseField, Shard
from reorder.plan.counts import SampleCounts
from reorder.plan.moves import ByteField


def byte_fields(layout: BatchLayout) -> tuple:
    """The layout's fields as bytes: dense fields, then per-row and per-image fields, in layout
    order, then one "list" field for the per-sample list entries (when the batch has lists)."""
    out = [ByteField("dense", *_pre_unit(f)) for f in layout.dense]
    out += [ByteField(f.per, 1, f.entry_bytes) for f in layout.ragged]
    if layout.lists:
        out.append(ByteField("list", 1, 1))
    return tuple(out)


def unit_bytes(layout: BatchLayout) -> tuple:
    """(bytes of one sample's dense fields, of one patch row, of one image's per-image fields)."""
    return layout.dense_sample_bytes, layout.row_bytes, layout.image_bytes


def _pre_unit(f: DenseField) -> tuple:
    """(entries before the batch dim, bytes of one sample per such entry)."""
    return math.prod(f.sample_shape[:f.batch_dim]), math.prod(f.sample_shape[f.batch_dim:]) * f.dtype.itemsize


def field_buffers(layout: BatchLayout, shard: Shard, blobs: list) -> list:
    """The shard's buffers in `byte_fields` order: each field's tensor, contiguous (a copy only
    when it is not; executors read any contiguous tensor as its bytes), and the concatenated
    pickled list entries `blobs` (a host uint8 tensor)."""
    out = [shard.dense[f.path].contiguous() for f in layout.dense]
    out += [shard.ragged[f.path].contiguous() for f in layout.ragged]
    if layout.lists:
        data = b"".join(blobs)
        out.append(torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8))
    return out


def _shard(layout: BatchLayout, counts: SampleCounts, tensor) -> Shard:
    """A shard of the samples counted by `counts` [n] whose every field is `tensor(dtype, shape)`,
    made in `byte_fields` order (dense fields, then per-row and per-image ones), with the samples'
    row and image counts."""
    n = counts.shape[0]
    shard = Shard(n=n)
    for f in layout.dense:
        shard.dense[f.path] = tensor(f.dtype, f.full_shape(n))
    totals = {"row": int(counts.rows.sum()), "image": int(counts.images.sum())}
    for f in layout.ragged:
        shard.ragged[f.path] = tensor(f.dtype, (totals[f.per], *f.entry_shape))
    if layout.ragged:
        shard.row_counts, shard.image_counts = counts.rows.copy(), counts.images.copy()
    return shard


def empty_shard(layout: BatchLayout, counts: SampleCounts, device: torch.device) -> tuple:
    """(shard, buffers): a shard of the samples counted by `counts` [n] with every field allocated,
    uninitialized, on `device`, and its buffers in `byte_fields` order, to be written by an
    executor (laid out like `field_buffers`; the list field is a uint8 buffer of the samples'
    pickled list bytes, decoded by `read_lists` once written)."""
    buffers = []

    def allocate(dtype, shape):
        buffers.append(torch.empty(shape, dtype=dtype, device=device))
        return buffers[-1]

    shard = _shard(layout, counts, allocate)
    if layout.lists:
        buffers.append(torch.empty(int(counts.list_bytes.sum()), dtype=torch.uint8, device=device))
    return shard, buffers


def read_lists(shard: Shard, buffer: torch.Tensor, counts: SampleCounts) -> None:
    """Unpickle the samples' list entries from a written list buffer of `empty_shard` (or a block's
    list region) into `shard`."""
    raw = bytes(buffer.cpu().numpy())  # one device-to-host copy
    ends = np.cumsum([0] + counts.list_bytes.tolist())
    shard.lists = [pickle.loads(raw[a:b]) for a, b in zip(ends[:-1].tolist(), ends[1:].tolist())]


def view_block(layout: BatchLayout, block: torch.Tensor, regions: np.ndarray, counts: SampleCounts) -> Shard:
    """The b samples written into `block` (uint8, the wire format; field regions at byte offsets
    `regions`) as a shard of typed views; counts [b]: the samples' rows, images and list bytes."""
    at = iter(regions.tolist())
    out = _shard(layout, counts, lambda dtype, shape: _view(block, next(at), dtype, shape))
    if layout.lists:
        start = next(at)
        read_lists(out, block[start:start + int(counts.list_bytes.sum())], counts)
    return out


def _view(block: torch.Tensor, at: int, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
    nbytes = math.prod(shape) * dtype.itemsize
    return block[at:at + nbytes].view(dtype).view(shape)


def shard_counts(shard: Shard, blobs: list) -> SampleCounts:
    """The counts the move list needs of a shard: rows, images and list bytes per sample."""
    zeros = np.zeros(shard.n, dtype=np.int64)
    return SampleCounts.of(rows=zeros if shard.row_counts is None else shard.row_counts,
                           images=zeros if shard.image_counts is None else shard.image_counts,
                           list_bytes=np.array([len(b) for b in blobs], dtype=np.int64).reshape(-1) if blobs else zeros)


def resolved(device: torch.device | None) -> torch.device | None:
    """`device` with a CUDA index filled in (the current device), so it compares equal to the device
    of tensors placed there."""
    if device is not None and device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device
