"""Checksums of a shard's buffers (`reorder.batch.checksum`) against the documented sum, computed word
by word on Python integers from the layout's description alone: dense fields of several leading
entries, per-row and per-image fields, the list field, more fields than checksum words (the later
ones share the last word, told apart by their salt), samples without rows, images or list bytes,
buffers of any dtype and at any byte offset; and the result's place: the buffers' device."""

import contextlib
import ctypes
import sys
import types

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from reorder.batch import checksum as cs
from reorder.batch.checksum import checksums
from reorder.plan.checksums import CHECKED_FIELDS, word_width
from reorder.plan.counts import COLUMNS, SampleCounts
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


def layouts(draw, max_fields):
    """ByteFields: dense fields first (some with no bytes: no leading entries or empty samples),
    then per-row and per-image fields, then at most one list field; sometimes more fields than
    checksum words, so that the later ones share the last word."""
    count = draw(st.sampled_from([1, 2, 3, CHECKED_FIELDS - 1, CHECKED_FIELDS + 1, CHECKED_FIELDS + 3]))
    count = min(count, max_fields)
    dense = [draw(st.tuples(st.integers(0, 3) if draw(st.integers(0, 9)) == 0 else st.integers(1, 3),
                            st.sampled_from([0, 1, 2, 3, 4, 6, 8, 12, 16]))) for _ in range(count)]
    ragged = draw(st.lists(st.tuples(st.sampled_from(["row", "image"]), st.sampled_from([1, 2, 4, 6, 8, 24])),
                           max_size=4))
    fields = [ByteField("dense", pre, unit) for pre, unit in dense]
    fields += [ByteField(kind, 1, unit) for kind, unit in ragged]
    if draw(st.booleans()):
        fields.append(ByteField("list", 1, 1))
    return tuple(fields)


def part(draw, fields):
    """(buffers, counts, the buffers' bytes, plain counts) of 0-4 samples of `fields`: random bytes
    (0xFF and 0x7F.. words included), some typed as a wider dtype, some starting at a byte offset
    inside a larger tensor."""
    n = draw(st.integers(0, 4))
    plain = {name: draw(st.lists(st.integers(0, top), min_size=n, max_size=n))
             for name, top in (("rows", 3), ("images", 2), ("list_bytes", 9))}
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    buffers, datas = [], []
    for kind, pre, unit in fields:
        entries = {"dense": pre * n, "row": sum(plain["rows"]), "image": sum(plain["images"]),
                   "list": sum(plain["list_bytes"])}[kind]
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
    counts = SampleCounts.of(**{k: np.array(v, np.int64) for k, v in plain.items()})
    return buffers, counts, datas, plain


@st.composite
def shards(draw, max_fields=CHECKED_FIELDS + 3):
    """(fields, buffers, counts, the buffers' bytes, plain counts) of one shard."""
    fields = layouts(draw, max_fields)
    return (fields, *part(draw, fields))


@st.composite
def windows(draw, max_fields=CHECKED_FIELDS + 3):
    """(fields, parts): 1-3 micro-batches of the same fields; parts: (buffers, counts, bytes, plain counts)."""
    fields = layouts(draw, max_fields)
    return fields, [part(draw, fields) for _ in range(draw(st.integers(1, 3)))]


def spec_window(fields, parts) -> list:
    return [row for bufs, counts, datas, plain in parts for row in spec_checksums(fields, datas, counts.shape[0], plain)]


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
    buffers[-1] = torch.zeros(8, dtype=torch.uint8)             # pickled list bytes may stay on the host
    got = checksums(buffers, fields, counts)
    assert got.device.type == "meta" and got.dtype == torch.int64 and tuple(got.shape) == (n, CHECKED_FIELDS)
    got = cs.torch_checksums([(buffers, counts), (buffers, counts)], fields)
    assert got.device.type == "meta" and tuple(got.shape) == (2 * n, CHECKED_FIELDS)
    host = [torch.zeros(s, dtype=torch.uint8) for s in sizes]
    got = cs.torch_checksums([(buffers, counts), (host, counts)], fields)
    assert got.device.type == "meta" and tuple(got.shape) == (2 * n, CHECKED_FIELDS)


