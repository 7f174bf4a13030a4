"""The metadata wire format against its documented layout: the config and window frames word for
word (hand-written words: IEEE-754 bits, little-endian UTF-8, CRC-32 of known strings), what
`config_mismatch` and `window_problem` report, word for word, on frames built by hand or by the
encoders, and `counts_of` against a loop over the documented frame layout."""

import struct

import numpy as np
import pytest
import torch
from expecttest import TestCase
from hypothesis import given
from hypothesis import strategies as st

from reorder import CostModel, Grid, ReorderError, WindowExchanger, run_emulated
from reorder.plan import wire

MAGIC = 0x52454F52  # "REOR"
NONE = 0x7FF8_DEAD_0000_0001  # the NaN pattern that stands for None
INT64 = 2**64


def le(text: bytes, words: int) -> list:
    """`text` as zero-padded little-endian int64 words (two's complement), computed by hand."""
    raw = text.ljust(8 * words, b"\0")
    out = []
    for i in range(words):
        u = sum(raw[8 * i + k] << (8 * k) for k in range(8))
        out.append(u - INT64 if u >= 2**63 else u)
    return out


# The config frame's documented layout: (field, kind) in wire order after the magic number.
LAYOUT = [("micro_batch_size", "int"), ("grid_size", "int"), ("dp", "int"), ("window_size", "int"),
          ("encoder_weight", "float"), ("language_weight", "float"), ("encoder_quadratic_weight", "float"),
          ("language_quadratic_weight", "float"), ("encoder_image_weight", "float"),
          ("spatial_merge_size", "int"), ("image_token_id", "int"), ("vision_start_token_id", "int"),
          ("balancer", "text"), ("shadow", "int"), ("cross_slot", "int"), ("min_gain", "float"),
          ("min_saving", "float"), ("gate_backoff", "int"), ("given_costs", "int"), ("given_image_counts", "int"),
          ("verify", "int")]
KIND = dict(LAYOUT)

BASE = dict(micro_batch_size=8, grid_size=4, dp=2, window_size=3, encoder_weight=1.0, language_weight=0.5,
            encoder_quadratic_weight=0.0, language_quadratic_weight=-1.5, encoder_image_weight=2.0,
            spatial_merge_size=2, image_token_id=151655, vision_start_token_id=-7, balancer="balanced", shadow=1,
            cross_slot=0, min_gain=None, min_saving=0.25, gate_backoff=4, given_costs=0, given_image_counts=1,
            verify=100)
# BASE encoded by hand: floats as their IEEE-754 bits (sign bit set: a negative int64)
BASE_WORDS = ([MAGIC, 8, 4, 2, 3, 0x3FF0_0000_0000_0000, 0x3FE0_0000_0000_0000, 0, 0xBFF8_0000_0000_0000 - INT64,
               0x4000_0000_0000_0000, 2, 151655, -7] + le(b"balanced", 4)
              + [1, 0, NONE, 0x3FD0_0000_0000_0000, 4, 0, 1, 100])


def test_the_config_fields_and_their_order_are_the_documented_ones():
    assert [(f.name, f.kind) for f in wire.CONFIG] == LAYOUT
    assert wire.CONFIG_WORDS == 25 == len(BASE_WORDS)
    assert [f.words for f in wire.CONFIG] == [4 if k == "text" else 1 for _, k in LAYOUT]


def test_config_frame_word_for_word():
    frame = wire.encode_config(BASE)
    assert frame.dtype == np.int64 and frame.shape == (25,)
    assert frame.tolist() == BASE_WORDS
    assert le(b"balanced", 1) == [7234297702172615010]  # the hand encoder itself, on a known value


def test_text_fields_are_cut_to_32_bytes_and_zero_padded():
    long = wire.encode_config(dict(BASE, balancer="ab" * 20))  # 40 bytes
    assert long[13:17].tolist() == le(b"ab" * 16, 4)
    short = wire.encode_config(dict(BASE, balancer="x"))
    assert short[13:17].tolist() == [ord("x"), 0, 0, 0]
    assert wire.encode_config(dict(BASE, balancer=7))[13:17].tolist() == [ord("7"), 0, 0, 0]  # str() of the value


