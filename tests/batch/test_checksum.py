"""Checksums of a shard's buffers (`reorder.batch.checksum`) against the documented sum, computed word
by word on Python integers from the layout's description alone: dense fields of several leading
entries, per-row and per-image fields, the list field, more fields than checksum words (the later
ones share the last word, told apart by their salt), samples without rows, images or list bytes,
buffers of any dtype and at any byte offset; and the result's place: the buffers' device."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from reorder.batch.checksum import checksums
from reorder.plan.checksums import CHECKED_FIELDS
from reorder.plan.counts import SampleCounts
from reorder.plan.moves import ByteField

MASK64 = (1 << 64) - 1


def spec_mix(x: int) -> int:
    """The documented mix on Python integers: multiply by 0x9E3779B97F4A7C15 mod 2**64, xor with
    itself shifted right by 29 (arithmetic: the product read as a signed int64), set the low bit."""
    h = (x * 0x9E3779B97F4A7C15) & MASK64
    signed = h - (1 << 64) if h >> 63 else h
    return (h ^ ((signed >> 29) & MASK64)) | 1


def spec_width(kind: str, unit: int) -> int:
    """Bytes per word: 1 for list bytes, else the widest of 8, 4, 2, 1 dividing the entry."""
    return 1 if kind == "list" else next(w for w in (8, 4, 2, 1) if unit % w == 0)


def spec_entries(kind, pre, unit, data: bytes, n, counts) -> list:
    """Per sample, its entries' bytes: a dense field holds [pre, n, unit] bytes (entry e of sample j
    at (e*n + j)*unit), a per-row or per-image field its entries sample after sample, the list field
    each sample's bytes one after the other (one entry)."""
    if kind == "dense":
        return [[data[(e * n + j) * unit:(e * n + j + 1) * unit] for e in range(pre)] for j in range(n)]
    sizes = {"row": counts["rows"], "image": counts["images"], "list": counts["list_bytes"]}[kind]
    size = 1 if kind == "list" else unit
    out, at = [], 0
    for j in range(n):
        k = sizes[j]
        if kind == "list":
            out.append([data[at:at + k]] if k else [])
        else:
            out.append([data[at + e * size:at + (e + 1) * size] for e in range(k)])
        at += k * size
    return out


def spec_checksums(fields, datas, n, counts) -> list:
    """[n][CHECKED_FIELDS] unsigned: for field f (salt max(0, f - (CHECKED_FIELDS - 1)) * 2**32), each
    word w at byte c of entry e adds (w + 1) * mix(c) * mix(e + salt), mod 2**64; the little-endian
    word is signed except for 1-byte words."""
    out = [[0] * CHECKED_FIELDS for _ in range(n)]
    for f, ((kind, pre, unit), data) in enumerate(zip(fields, datas)):
        width = spec_width(kind, unit)
        salt = max(0, f - (CHECKED_FIELDS - 1)) << 32
        slot = min(f, CHECKED_FIELDS - 1)
        for j, entries in enumerate(spec_entries(kind, pre, unit, data, n, counts)):
            for e, entry in enumerate(entries):
                for c in range(0, len(entry), width):
                    w = int.from_bytes(entry[c:c + width], "little", signed=width > 1)
                    out[j][slot] = (out[j][slot] + (w + 1) * spec_mix(c) * spec_mix(e + salt)) & MASK64
    return out


DTYPES = [torch.uint8, torch.int8, torch.int16, torch.float16, torch.int32, torch.float32, torch.int64,
          torch.float64]


@st.composite
def shards(draw, max_fields=20):
    """(fields, buffers, counts, the buffers' bytes): dense fields first, then per-row and per-image
    fields, then at most one list field; every buffer random bytes (0xFF and 0x7F.. words included),
    some typed as a wider dtype, some starting at a byte offset inside a larger tensor."""
    n = draw(st.integers(0, 4))
    counts = {name: draw(st.lists(st.integers(0, top), min_size=n, max_size=n))
              for name, top in (("rows", 3), ("images", 2), ("list_bytes", 9))}
    dense = draw(st.lists(st.tuples(st.integers(1, 3), st.sampled_from([1, 2, 3, 4, 6, 8, 12, 16])),
                          min_size=1, max_size=max_fields))
    ragged = draw(st.lists(st.tuples(st.sampled_from(["row", "image"]), st.sampled_from([1, 2, 4, 6, 8, 24])),
                           max_size=4))
    fields = [ByteField("dense", pre, unit) for pre, unit in dense]
    fields += [ByteField(kind, 1, unit) for kind, unit in ragged]
    if draw(st.booleans()):
        fields.append(ByteField("list", 1, 1))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    buffers, datas = [], []
    for kind, pre, unit in fields:
        entries = {"dense": pre * n, "row": sum(counts["rows"]), "image": sum(counts["images"]),
                   "list": sum(counts["list_bytes"])}[kind]
        nbytes = entries * (1 if kind == "list" else unit)
        data = rng.choice(np.array([0, 1, 0x7F, 0x80, 0xFF], np.uint8), nbytes) if draw(st.booleans()) else \
            rng.integers(0, 256, nbytes, dtype=np.uint8)
        raw = torch.from_numpy(data.copy())
        shift = draw(st.integers(0, 7))
        if shift:  # the same bytes starting `shift` bytes into a larger tensor
            host = torch.zeros(nbytes + shift, dtype=torch.uint8)
            host[shift:] = raw
            raw = host[shift:]
        dtype = draw(st.sampled_from(DTYPES))
        if not shift and nbytes and nbytes % dtype.itemsize == 0:
            raw = raw.view(dtype)
        buffers.append(raw)
        datas.append(data.tobytes())
    return tuple(fields), buffers, SampleCounts.of(**{k: np.array(v, np.int64) for k, v in counts.items()}), datas, counts


