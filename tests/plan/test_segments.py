"""The segment table: construction and its checks word for word, and `merged` against a brute-force
byte map (which source byte lands on which destination byte) on random tables of
non-overlapping destinations."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from reorder.plan.segments import FIELDS, Segments


def rows(s):
    return [tuple(int(getattr(s, f)[i]) for f in FIELDS) for i in range(len(s))]


def message(call):
    with pytest.raises(ValueError) as e:
        call()
    return str(e.value)


def test_fields():
    assert FIELDS == ("src_buf", "src_off", "dst_buf", "dst_off", "nbytes")


def test_of_takes_any_integer_sequences():
    s = Segments.of([0, 1], (5, 6), np.array([2, 3], dtype=np.int32), np.array([7, 8], dtype=np.uint8), [9, 10])
    assert rows(s) == [(0, 5, 2, 7, 9), (1, 6, 3, 8, 10)]
    assert all(getattr(s, f).dtype == np.int64 and getattr(s, f).ndim == 1 for f in FIELDS)
    assert rows(Segments.of(1, 2, 3, 4, 5)) == [(1, 2, 3, 4, 5)]  # scalars: one segment
    nested = Segments.of([[0, 1]], [[2, 3]], [[4, 5]], [[6, 7]], [[8, 9]])  # flattened in order
    assert rows(nested) == [(0, 2, 4, 6, 8), (1, 3, 5, 7, 9)]
    e = Segments.of([], [], [], [], [])  # empty lists are float64 to numpy, and still welcome
    assert len(e) == 0 and all(getattr(e, f).dtype == np.int64 and getattr(e, f).shape == (0,) for f in FIELDS)


def test_of_refuses_non_integers():
    assert message(lambda: Segments.of([0], [0.5], [0], [0], [1])) == "Segments.src_off must hold integers, got dtype float64"
    assert message(lambda: Segments.of([0], [0], [0], [0], [True])) == "Segments.nbytes must hold integers, got dtype bool"
    assert message(lambda: Segments.of([0], [0], [0], [-1], [1])) == "Segments.dst_off[0] = -1 is negative"


def test_checks_name_the_field_and_what_it_got():
    good = {f: np.zeros(2, np.int64) for f in FIELDS}
    assert message(lambda: Segments(**dict(good, dst_buf=[0, 0]))) == \
        "Segments.dst_buf must be a one-dimensional int64 numpy array, got list"
    assert message(lambda: Segments(**dict(good, nbytes=np.zeros(2, np.int32)))) == \
        "Segments.nbytes must be a one-dimensional int64 numpy array, got int32 array of shape (2,)"
    assert message(lambda: Segments(**dict(good, src_buf=np.zeros((2, 1), np.int64)))) == \
        "Segments.src_buf must be a one-dimensional int64 numpy array, got int64 array of shape (2, 1)"
    assert message(lambda: Segments(**dict(good, src_off=np.zeros(3, np.int64)))) == \
        "Segments.src_off has length 3, src_buf has length 2"
    assert message(lambda: Segments(**dict(good, nbytes=np.array([4, -2, -3], np.int64)[:2]))) == \
        "Segments.nbytes[1] = -2 is negative"
    assert message(lambda: Segments(**dict(good, src_buf=np.array([-1, 0], np.int64)))) == \
        "Segments.src_buf[0] = -1 is negative"


def test_empty_len_total_bytes():
    e = Segments.empty()
    assert len(e) == 0 and e.total_bytes == 0 and rows(e) == []
    assert all(getattr(e, f).dtype == np.int64 and getattr(e, f).shape == (0,) for f in FIELDS)
    s = Segments.of([0, 0, 1], [0, 5, 0], [0, 0, 0], [0, 100, 50], [5, 0, 2**40])
    assert len(s) == 3 and s.total_bytes == 5 + 2**40 and isinstance(s.total_bytes, int)


def test_trusted_keeps_the_arrays_it_is_given():
    arrays = [np.array([i, i + 1], dtype=np.int64) for i in range(5)]
    s = Segments.trusted(*arrays)
    assert all(getattr(s, f) is a for f, a in zip(FIELDS, arrays))


def test_take_by_index_and_by_mask():
    s = Segments.of([0, 1, 2], [10, 11, 12], [3, 4, 5], [20, 21, 22], [1, 2, 3])
    assert rows(s.take(np.array([2, 0]))) == [(2, 12, 5, 22, 3), (0, 10, 3, 20, 1)]
    assert rows(s.take(np.array([False, True, True]))) == [(1, 11, 4, 21, 2), (2, 12, 5, 22, 3)]


def byte_map(s):
    """{(dst_buf, dst byte): (src_buf, src byte)}, one entry per copied byte."""
    out = {}
    for sb, so, db, do, n in rows(s):
        for k in range(n):
            assert (db, do + k) not in out  # destinations never overlap
            out[db, do + k] = (sb, so + k)
    return out


@st.composite
def tables(draw):
    """Segments over 1-3 source and destination buffers: destination intervals cut from a shuffled
    tiling (so they never overlap), sources often contiguous runs so that fusing has work to do."""
    n = draw(st.integers(0, 12))
    out = []
    dst_end = {}
    src_end = {}
    for _ in range(n):
        db = draw(st.integers(0, 2))
        sb = draw(st.integers(0, 2))
        size = draw(st.integers(0, 5))
        gap = draw(st.sampled_from([0, 0, 0, 1, 3]))
        do = dst_end.get(db, 0) + gap
        so = src_end.get(sb, 0) if draw(st.booleans()) else draw(st.integers(0, 40))
        dst_end[db], src_end[sb] = do + size, so + size
        out.append((sb, so, db, do, size))
    out = draw(st.permutations(out))
    return Segments.of(*(np.array([r[k] for r in out], dtype=np.int64).reshape(-1) for k in range(5)))


@given(tables())
def test_merged_copies_the_same_bytes_in_the_fewest_segments(s):
    m = s.merged()
    assert byte_map(m) == byte_map(s)
    assert all(getattr(m, f).dtype == np.int64 for f in FIELDS) and (m.nbytes > 0).all()
    got = rows(m)
    assert got == sorted(got, key=lambda r: (r[2], r[3]))  # by destination
    for a, b in zip(got, got[1:]):  # no two neighbours could be one segment
        assert not (a[0] == b[0] and a[2] == b[2] and a[1] + a[4] == b[1] and a[3] + a[4] == b[3])


def test_merged_on_small_tables():
    # two pieces of one copy, given in reverse: one segment
    s = Segments.of([0, 0], [4, 0], [1, 1], [14, 10], [6, 4])
    assert rows(s.merged()) == [(0, 0, 1, 10, 10)]
    # contiguous in the source only, or in the destination only, or across buffers: kept apart
    assert rows(Segments.of([0, 0], [0, 5], [0, 0], [0, 4], [4, 4]).merged()) == [(0, 0, 0, 0, 4), (0, 5, 0, 4, 4)]
    assert rows(Segments.of([0, 0], [0, 4], [0, 0], [0, 5], [4, 4]).merged()) == [(0, 0, 0, 0, 4), (0, 4, 0, 5, 4)]
    assert rows(Segments.of([0, 1], [0, 4], [0, 0], [0, 4], [4, 4]).merged()) == [(0, 0, 0, 0, 4), (1, 4, 0, 4, 4)]
    assert rows(Segments.of([0, 0], [0, 4], [0, 1], [0, 4], [4, 4]).merged()) == [(0, 0, 0, 0, 4), (0, 4, 1, 4, 4)]
    # three rows, destination buffers 0, 1, 1: rows 2 and 3 fuse, row 1 stays alone
    s = Segments.of([0, 0, 0], [0, 8, 12], [0, 1, 1], [8, 0, 4], [8, 4, 4])
    assert rows(s.merged()) == [(0, 0, 0, 8, 8), (0, 8, 1, 0, 8)]
    # zero-byte rows go, also between two halves of one copy
    s = Segments.of([0, 2, 0], [0, 0, 3], [0, 0, 0], [0, 3, 3], [3, 0, 3])
    assert rows(s.merged()) == [(0, 0, 0, 0, 6)]
    assert rows(Segments.of([0], [0], [0], [0], [0]).merged()) == []
    assert rows(Segments.empty().merged()) == []
    assert rows(Segments.of([1], [2], [3], [4], [5]).merged()) == [(1, 2, 3, 4, 5)]
    # sums past 2**31 stay exact
    s = Segments.of([0, 0], [0, 2**31], [0, 0], [0, 2**31], [2**31, 2**31])
    assert rows(s.merged()) == [(0, 0, 0, 0, 2**32)]
