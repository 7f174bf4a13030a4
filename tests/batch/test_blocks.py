"""Micro-batches as byte buffers (`reorder.batch.blocks`): the layout as `ByteField`s, computed here
from the fields' dtypes and shapes; a shard's buffers and the empty buffers an executor writes
(shapes, dtypes, the list bytes, the device they are made on); the counts of a shard; CUDA devices
named with their index."""

import math
import pickle

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from reorder.batch import blocks
from reorder.batch.blocks import byte_fields, empty_shard, field_buffers, read_lists, shard_counts, unit_bytes
from reorder.batch.layout import describe
from reorder.plan.counts import SampleCounts
from reorder.plan.moves import ByteField

VS = 5
DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.bool, torch.float64]


@st.composite
def batches(draw):
    """(batch, n, description): dense fields of any batch dim, vision rows and per-image fields,
    and maybe a per-sample list; description: per field (kind, entries before the batch dim,
    bytes of one sample at one leading index / of one entry)."""
    n = draw(st.integers(0, 4))
    images = draw(st.lists(st.integers(0, 2), min_size=n, max_size=n))
    ids = torch.zeros(n, 6, dtype=torch.int64)
    for s, k in enumerate(images):
        ids[s, :k] = VS
    batch, desc = {"input_ids": ids}, [("dense", 1, 6 * 8)]
    for i in range(draw(st.integers(0, 3))):
        dtype = draw(st.sampled_from(DTYPES))
        shape = draw(st.lists(st.integers(1, 3), max_size=3))
        dim = draw(st.integers(0, len(shape)))
        full = shape[:dim] + [n] + shape[dim:]
        batch[f"f{i}"] = torch.zeros(full, dtype=dtype)
        desc.append(("dense", math.prod(shape[:dim]), math.prod(shape[dim:]) * dtype.itemsize))
    dims = {f"f{i}": int(np.argmax([d == n for d in batch[f"f{i}"].shape])) for i in range(len(batch) - 1)}
    n_img = sum(images)
    if n_img:
        thw = torch.tensor([[1, 2, 1]] * n_img)
        feat = draw(st.integers(1, 4))
        dtype = draw(st.sampled_from(DTYPES))
        batch["modality_inputs"] = {"images": {"vit": {"hidden_states": torch.zeros(2 * n_img, feat, dtype=dtype),
                                                       "grid_thw": thw}}}
        desc += [("row", 1, feat * dtype.itemsize), ("image", 1, 3 * 8)]
    if draw(st.booleans()):
        batch["note"] = [f"n{s}" * s for s in range(n)]
        desc.append(("list", 1, 1))
    return batch, n, desc, dims


@settings(max_examples=60, deadline=None)
@given(batches())
def test_byte_fields_and_buffers(case):
    batch, n, desc, dims = case
    if n == 0 or any(batch[k].shape.count(n) > 1 for k in dims):
        return  # a batch dim that cannot be told from another dim of the same size
    layout, shard = describe(batch, n, vision_start_token_id=VS, batch_dims=dims)
    fields = byte_fields(layout)
    assert fields == tuple(ByteField(*d) for d in desc)
    assert unit_bytes(layout) == (sum(u * p for k, p, u in desc if k == "dense"),
                                  sum(u for k, _, u in desc if k == "row"), sum(u for k, _, u in desc if k == "image"))
    blobs = shard.list_blobs()
    bufs = field_buffers(layout, shard, blobs)
    assert len(bufs) == len(fields)
    for (kind, pre, unit), buf in zip(fields, bufs):
        entries = {"dense": pre * n, "row": int(shard.row_counts.sum()) if shard.row_counts is not None else 0,
                   "image": int(shard.image_counts.sum()) if shard.image_counts is not None else 0,
                   "list": sum(map(len, blobs))}[kind]
        assert buf.is_contiguous() and buf.nbytes == entries * (1 if kind == "list" else unit)
    if layout.lists:
        assert bufs[-1].dtype == torch.uint8 and bytes(bufs[-1].numpy()) == b"".join(blobs)
        shard2, _ = empty_shard(layout, shard_counts(shard, blobs), torch.device("cpu"))
        read_lists(shard2, bufs[-1], shard_counts(shard, blobs))
        assert shard2.lists == shard.lists


def test_buffers_of_no_samples():
    batch = {"input_ids": torch.zeros(0, 4, dtype=torch.int64), "note": []}
    layout, shard = describe(batch, 0, vision_start_token_id=VS)
    bufs = field_buffers(layout, shard, shard.list_blobs())
    assert [(b.dtype, b.numel()) for b in bufs] == [(torch.int64, 0), (torch.uint8, 0)]


def test_empty_shard_is_made_on_the_device_asked_for():
    """Every buffer of an empty shard (the list bytes too) is allocated on `device`, with the
    shapes and dtypes of the layout for the counted samples."""
    batch = {"input_ids": torch.zeros(3, 4, dtype=torch.int64), "pos": torch.zeros(3, 3, 4, dtype=torch.int32),
             "note": ["a", "bb", "ccc"],
             "modality_inputs": {"images": {"vit": {"hidden_states": torch.zeros(4, 2, dtype=torch.bfloat16),
                                                    "grid_thw": torch.tensor([[1, 1, 1], [1, 3, 1]])}}}}
    batch["input_ids"][0, 0] = batch["input_ids"][2, 0] = VS
    layout, shard = describe(batch, 3, vision_start_token_id=VS, batch_dims={"pos": 1})
    blobs = shard.list_blobs()
    counts = shard_counts(shard, blobs)
    assert counts.list_bytes.tolist() == [len(b) for b in blobs] and counts.rows.tolist() == [1, 0, 3]
    assert counts.images.tolist() == [1, 0, 1] and counts.table.dtype == np.int64
    for device in (torch.device("meta"), torch.device("cpu")):
        out, bufs = empty_shard(layout, counts, device)
        assert out.n == 3
        assert [(tuple(b.shape), b.dtype, b.device) for b in bufs] == [
            ((3, 4), torch.int64, device), ((3, 3, 4), torch.int32, device), ((4, 2), torch.bfloat16, device),
            ((2, 3), torch.int64, device), ((sum(map(len, blobs)),), torch.uint8, device)]
        assert out.row_counts.tolist() == [1, 0, 3] and out.image_counts.tolist() == [1, 0, 1]
        assert out.row_counts is not counts.rows


def test_shard_counts_without_vision_or_lists():
    layout, shard = describe({"input_ids": torch.zeros(2, 3)}, 2, vision_start_token_id=VS)
    counts = shard_counts(shard, shard.list_blobs())
    assert counts.table.tolist() == np.zeros((2, len(counts.table[0])), np.int64).tolist()
    counts = shard_counts(shard, [pickle.dumps(1), b"xy"])
    assert counts.list_bytes.tolist() == [len(pickle.dumps(1)), 2]


def test_resolved_names_the_cuda_index(monkeypatch):
    """A CUDA device without an index becomes the current CUDA device; any other device (one with an
    index, the CPU, none) is returned as it is."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert blocks.resolved(torch.device("cuda")) == torch.device("cuda", 3)
    assert blocks.resolved(torch.device("cuda", 1)) == torch.device("cuda", 1)
    assert blocks.resolved(torch.device("cpu")) == torch.device("cpu")
    assert blocks.resolved(torch.device("meta")) == torch.device("meta")
    assert blocks.resolved(None) is None