@pytest.mark.parametrize("value", [2**63, -2**63 - 1])
def test_an_int_outside_int64_cannot_travel(value):
    with pytest.raises(OverflowError):
        wire.encode_config(dict(BASE, image_token_id=value))
    assert wire.encode_config(dict(BASE, image_token_id=value // 2))[11] == value // 2


def frames(*configs):
    return np.stack([wire.encode_config(dict(BASE, **c)) for c in configs])


def test_identical_frames_have_no_mismatch():
    assert wire.config_mismatch(frames({})) is None  # a DP group of one
    assert wire.config_mismatch(frames({}, {}, {})) is None
    assert wire.config_mismatch(frames(*[dict(min_gain=0.5, balancer="lpt")] * 2)) is None


class Messages(TestCase):
    def test_mismatch_messages(self):
        def text(*configs):
            return wire.config_mismatch(frames(*configs))

        self.assertExpectedInline(text({}, {}, dict(window_size=1)),
                                  """config mismatch across the DP group: window_size is 3 on ranks [0, 1], 1 on ranks [2]""")
        self.assertExpectedInline(text(dict(min_gain=0.1), {}, dict(min_gain=0.1), dict(min_gain=0.2)),
                                  """config mismatch across the DP group: min_gain is 0.1 on ranks [0, 2], None on ranks [1], 0.2 on ranks [3]""")
        self.assertExpectedInline(text({}, dict(balancer="lpt")),
                                  """config mismatch across the DP group: balancer is 'balanced' on ranks [0], 'lpt' on ranks [1]""")
        # the first field in wire order that differs is named, whatever else differs after it
        self.assertExpectedInline(text(dict(gate_backoff=0, grid_size=8), {}),
                                  """config mismatch across the DP group: grid_size is 8 on ranks [0], 4 on ranks [1]""")
        # bits, not values: -0.0 == 0.0 in Python, yet the ranks sent different frames
        self.assertExpectedInline(text(dict(min_saving=0.0), dict(min_saving=-0.0)),
                                  """config mismatch across the DP group: min_saving is 0.0 on ranks [0], -0.0 on ranks [1]""")
        # texts that differ only past 32 bytes travel as the same words
        self.assertIsNone(text(dict(balancer="b" * 32 + "x"), dict(balancer="b" * 32 + "y")))
        # the last word of a text field alone differs
        self.assertExpectedInline(text(dict(balancer="c" * 31 + "x"), dict(balancer="c" * 31 + "y")),
                                  """config mismatch across the DP group: balancer is 'cccccccccccccccccccccccccccccccx' on ranks [0], 'cccccccccccccccccccccccccccccccy' on ranks [1]""")
        # the last field
        self.assertExpectedInline(text(dict(given_image_counts=0), {}),
                                  """config mismatch across the DP group: given_image_counts is 0 on ranks [0], 1 on ranks [1]""")

    def test_a_frame_without_the_magic_number(self):
        f = frames({}, {}, {})
        f[1, 0] = 0
        self.assertExpectedInline(wire.config_mismatch(f),
                                  """the DP group is not all running reorder: a rank sent a metadata frame without its magic number""")
        f[2, 5] += 1  # and a field differs too: the magic number is what is reported
        self.assertIn("without its magic number", wire.config_mismatch(f))
        f[:, 0] = 12345  # identical frames, even without it: nothing to disagree about
        f[2, 5] -= 1
        self.assertIsNone(wire.config_mismatch(f))
        self.assertIsNone(wire.config_mismatch(f[:1]))


def same_words(kind, a, b):
    """Whether a and b travel as the same words: floats by their bits, texts by their first 32 bytes."""
    if kind == "float":
        return (a is None) == (b is None) and (a is None or struct.pack("<d", a) == struct.pack("<d", b))
    if kind == "text":
        return a.encode()[:32] == b.encode()[:32]
    return a == b


def shown(kind, v):
    if kind == "text":
        return repr(v.encode()[:32].decode())
    return repr(None if v is None else float(v)) if kind == "float" else repr(v)


VALUES = {"int": st.integers(-2**63, 2**63 - 1),
          "float": st.none() | st.sampled_from([0.0, -0.0, 1.0, 1e-300]) | st.floats(allow_nan=False),
          "text": st.text(alphabet="abcdefghij_", max_size=40)}


@given(st.data(), st.integers(1, 5))
def test_mismatch_names_the_first_differing_field_and_each_value_by_rank(data, dp):
    """Each rank overrides a few fields of BASE; the expected text is built from the Python values."""
    configs = [data.draw(st.fixed_dictionaries({}, optional={n: VALUES[k] for n, k in LAYOUT})) for _ in range(dp)]
    full = [dict(BASE, **c) for c in configs]
    want = None
    for name, kind in LAYOUT:
        col = [c[name] for c in full]
        if all(same_words(kind, v, col[0]) for v in col):
            continue
        groups = []  # (value, ranks) in order of first appearance
        for q, v in enumerate(col):
            for g in groups:
                if same_words(kind, g[0], v):
                    g[1].append(q)
                    break
            else:
                groups.append((v, [q]))
        want = f"config mismatch across the DP group: {name} is " + ", ".join(
            f"{shown(kind, v)} on ranks {qs}" for v, qs in groups)
        break
    assert wire.config_mismatch(np.stack([wire.encode_config(c) for c in full])) == want


def test_ranks_whose_weights_differ_only_in_the_sign_of_zero_raise_the_same_error():
    def body(rank, coll):
        cost = CostModel(encoder_quadratic_weight=-0.0 if rank else 0.0)
        ex = WindowExchanger(grid=Grid(size=2, dp=2, rank=rank), cost=cost, collectives=coll, window_size=1,
                             micro_batch_size=4)
        return ex.exchange([{"input_ids": torch.zeros(2, 8, dtype=torch.int64)}])

    results = run_emulated(2, body, return_exceptions=True)
    assert [type(r) for r in results] == [ReorderError, ReorderError], results
    assert [str(r) for r in results] == ["config mismatch across the DP group: encoder_quadratic_weight is 0.0 on "
                                         "ranks [0], -0.0 on ranks [1]"] * 2


# --- the window frame ------------------------------------------------------------------------------

def test_window_frame_layout():
    assert (wire.TEXT_AT, wire.COUNTS_AT, wire.TEXT_BYTES) == (5, 133, 1024)
    assert wire.window_words(2, 3, 7) == 133 + 2 * 3 * 7
    assert wire.window_words(1, 1, 1) == 134
    assert wire.window_words(2, 3, 7, 16) == 133 + 2 * 3 * (7 + 16)  # with the self-check's checksums
    assert wire.window_words(1, 1, 1, 0) == 134


def window(*, error=None, slots=1, layout="abc", counts=None, size=2, local=1, columns=3):
    frame = np.zeros(wire.window_words(size, local, columns), dtype=np.int64)
    out = wire.encode_window(frame, error=error, slots=slots, layout=layout, counts=counts)
    assert out is frame
    return frame


def test_window_frame_word_for_word():
    f = window(counts=np.array([[[7, -8, 9]]], dtype=np.int64))
    want = [MAGIC, 0, 1, 0x352441C2, 3] + le(b"abc", 128) + [7, -8, 9, 0, 0, 0]  # crc32(b"abc") = 0x352441C2
    assert f.tolist() == want
    f = window(error="bad input", slots=2, layout="", counts=None)
    assert f.tolist() == [MAGIC, 1, 2, 0, 9] + le(b"bad input", 128) + [0] * 6  # crc32(b"") = 0
    f = window(error="e", layout="abc", counts=np.arange(6, dtype=np.int64).reshape(2, 1, 3))
    assert f[:5].tolist() == [MAGIC, 1, 1, 0x352441C2, 1] and f[5:133].tolist() == le(b"e", 128)
    assert f[133:].tolist() == [0, 1, 2, 3, 4, 5]


def test_a_window_frame_holds_the_first_1024_bytes_of_its_text_and_its_whole_length():
    f = window(error="z" * 1100)
    assert f[5:133].tolist() == le(b"z" * 1024, 128) and f[4] == 1100
    text = "a" + "\u00e9" * 600  # 1201 bytes: the cut falls inside a two-byte character
    f = window(error=text)
    assert wire.text_of(f[5:133]) == "a" + "\u00e9" * 511 + "\ufffd" and f[4] == 1201


def test_texts_longer_than_the_window_frame_travel_whole_in_a_text_frame():
    short, long_ = window(error="e"), window(layout="x" * 1025)
    assert wire.long_text_words(np.stack([short, short])) == 0
    assert wire.long_text_words(np.stack([window(layout="y" * 1024)])) == 0
    assert wire.long_text_words(np.stack([short, long_])) == 129  # ceil(1025 / 8)
    assert wire.encode_text("ab", 2).tolist() == le(b"ab", 2)
    text = "\u00e9" * 700 + " the field's name"
    frames = np.stack([window(error=text), window()])
    words = wire.long_text_words(frames)
    got = [wire.text_of(wire.encode_text(t, words)) for t in (text, "abc")]
    assert wire.window_problem(frames, got) == (f"reorder failed on rank 0: {text}", None)
    assert wire.window_problem(frames)[0] != f"reorder failed on rank 0: {text}"  # cut without the text frame
    sig = ";".join(f"field{i}:d0:int64:[8]" for i in range(100))
    assert wire.window_problem(np.stack([window(layout=sig), window(layout=sig + "!")]), [sig, sig + "!"]) == (
        None, [sig, sig + "!"])


def test_text_of():
    assert wire.text_of(np.array(le(b"abc", 3), dtype=np.int64)) == "abc"
    assert wire.text_of(np.array(le(b"\0a\0b", 2), dtype=np.int64)) == "\0a\0b"  # only trailing zeros go
    assert wire.text_of(np.zeros(4, dtype=np.int64)) == ""
    assert wire.text_of(np.array(le(b"MAX", 1), dtype=np.int64)) == "MAX"
    strided = np.array([le(b"ab", 1)[0], 99, le(b"cd", 1)[0], 99], dtype=np.int64)[::2]
    assert wire.text_of(strided) == "ab\0\0\0\0\0\0cd"  # the words in order, not the buffer behind them


def test_window_problem_reports():
    def gathered(*fs):
        return np.stack(fs)

    assert wire.window_problem(gathered(window())) == (None, None)
    assert wire.window_problem(gathered(window(layout="x"))) == (None, None)  # one rank: nothing to differ from
    assert wire.window_problem(gathered(window(), window(), window())) == (None, None)
    assert wire.window_problem(gathered(window(layout="a;b"), window(layout="a;c"), window(layout="a;b"))) == (
        None, ["a;b", "a;c", "a;b"])
    assert wire.window_problem(gathered(window(layout="a"), window(layout="b"))) == (None, ["a", "b"])
    # an empty window: layouts are not compared
    assert wire.window_problem(gathered(window(slots=0, layout="a"), window(slots=0, layout="b"))) == (None, None)
    # errors first, each failed rank in rank order, whatever else differs
    assert wire.window_problem(gathered(window(slots=2), window(error="no data", slots=0, layout=""),
                                        window(), window(error="bad grid_thw"))) == (
        "reorder failed on rank 1: no data; rank 3: bad grid_thw", None)
    assert wire.window_problem(gathered(window(error="only"))) == ("reorder failed on rank 0: only", None)
    assert wire.window_problem(gathered(window(slots=2), window(slots=2), window(slots=1, layout="b"))) == (
        "micro-batch count of this window differs across the DP group (a data iterator ended early or yields a "
        "different number of micro-batches): rank 0: 2, rank 1: 2, rank 2: 1", None)
    assert wire.window_problem(gathered(window(slots=0), window(slots=1))) == (
        "micro-batch count of this window differs across the DP group (a data iterator ended early or yields a "
        "different number of micro-batches): rank 0: 0, rank 1: 1", None)


@given(st.integers(1, 4), st.integers(1, 3), st.integers(1, 3), st.integers(1, 4), st.data())
def test_counts_of_reads_every_rank_in_rank_major_order(dp, local, window_size, columns, data):
    slots = data.draw(st.integers(0, window_size))
    width = wire.window_words(window_size, local, columns)
    gathered = np.array(data.draw(st.lists(st.lists(st.integers(-2**40, 2**40), min_size=width, max_size=width),
                                           min_size=dp, max_size=dp)), dtype=np.int64)
    got = wire.counts_of(gathered, slots, local, columns)
    # documented layout: rank q's counts of slot s, sample i, column c at 133 + (s * local + i) * columns + c;
    # the window's sample q * local + i of slot s
    want = [[[int(gathered[q, 133 + (s * local + i) * columns + c]) for c in range(columns)]
             for q in range(dp) for i in range(local)] for s in range(slots)]
    assert got.shape == (slots, dp * local, columns)
    assert got.tolist() == want


def test_counts_round_trip_through_the_frames():
    dp, local, size, columns = 3, 2, 3, 7
    counts = np.arange(dp * 2 * local * columns, dtype=np.int64).reshape(dp, 2, local, columns) * 10 - 500
    frames = []
    for q in range(dp):
        frame = np.zeros(wire.window_words(size, local, columns), dtype=np.int64)
        frames.append(wire.encode_window(frame, error=None, slots=2, layout="L", counts=counts[q]))
    got = wire.counts_of(np.stack(frames), 2, local, columns)
    assert got.tolist() == [[counts[q, s, i].tolist() for q in range(dp) for i in range(local)] for s in range(2)]


def test_a_checked_window_frame_word_for_word():
    """With the self-check on, the senders' checksums follow the counts block: window_size x B/dp x
    sum words, zeros past the window's micro-batches."""
    frame = np.zeros(wire.window_words(3, 1, 3, 4), dtype=np.int64)
    counts = np.array([[[7, -8, 9]], [[1, 2, 3]]], dtype=np.int64)
    sums = np.array([[[-1, 2, -3, 4]], [[5, -6, 7, -8]]], dtype=np.int64)
    wire.encode_window(frame, error=None, slots=2, layout="abc", counts=counts, sums=sums)
    assert frame[:5].tolist() == [MAGIC, 0, 2, 0x352441C2, 3]
    assert frame[133:].tolist() == [7, -8, 9, 1, 2, 3, 0, 0, 0] + [-1, 2, -3, 4, 5, -6, 7, -8, 0, 0, 0, 0]


@given(st.integers(1, 3), st.integers(1, 3), st.integers(1, 3), st.integers(1, 4), st.integers(1, 5), st.data())
def test_counts_and_checksums_of_read_the_documented_blocks(dp, local, window_size, columns, sum_words, data):
    slots = data.draw(st.integers(0, window_size))
    width = wire.window_words(window_size, local, columns, sum_words)
    gathered = np.array(data.draw(st.lists(st.lists(st.integers(-2**40, 2**40), min_size=width, max_size=width),
                                           min_size=dp, max_size=dp)), dtype=np.int64)
    at = 133 + window_size * local * columns  # the checksums start after every slot's counts
    want_counts = [[[int(gathered[q, 133 + (s * local + i) * columns + c]) for c in range(columns)]
                    for q in range(dp) for i in range(local)] for s in range(slots)]
    want_sums = [[[int(gathered[q, at + (s * local + i) * sum_words + c]) for c in range(sum_words)]
                  for q in range(dp) for i in range(local)] for s in range(slots)]
    counts = wire.counts_of(gathered, slots, local, columns, sum_words)
    sums = wire.sums_of(gathered, slots, local, columns, sum_words)
    assert counts.shape == (slots, dp * local, columns) and counts.tolist() == want_counts
    assert sums.shape == (slots, dp * local, sum_words) and sums.tolist() == want_sums


def test_checksums_round_trip_through_the_frames():
    dp, local, size, columns, words = 2, 2, 3, 7, 16
    frames, sums = [], np.arange(dp * 2 * local * words, dtype=np.int64).reshape(dp, 2, local, words) - 99
    for q in range(dp):
        frame = np.zeros(wire.window_words(size, local, columns, words), dtype=np.int64)
        counts = np.full((2, local, columns), q + 1, dtype=np.int64)
        frames.append(wire.encode_window(frame, error=None, slots=2, layout="L", counts=counts, sums=sums[q]))
    got = wire.sums_of(np.stack(frames), 2, local, columns, words)
    assert got.tolist() == [[sums[q, s, i].tolist() for q in range(dp) for i in range(local)] for s in range(2)]
    assert wire.counts_of(np.stack(frames), 2, local, columns, words).tolist() == [
        [[q + 1] * columns for q in range(dp) for _ in range(local)] for _ in range(2)]