def test_sums_of_host_and_device_buffers_are_gathered_on_the_device():
    """A window whose first buffers are host ones (pinned sources a slot keeps) and whose others
    live on a device (assembled slots): the torch ops gather the sums there, copying only to the
    device. Gathered on the host, a device part's sums would come over by a non-blocking copy that
    returns before they land (a false mismatch on CUDA). The meta device stands for CUDA here: a
    copy out of it raises."""
    n = 3
    counts = SampleCounts.of(rows=np.array([2, 0, 1]), list_bytes=np.array([3, 0, 5]))
    fields = (ByteField("dense", 2, 8), ByteField("row", 1, 4), ByteField("list", 1, 1))
    sizes = [2 * n * 8, 3 * 4, 8]
    host = [torch.zeros(s, dtype=torch.uint8) for s in sizes]
    device = [torch.empty(s, dtype=torch.uint8, device="meta") for s in sizes]
    assert cs.gathering_device(host + device).type == "meta" and cs.gathering_device(host).type == "cpu"
    got = cs.torch_checksums([(host, counts), (device, counts)], fields)
    assert got.device.type == "meta" and tuple(got.shape) == (2 * n, CHECKED_FIELDS)
    got = checksums(host[:1] + device[1:], fields, counts)   # a field kept on the host ahead of device ones
    assert got.device.type == "meta" and tuple(got.shape) == (n, CHECKED_FIELDS)


def test_the_sums_stay_where_they_were_gathered_unless_asked_to_the_host():
    """`window_checksums` returns the sums where the torch ops gathered them (here the meta device,
    standing for CUDA: a copy out of it raises), unless `host` asks for them in host memory (a
    numpy array); CPU sums are host sums already, their own memory returned."""
    counts = SampleCounts.of(rows=np.array([1, 2]))
    fields = (ByteField("dense", 1, 8), ByteField("row", 1, 4))
    device = [torch.empty(16, dtype=torch.uint8, device="meta"), torch.empty(12, dtype=torch.uint8, device="meta")]
    for got in (cs.window_checksums([(device, counts)], fields, "cpu"),
                cs.window_checksums([(device, counts)], fields, "cpu", host=False)):
        assert got.device.type == "meta" and tuple(got.shape) == (2, CHECKED_FIELDS)
    host = [torch.arange(16, dtype=torch.uint8), torch.arange(12, dtype=torch.uint8)]
    want = cs.torch_checksums([(host, counts)], fields)
    got = cs.window_checksums([(host, counts)], fields, "cpu", host=True)
    assert isinstance(got, np.ndarray) and got.tolist() == want.tolist()


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


def test_a_window_summed_by_torch_ops_is_its_parts_one_after_the_other():
    counts = SampleCounts.of(rows=np.zeros(2, np.int64))
    assert cs.torch_checksums([], ()).dtype == torch.int64 and cs.torch_checksums([], ()).shape == (0, CHECKED_FIELDS)
    got = cs.torch_checksums([([], counts), ([], SampleCounts.of(rows=np.zeros(1, np.int64)))], ())
    assert got.device.type == "cpu" and got.tolist() == [[0] * CHECKED_FIELDS] * 3


@settings(max_examples=40, deadline=None)
@given(windows())
def test_window_checksums_off_cuda_are_the_documented_sums(window):
    fields, parts = window
    got = cs.window_checksums([(b, c) for b, c, _, _ in parts], fields, torch.device("cpu"))
    assert got.numpy().view(np.uint64).tolist() == spec_window(fields, parts)


# --- the one-launch path, through a kernel that follows the documented table in plain Python -----