@settings(max_examples=150, deadline=None)
@given(shards())
def test_checksums_are_the_documented_sum(shard):
    fields, buffers, counts, datas, plain = shard
    n = counts.shape[0]
    got = checksums(buffers, fields, counts)
    assert got.dtype == torch.int64 and got.shape == (n, CHECKED_FIELDS)
    assert got.numpy().view(np.uint64).tolist() == spec_checksums(fields, datas, n, plain)


@settings(max_examples=40, deadline=None)
@given(shards(max_fields=3))
def test_a_changed_byte_changes_its_samples_checksum_of_its_field(shard):
    """Flipping one byte of one sample's entry changes that sample's word of that field, no other word."""
    fields, buffers, counts, datas, plain = shard
    n = counts.shape[0]
    f = next((f for f, d in enumerate(datas) if d), None)
    if f is None:
        return
    before = checksums(buffers, fields, counts).numpy().copy()
    flipped = [b.clone() for b in buffers]
    flipped[f].reshape(-1).view(torch.uint8)[0] ^= 1
    after = checksums(flipped, fields, counts).numpy()
    changed = np.argwhere(before != after).tolist()
    kind, pre, unit = fields[f]
    sample = 0 if kind == "dense" else next(j for j in range(n) if spec_entries(kind, pre, unit, datas[f], n, plain)[j])
    assert changed == [[sample, min(f, CHECKED_FIELDS - 1)]]


def test_buffers_on_a_device_give_checksums_on_that_device():
    """Every tensor the checksums are made of lives on the buffers' device: on the meta device (no
    values, but each operation checks its operands' devices) dense, per-row, per-image and list
    fields, with more fields than checksum words, give an int64 [n, CHECKED_FIELDS] there."""
    n = 3
    counts = SampleCounts.of(rows=np.array([2, 0, 1]), images=np.array([1, 0, 2]), list_bytes=np.array([3, 0, 5]))
    fields = tuple([ByteField("dense", 2, 8)] * 17 + [ByteField("row", 1, 4), ByteField("image", 1, 12),
                                                      ByteField("list", 1, 1)])
    sizes = [2 * n * 8] * 17 + [3 * 4, 3 * 12, 8]
    buffers = [torch.empty(s, dtype=torch.uint8, device="meta") for s in sizes]
    got = checksums(buffers, fields, counts)
    assert got.device.type == "meta" and got.dtype == torch.int64 and tuple(got.shape) == (n, CHECKED_FIELDS)


def test_no_buffers_give_zero_checksums_on_the_host():
    counts = SampleCounts.of(rows=np.zeros(4, np.int64))
    got = checksums([], (), counts)
    assert got.device.type == "cpu" and got.dtype == torch.int64 and got.tolist() == [[0] * CHECKED_FIELDS] * 4


def test_a_buffer_over_memory_that_starts_off_a_word_boundary():
    """A tensor over foreign memory (numpy) whose first byte sits off an 8-byte boundary, viewed from a
    byte offset that brings the data back onto one: its words are read from a copy, as documented."""
    store = np.zeros(64, np.uint8)
    start = next(k for k in range(8) if (store.ctypes.data + k) % 8 == 1)
    base = torch.from_numpy(store[start:start + 40])          # storage begins 1 byte past a word boundary
    assert base.data_ptr() % 8 == 1 and base.storage_offset() == 0
    data = np.random.default_rng(0).integers(0, 256, 32, dtype=np.uint8)
    base[7:39] = torch.from_numpy(data)
    buf = base[7:39]                                            # data on a boundary, storage offset 7
    assert buf.data_ptr() % 8 == 0 and buf.storage_offset() % 8 == 7
    counts = SampleCounts.of(rows=np.zeros(2, np.int64))
    fields = (ByteField("dense", 2, 8),)
    want = spec_checksums(fields, [data.tobytes()], 2, {"rows": [0, 0], "images": [0, 0], "list_bytes": [0, 0]})
    assert checksums([buf], fields, counts).numpy().view(np.uint64).tolist() == want


@pytest.mark.parametrize("unit", [1, 2, 4, 8])
def test_extreme_words(unit):
    """Words at the ends of their range (0xFF.., 0x7F.., 0x80..): w + 1 is taken in int64."""
    data = b"\xff" * unit + b"\xff" * (unit - 1) + b"\x7f" + b"\x00" * (unit - 1) + b"\x80"  # little-endian
    fields = (ByteField("dense", 1, unit),)
    n = len(data) // unit
    counts = SampleCounts.of(rows=np.zeros(n, np.int64))
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    want = spec_checksums(fields, [data], n, {"rows": [0] * n, "images": [0] * n, "list_bytes": [0] * n})
    assert checksums([buf], fields, counts).numpy().view(np.uint64).tolist() == want
