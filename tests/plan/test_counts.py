"""SampleCounts: the column names and their order (the window frame carries them by position), the
table check word for word, reading by name, and the per-kind entries, against tables written by hand."""

import struct

import numpy as np
import pytest

from reorder.plan.counts import COLUMNS, SampleCounts


def message(call):
    with pytest.raises(ValueError) as e:
        call()
    return str(e.value)


def test_columns():
    assert COLUMNS == ("placeholders", "real_tokens", "images", "rows", "list_bytes", "square_patches", "cost_bits")


def test_the_table_check_says_what_it_got():
    want = "SampleCounts.table must be an int64 array [..., 7], got "
    assert message(lambda: SampleCounts([[0] * 7])) == want + "list "
    assert message(lambda: SampleCounts(np.zeros((2, 7), np.int32))) == want + "int32 (2, 7)"
    assert message(lambda: SampleCounts(np.zeros((2, 6), np.int64))) == want + "int64 (2, 6)"
    assert message(lambda: SampleCounts(np.zeros((7, 2), np.int64))) == want + "int64 (7, 2)"
    assert message(lambda: SampleCounts(np.int64(3))) == want + "int64 ()"
    assert message(lambda: SampleCounts(np.array(3, dtype=np.int64))) == want + "int64 ()"


def test_tables_of_any_leading_shape():
    for shape in [(), (4,), (2, 3), (1, 2, 3)]:
        c = SampleCounts(np.zeros((*shape, 7), np.int64))
        assert c.shape == shape
    one = SampleCounts(np.arange(7, dtype=np.int64))  # a single sample
    assert one.shape == () and int(one.rows) == 3 and int(one.cost_bits) == 6


def test_columns_by_name():
    table = np.arange(2 * 3 * 7, dtype=np.int64).reshape(2, 3, 7)
    c = SampleCounts(table)
    for i, name in enumerate(COLUMNS):
        assert getattr(c, name).tolist() == table[..., i].tolist()
    assert c.images.tolist() == [[2, 9, 16], [23, 30, 37]]
    with pytest.raises(AttributeError, match=r"^nope$"):
        c.nope
    assert not hasattr(c, "image")


def test_of_fills_named_columns_and_zeros_the_rest():
    c = SampleCounts.of(rows=[[1, 2], [3, 4]], cost_bits=[[5, 6], [7, 8]])
    assert c.table.dtype == np.int64 and c.table.shape == (2, 2, 7)
    assert c.table.tolist() == [[[0, 0, 0, 1, 0, 0, 5], [0, 0, 0, 2, 0, 0, 6]],
                                [[0, 0, 0, 3, 0, 0, 7], [0, 0, 0, 4, 0, 0, 8]]]
    assert SampleCounts.of(images=np.array([3, 1])).table.tolist() == [[0, 0, 3, 0, 0, 0, 0], [0, 0, 1, 0, 0, 0, 0]]
    assert message(lambda: SampleCounts.of(rows=[1], colour=[2], image=[3])) == \
        ("unknown SampleCounts columns ['colour', 'image']: expected some of ('placeholders', 'real_tokens', "
         "'images', 'rows', 'list_bytes', 'square_patches', 'cost_bits')")


def test_flat_is_slot_major():
    c = SampleCounts(np.arange(2 * 3 * 7, dtype=np.int64).reshape(2, 3, 7))
    f = c.flat()
    assert isinstance(f, SampleCounts) and f.shape == (6,)
    assert f.rows.tolist() == [3, 10, 17, 24, 31, 38]
    assert SampleCounts(np.zeros((2, 2, 3, 7), np.int64)).flat().shape == (12,)


def test_given_costs_are_the_float64_bits():
    bits = [struct.unpack("<q", struct.pack("<d", v))[0] for v in (1.5, -2.0, 0.0)]
    c = SampleCounts.of(cost_bits=np.array([bits, bits[::-1]]))
    costs = c.given_costs
    assert costs.dtype == np.float64 and costs.tolist() == [[1.5, -2.0, 0.0], [0.0, -2.0, 1.5]]
    assert SampleCounts.of(rows=[1, 2]).given_costs.tolist() == [0.0, 0.0]


def test_entries_per_kind():
    c = SampleCounts.of(rows=[[5, 0, 2]], images=[[1, 0, 3]], list_bytes=[[9, 8, 7]])
    dense = c.entries("dense")
    assert dense.dtype == np.int64 and dense.tolist() == [[1, 1, 1]]
    assert c.entries("row").tolist() == [[5, 0, 2]]
    assert c.entries("image").tolist() == [[1, 0, 3]]
    assert c.entries("list").tolist() == [[9, 8, 7]]
    with pytest.raises(KeyError):
        c.entries("rows")