class PlainWindow:
    """`checksum_window` of reorder.batch.triton_checksum in plain Python, launched as the
    interpreted kernel is (kernel[(programs,)](block, SLOTS=, CHUNK=, BLOCK=, SAMPLES=)), reading
    the offsets from the block's header and the words by absolute address as documented there, but
    cutting the work its own way: per buffer, every sample's piece whole
    (a dense sample's `pre` entries n * unit bytes apart, a ragged sample's entries one after the
    other from the sum of the counts before it), summed in order up to the buffer's size, added to
    the sample's output word. The programs and chunks play no part in the sums; the launch's grid
    must be the documented number of programs. BLOCK must be a power of two dividing CHUNK, and
    SAMPLES a power of two no smaller than any part's samples, as the kernel needs."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        def launch(block, *, SLOTS, CHUNK, BLOCK, SAMPLES):
            if BLOCK < 1 or BLOCK & (BLOCK - 1) or CHUNK % BLOCK or SAMPLES & (SAMPLES - 1):
                raise ValueError(f"BLOCK {BLOCK}, CHUNK {CHUNK}, SAMPLES {SAMPLES}")
            t = block.tolist()
            self.launches.append((grid, len(t)))
            buffers, fields, programs_at, bufs_at, fields_at, counts_at, out_at, columns = t[:8]
            first = t[programs_at:programs_at + buffers + 1]
            assert first[0] == 0 and first[-1] == grid[0] and all(x <= y for x, y in zip(first, first[1:]))
            for b in range(buffers):
                addr, size, row0, n = t[bufs_at + 4 * b:bufs_at + 4 * b + 4]
                kind, pre, unit, width, salt, slot, column, zero = t[fields_at + 8 * (b % fields):][:8]
                assert zero == 0 and n <= SAMPLES and first[b + 1] - first[b] == -(-(size // width) // CHUNK)
                if not size:
                    continue
                counts = [t[counts_at + (row0 + j) * columns + column] for j in range(n)]
                for j in range(n):
                    if kind == 0:
                        entries = [(addr + (e * n + j) * unit, unit) for e in range(pre)]
                    elif kind == 1:
                        entries = [(addr + (sum(counts[:j]) + e) * unit, unit) for e in range(counts[j])]
                    else:
                        entries = [(addr + sum(counts[:j]), counts[j])] if counts[j] else []
                    total = int(block[out_at + (row0 + j) * SLOTS + slot]) & MASK64  # fields may share a slot
                    for e, (at, length) in enumerate(entries):
                        for c in range(0, length, width):
                            if at + c + width > addr + size // width * width:
                                break  # no word past the buffer's end
                            w = int.from_bytes(ctypes.string_at(at + c, width), "little", signed=width > 1)
                            total = (total + (w + 1) * spec_mix(c) * spec_mix(e + salt)) & MASK64
                    block[out_at + (row0 + j) * SLOTS + slot] = total - (1 << 64) if total >> 63 else total
        return launch


@settings(max_examples=60, deadline=None)
@given(windows(), st.integers(0, 2**20))
def test_a_buffer_left_out_adds_nothing(window, mask):
    """A buffer given as None is left out: the sums with some buffers left out and the sums with the
    others left out add up to the documented sums of all (the round sums a slot's sources in two
    such calls), on the torch ops and through one launch; everything left out: zeros."""
    fields, parts = window
    out = {(i, f) for i, (bufs, _, _, _) in enumerate(parts) for f in range(len(bufs))
           if mask >> ((i * 7 + f) % 20) & 1}

    def keeping(left_out: bool) -> list:
        return [([None if ((i, f) in out) == left_out else t for f, t in enumerate(bufs)], c)
                for i, (bufs, c, _, _) in enumerate(parts)]

    def launched(ps):
        cs._KERNEL[:] = [PlainWindow()]
        try:
            got = cs.kernel_checksums(ps, fields, "cpu", interpret=True, block=4, chunk=8)
        finally:
            cs._KERNEL[:] = []
        return cs.torch_checksums(ps, fields) if got is None else got

    n = sum(c.shape[0] for _, c, _, _ in parts)
    for path in (lambda ps: cs.torch_checksums(ps, fields), launched):
        a, b = path(keeping(True)), path(keeping(False))
        assert (a + b).numpy().view(np.uint64).tolist() == spec_window(fields, parts)
        nothing = path([([None] * len(bufs), c) for bufs, c, _, _ in parts])
        assert nothing.shape == (n, CHECKED_FIELDS) and not nothing.any()


def test_captured_blocks_are_taken_in_turn_per_device_and_size(monkeypatch):
    """`Graphs.take`: per device and block size (a power of two words, at least a page), two blocks
    taken in turn, so a launch's sums stay until the launch after next of that size; none once
    capturing has failed."""
    monkeypatch.setattr(cs, "_CAPTURE", [True])
    graphs, d0, d1 = cs.Graphs(), torch.device("cuda", 0), torch.device("cuda", 1)
    a, b, c = graphs.take(d0, 600), graphs.take(d0, 1000), graphs.take(d0, 1024)
    assert a is not b and c is a and graphs.take(d0, 513) is b
    assert len(a.host) == 1024 and a.host.dtype == torch.int64 and a.device == d0 and a.graph is None
    assert [len(graphs.take(d0, n).host) for n in (1, 512, 1025)] == [512, 512, 2048]
    other = graphs.take(d1, 600)
    assert other is not a and other is not b and other.device == d1
    assert a.host.data_ptr() % 4096 == 0  # whole pages: registered with CUDA as they are
    monkeypatch.setattr(cs, "_CAPTURE", [False])
    assert graphs.take(d0, 600) is None


def test_a_thread_marked_uncaptured_takes_no_captured_block(monkeypatch):
    """`uncaptured_here` marks the calling thread alone: `Graphs.take` gives none there (its
    launches run uncaptured), while other threads, before and after, take captured blocks."""
    import threading

    monkeypatch.setattr(cs, "_CAPTURE", [True])
    graphs, d0, got = cs.Graphs(), torch.device("cuda", 0), []

    def beside():
        got.append(graphs.take(d0, 600))
        cs.uncaptured_here()
        got.extend([graphs.take(d0, 600), graphs.take(d0, 5000)])

    before = graphs.take(d0, 600)
    thread = threading.Thread(target=beside)
    thread.start()
    thread.join()
    assert before is not None and got[0] is not None and got[1:] == [None, None]
    assert graphs.take(d0, 600) is not None  # this thread is not marked


def test_a_captured_launch_is_replayed_only_with_its_constants(monkeypatch):
    """A block's first launch captures its graph and runs uncaptured (False); later launches with
    the same constants replay it (True), with other constants run uncaptured."""
    slot, captured = cs._Captured(0, 512), []

    class Graph:
        replays = 0

        def replay(self):
            self.replays += 1

    def capture(kernel, consts):
        captured.append((kernel, consts))
        slot.graph, slot.consts = Graph(), dict(consts)

    monkeypatch.setattr(slot, "_capture", capture)
    consts = dict(SLOTS=CHECKED_FIELDS, CHUNK=16, BLOCK=4, SAMPLES=16)
    assert slot.replay("kernel", consts) is False and captured == [("kernel", consts)] and slot.graph.replays == 0
    assert slot.replay("kernel", dict(consts)) is True and slot.graph.replays == 1
    assert slot.replay("kernel", dict(consts, SAMPLES=32)) is False and slot.graph.replays == 1 and len(captured) == 1


def test_a_graph_that_cannot_be_captured_leaves_the_uncaptured_launches(monkeypatch, caplog):
    """A failed capture (here: CUDA refuses to register the block) clears CUDA's error, is logged
    once, and turns capturing off for every caller: the launches run uncaptured from then on."""
    calls = []

    class Cudart:  # a CUDA runtime that refuses the registration
        def cudaHostRegister(self, ptr, size, flags):
            calls.append(("register", ptr, size, flags))
            return 712  # cudaErrorHostMemoryAlreadyRegistered

        def cudaGetLastError(self):
            calls.append(("last error",))
            return 712

    monkeypatch.setattr(torch.cuda, "cudart", Cudart)
    monkeypatch.setattr(cs, "_CAPTURE", [True])
    slot = cs.Graphs().take(torch.device("cuda", 0), 700)
    with caplog.at_level("WARNING", logger="reorder"):
        assert slot.replay(None, dict(SLOTS=CHECKED_FIELDS, CHUNK=16, BLOCK=4, SAMPLES=16)) is False
    assert calls == [("register", slot.host.data_ptr(), 8 * 1024, 0), ("last error",)]
    assert slot.graph is None and cs._CAPTURE == [False] and cs.Graphs().take(torch.device("cuda", 0), 700) is None
    assert [r.message for r in caplog.records] == [
        "reorder: the self-check's checksum launch could not be captured in a CUDA graph (RuntimeError: "
        "cudaHostRegister failed with cudaError 712); it launches uncaptured from now on"]


def test_interpreted_or_summed_on_the_device_nothing_is_taken_from_the_graphs(monkeypatch):
    """Only a CUDA launch whose sums go to the host goes through the caller's captured blocks:
    interpreted (with or without `host`) none is taken."""
    taken = []

    class Graphs:
        def take(self, device, size):
            taken.append(size)
            return None

    monkeypatch.setattr(cs, "_KERNEL", [PlainWindow()])
    counts = SampleCounts.of(list_bytes=np.array([3, 5]))
    parts = [([torch.arange(8, dtype=torch.uint8)], counts)]
    want = cs.torch_checksums(parts, (ByteField("list", 1, 1),))
    for host in (True, False):
        got = cs.kernel_checksums(parts, (ByteField("list", 1, 1),), "cpu", interpret=True, host=host, graphs=Graphs())
        assert isinstance(got, np.ndarray if host else torch.Tensor) and got.tolist() == want.tolist()
    assert taken == []


def test_only_unread_buffers_are_summed_by_torch_ops():
    """`_unread_sums`: None when every buffer is read by the kernel or left out; else the torch sums
    of the others, zero where a buffer is read or left out."""
    fields = (ByteField("list", 1, 1), ByteField("list", 1, 1))
    counts = SampleCounts.of(list_bytes=np.array([3, 5]))
    a, b = torch.arange(8, dtype=torch.uint8), torch.arange(8, 16, dtype=torch.uint8)
    assert cs._unread_sums([([a, None], counts)], fields, [[True, False]], 2) is None
    assert cs._unread_sums([([a, b], counts)], fields, [[True, True]], 2) is None
    got = cs._unread_sums([([a, None], counts)], fields, [[False, False]], 2)
    assert torch.equal(got, cs.checksums([a, None], fields, counts))
    got = cs._unread_sums([([a, b], counts)], fields, [[True, False]], 2)
    assert torch.equal(got, cs.checksums([None, b], fields, counts))


@pytest.fixture
def plain_kernel(monkeypatch):
    kernel = PlainWindow()
    monkeypatch.setattr(cs, "_KERNEL", [kernel])
    return kernel


@settings(max_examples=60, deadline=None)
@given(windows(), st.sampled_from([(4, 8), (8, 8), (16, 64)]), st.integers(0, 2**20))
def test_one_launch_gives_the_documented_sums(window, sizes, skip):
    """Every (sample, field) of every micro-batch summed by one launch where the kernel can read the
    buffer, the others (here: those a stand-in for `_readable` refuses, every `skip`-th one) by
    torch ops and added in; one program per `chunk` words of each readable buffer (no word: no
    launch); no readable buffer: None."""
    fields, parts = window
    block, chunk = sizes
    kernel = PlainWindow()
    unread = {id(b) for i, (bufs, _, _, _) in enumerate(parts) for f, b in enumerate(bufs) if skip >> ((i * 7 + f) % 20) & 1}
    readable, cs._readable = cs._readable, lambda t, device, interpret: id(t) not in unread and readable(t, device, interpret)
    cs._KERNEL[:] = [kernel]
    try:
        got = cs.kernel_checksums([(b, c) for b, c, _, _ in parts], fields, "cpu", interpret=True, block=block,
                                  chunk=chunk)
    finally:
        cs._KERNEL[:] = []
        cs._readable = readable
    if all(id(b) in unread for bufs, _, _, _ in parts for b in bufs):
        assert got is None and kernel.launches == []
        return
    assert got.dtype == torch.int64 and got.device.type == "cpu"
    assert got.numpy().view(np.uint64).tolist() == spec_window(fields, parts)
    words = [b.nbytes // spec_width(kind, unit) for bufs, _, _, _ in parts
             for (kind, pre, unit), b in zip(fields, bufs) if id(b) not in unread]
    programs = sum(-(-w // chunk) for w in words)
    assert [grid for grid, _ in kernel.launches] == ([(programs,)] if programs else [])


def test_the_launch_device_and_what_it_can_read(monkeypatch, plain_kernel):
    """A CUDA device without an index is the current one; the kernel reads a buffer on the launch
    device or in pinned host memory (here a stand-in: is_pinned answers True), nothing strided."""
    cuda = torch.device("cuda", 0)
    t = torch.zeros(4)
    assert cs._readable(t, cuda, False) is False and cs._readable(t, torch.device("cpu"), False) is True
    assert cs._readable(torch.zeros(4, device="meta"), torch.device("meta"), False) is True
    assert cs._readable(t, cuda, True) is True and cs._readable(torch.zeros(4, device="meta"), cuda, True) is False
    assert cs._readable(torch.zeros(4, 2).t(), torch.device("cpu"), True) is False
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: self.device.type == "cpu")
    assert cs._readable(t, cuda, False) is True
    assert cs._readable(torch.zeros(4, device="meta"), cuda, False) is False
    # interpreted with a CUDA device named: the device gets its index, the sums stay on the host
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    counts = SampleCounts.of(rows=np.zeros(2, np.int64))
    fields = (ByteField("dense", 1, 8),)
    data = np.arange(16, dtype=np.uint8)
    got = cs.kernel_checksums([([torch.from_numpy(data.copy())], counts)], fields, "cuda", interpret=True)
    assert got.device.type == "cpu"
    want = spec_checksums(fields, [data.tobytes()], 2, {"rows": [0, 0], "images": [0, 0], "list_bytes": [0, 0]})
    assert got.numpy().view(np.uint64).tolist() == want


class _CudaBuffer:
    """What `_readable` asks of a contiguous buffer on CUDA device `index` (no GPU needed)."""

    is_cuda, is_cpu = True, False

    def __init__(self, index):
        self.index = index

    def is_contiguous(self):
        return True

    def get_device(self):
        return self.index


def test_a_cuda_buffer_is_read_on_its_own_device_only():
    """A CUDA buffer is read by address when it is on the launch device: the same index, a CUDA
    launch device; another GPU's buffer is summed with torch ops where it lives."""
    assert cs._readable(_CudaBuffer(1), torch.device("cuda", 1), False) is True
    assert cs._readable(_CudaBuffer(1), torch.device("cuda", 0), False) is False
    assert cs._readable(_CudaBuffer(0), torch.device("cuda", 0), False) is True
    assert cs._readable(_CudaBuffer(0), torch.device("meta"), False) is False  # no CUDA launch device


def test_the_launch_enters_a_device_context_only_for_another_device(monkeypatch):
    """`_current`: nothing to enter when the launch device is the current one; else torch's context
    for the launch device."""
    entered = []
    monkeypatch.setattr(torch.cuda, "device", lambda d: entered.append(d) or "context")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert isinstance(cs._current(torch.device("cuda", 1)), type(contextlib.nullcontext())) and entered == []
    assert cs._current(torch.device("cuda", 0)) == "context" and entered == [torch.device("cuda", 0)]


def test_the_kernel_is_imported_once_and_a_failed_launch_is_logged_once(monkeypatch, caplog):
    """The first use imports `checksum_window` from reorder.batch.triton_checksum and keeps it; an
    import that fails means torch ops, with nothing logged; a launch that raises is logged once, in
    full, and the torch ops sum from then on."""
    from support.kernels import BrokenKernel
    counts = SampleCounts.of(rows=np.zeros(1, np.int64))
    parts = [([torch.arange(8, dtype=torch.uint8)], counts)]
    fields = (ByteField("dense", 1, 8),)
    kernel = PlainWindow()
    monkeypatch.setattr(cs, "_KERNEL", [])
    monkeypatch.setitem(sys.modules, "reorder.batch.triton_checksum", types.SimpleNamespace(checksum_window=kernel))
    want = cs.torch_checksums(parts, fields)
    assert torch.equal(cs.kernel_checksums(parts, fields, "cpu", interpret=True), want) and cs._KERNEL == [kernel]
    monkeypatch.setattr(cs, "_KERNEL", [])
    monkeypatch.setitem(sys.modules, "reorder.batch.triton_checksum", None)
    with caplog.at_level("DEBUG"):
        assert cs.kernel_checksums(parts, fields, "cpu", interpret=True) is None
    assert cs._KERNEL == [None] and caplog.records == []
    # the kernel's first window with the sums asked to the host, compared with the torch ops: on the
    # host there is no device stream to wait for
    monkeypatch.setattr(cs, "_KERNEL", [kernel])
    monkeypatch.setattr(cs, "_KERNEL_AGREED", [])
    assert cs.window_checksums(parts, fields, "cpu", host=True, interpret=True).tolist() == want.tolist()
    assert cs._KERNEL == [kernel] and cs._KERNEL_AGREED == [True]
    monkeypatch.setattr(cs, "_KERNEL", [BrokenKernel()])
    with caplog.at_level("WARNING", logger="reorder"):
        assert torch.equal(cs.window_checksums(parts, fields, "cpu", interpret=True), want)
        assert torch.equal(cs.window_checksums(parts, fields, "cpu", interpret=True), want)
    assert cs._KERNEL == [None]
    assert [(r.name, r.getMessage()) for r in caplog.records] == [
        ("reorder", "reorder: the Triton checksum kernel failed (RuntimeError: no compiler for this GPU); the "
                    "self-check sums with torch ops from now on")]


def test_a_part_with_a_buffer_per_field_only():
    counts = SampleCounts.of(rows=np.zeros(1, np.int64))
    with pytest.raises(ValueError) as e:
        cs.launch_block([([torch.zeros(8, dtype=torch.uint8)], counts), ([], counts)], (ByteField("dense", 1, 8),),
                        [[True], []], 16)
    assert str(e.value) == "part 1 has 0 buffers for 1 fields"


@pytest.mark.parametrize("chunk", [4, 8])
def test_each_buffer_is_cut_into_programs_of_chunk_words(chunk):
    """A readable buffer of w words takes ceil(w / chunk) programs, whatever its samples: here list
    fields of chunk - 1, chunk, chunk + 1 and 2 chunk bytes (1-byte words) in parts of one to four
    samples; an unreadable buffer takes none (its bytes: 0)."""
    sizes = [chunk - 1, chunk, chunk + 1, 2 * chunk]
    parts, readable = [], []
    for k in range(1, 5):
        counts = SampleCounts.of(list_bytes=np.array(sizes[:k]))
        parts.append(([torch.arange(sum(sizes[:k]), dtype=torch.uint8)], counts))
        readable.append([k != 2])
    block, programs, at = cs.launch_block(parts, (ByteField("list", 1, 1),), readable, chunk)
    want = [-(-sum(sizes[:k]) // chunk) if k != 2 else 0 for k in range(1, 5)]
    first = block[at["programs_at"]:at["bufs_at"]].tolist()
    assert programs == sum(want) and first == np.concatenate([[0], np.cumsum(want)]).tolist()
    rows = block[at["bufs_at"]:at["fields_at"]].reshape(4, 4)
    assert rows[:, 1:].tolist() == [[chunk - 1, 0, 1], [0, 1, 2], [3 * chunk, 3, 3], [5 * chunk, 6, 4]]
    assert rows[:, 0].tolist() == [t.data_ptr() for [t], _ in parts]
    assert at["samples"] == 16


def test_a_buffer_left_out_takes_no_program_and_no_address():
    """A buffer given as None (summed elsewhere): its row holds no address and no bytes, and it
    takes no program; the part's other buffers are laid out as ever."""
    counts = SampleCounts.of(list_bytes=np.array([3, 5]))
    data = torch.arange(8, dtype=torch.uint8)
    fields = (ByteField("list", 1, 1), ByteField("list", 1, 1))
    for readable in ([[False, True]], None):  # None: every buffer given is read
        block, programs, at = cs.launch_block([([None, data], counts)], fields, readable, 4)
        rows = block[at["bufs_at"]:at["fields_at"]].reshape(2, 4)
        assert rows.tolist() == [[0, 0, 0, 2], [data.data_ptr(), 8, 0, 2]]
        assert programs == 2 and block[at["programs_at"]:at["bufs_at"]].tolist() == [0, 0, 2]


def test_placed_buffers_are_not_asked_and_by_default_each_is(monkeypatch):
    """`placed=True` (the round's buffers: contiguous, on the launch device or pinned): no buffer is
    asked whether the kernel reads it by address, a buffer left out (None) adds nothing, and the
    sums, in host memory a numpy array, are the torch ops'. By default every buffer is asked, and
    one the kernel cannot read by address (here: the row buffer, refused) is summed by the torch
    ops."""
    monkeypatch.setattr(cs, "_KERNEL", [PlainWindow()])
    monkeypatch.setattr(cs, "_KERNEL_AGREED", [True])
    asked, refused = [], []
    monkeypatch.setattr(cs, "_readable", lambda t, device, interpret: asked.append(t) or t is not refused[0])
    counts = SampleCounts.of(list_bytes=np.array([3, 5]), rows=np.array([1, 2]))
    fields = (ByteField("list", 1, 1), ByteField("row", 1, 8))
    lists, rows = torch.arange(8, dtype=torch.uint8), torch.arange(24, dtype=torch.uint8).view(3, 8)
    for bufs in ([lists, rows], [None, rows], [lists, None]):
        want = cs.torch_checksums([(bufs, counts)], fields)
        got = cs.kernel_checksums([(bufs, counts)], fields, "cpu", interpret=True, placed=True)
        assert got.tolist() == want.tolist() and asked == []
        got = cs.window_checksums([(bufs, counts)], fields, "cpu", interpret=True, host=True, placed=True)
        assert isinstance(got, np.ndarray) and got.tolist() == want.tolist() and asked == []
    refused.append(rows)
    want = cs.torch_checksums([([lists, rows], counts)], fields)
    kernel = cs._KERNEL[0]
    got = cs.window_checksums([([lists, rows], counts)], fields, "cpu", interpret=True)
    assert isinstance(got, torch.Tensor) and got.tolist() == want.tolist()
    assert [id(t) for t in asked] == [id(lists), id(rows)]
    assert kernel.launches[-1][0] == (1,)  # one program: the list bytes (the rows by the torch ops)


def test_a_buffer_s_last_partial_word_takes_no_program():
    """Programs cover a buffer's whole words: 18 bytes of 4-byte words are 4 words, one program of
    4 words (the 2 bytes left over are not read)."""
    counts = SampleCounts.of(rows=np.zeros(4, np.int64))
    _, programs, _ = cs.launch_block([([torch.zeros(18, dtype=torch.uint8)], counts)], (ByteField("dense", 1, 4),),
                                     [[True]], 4)
    assert programs == 1


@pytest.mark.parametrize("most, samples", [(17, 32), (32, 32), (33, 64), (64, 64)])
def test_the_counts_of_every_sample_part_after_part(most, samples):
    """The counts of every sample, parts one after the other; SAMPLES the power of two at or above
    the most samples of a part (at least 16: one compiled variant for most windows); the output
    words zero; the sizes the kernel takes."""
    a = SampleCounts.of(rows=np.array([2, 0, 3]), images=np.array([1, 0, 2]))
    b = SampleCounts.of(rows=np.arange(most), images=np.zeros(most, np.int64))
    fields = (ByteField("row", 1, 8), ByteField("image", 1, 24))
    parts = [([torch.zeros(5, 8, dtype=torch.uint8), torch.zeros(3, 24, dtype=torch.uint8)], a),
             ([torch.zeros(most * (most - 1) // 2, 8, dtype=torch.uint8), torch.zeros(0, 24, dtype=torch.uint8)], b)]
    block, programs, at = cs.launch_block(parts, fields, [[True, True], [True, True]], 16)
    c, n = len(COLUMNS), 3 + most
    assert block[at["counts_at"]:at["out_at"]].reshape(n, c).tolist() == np.concatenate([a.table, b.table]).tolist()
    assert block[at["out_at"]:].tolist() == [0] * n * CHECKED_FIELDS and len(block) == at["out_at"] + n * CHECKED_FIELDS
    assert (block[0], block[1], block[7], at["samples"]) == (4, 2, c, samples)  # buffers, fields, columns


@settings(max_examples=200, deadline=None)
@given(units=st.lists(st.sampled_from([1, 2, 3, 4, 6, 8, 12, 16]), min_size=1, max_size=4),
       sizes=st.lists(st.integers(0, 4096), min_size=8, max_size=8), chunk=st.sampled_from([4, 8, 16, 64]),
       parts=st.integers(1, 2))
def test_a_buffer_takes_a_program_per_chunk_of_its_whole_words(units, sizes, chunk, parts):
    """Buffer b of s bytes and w-byte words (its field's word width) takes ceil(floor(s / w) / chunk)
    programs, the first programs being their running sum; whatever the fields and parts."""
    fields = tuple(ByteField("dense", 1, u) for u in units)
    counts = SampleCounts.of(rows=np.zeros(1, np.int64))
    bufs = iter(sizes * 2)
    given_parts = [([torch.zeros(next(bufs), dtype=torch.uint8) for _ in fields], counts) for _ in range(parts)]
    block, programs, at = cs.launch_block(given_parts, fields, None, chunk)
    widths = [word_width("dense", u) for u in units] * parts
    want = [-(-(t.nbytes // w) // chunk) for t, w in zip([t for held, _ in given_parts for t in held], widths)]
    assert block[at["programs_at"]:at["bufs_at"]].tolist() == [0, *np.cumsum(want).tolist()]
    assert programs == sum(want)


def test_a_block_s_layout_is_made_once_per_fields_and_part_sizes_and_forgotten_past_256():
    """`launch_block` lays out a block's fixed parts once per (fields, samples per part, chunk): the
    same layout is looked up, not made again; the 256 used last are kept (part sizes without end)."""
    fields = (ByteField("dense", 1, 8),)

    def block(n):
        counts = SampleCounts.of(rows=np.zeros(n, np.int64))
        return cs.launch_block([([torch.zeros(8 * n, dtype=torch.uint8)], counts)], fields, None, 16)

    first = block(3)
    again = block(3)
    assert cs._block_plan.cache_info()[:2] == (1, 1) and first[1:] == again[1:]  # (hits, misses)
    for n in range(4, 260):
        block(n)
    assert cs._block_plan.cache_info()[1:] == (257, 256, 256)  # misses, maxsize, size: 3 pushed out
    block(259)
    block(3)
    assert cs._block_plan.cache_info()[:2] == (2, 258)
