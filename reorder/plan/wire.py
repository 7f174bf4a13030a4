"""The metadata wire format: what a rank tells its DP group, as fixed-layout int64 frames.

Two frames, both gathered over the module's DP group with one all-gather each:

- the **config frame**, once, before the first window: `MAGIC`, then every field of `CONFIG` by
  name (ints as int64, floats as their IEEE-754 bits, None as a NaN pattern no finite float has,
  text as `TEXT_WORDS` words of zero-padded UTF-8). Its size depends on nothing a rank chooses, so
  ranks configured differently still gather it and every rank names the same differing field;
- the **window frame**, once per window: `WINDOW_HEAD` (magic, error flag, micro-batches in the
  window, CRC-32 of the batch layout signature, the text's length in bytes), the first `TEXT_BYTES`
  of the text (the error message, else the layout signature), the counts, `window_size x B/dp x
  Column` int64 (zeros past the window's micro-batches), and with the self-check on (config
  `verify`) the rank's checksums of the last checked window, of what it read and of what it
  assembled, `window_size x B/dp x 2 CHECKED_FIELDS` int64 (zeros when no checked window waits).
  Its size depends on the config, which the config frame has already shown to match;
- the **text frame**, only after a window frame in which some rank's text was longer than
  `TEXT_BYTES`: every rank's whole text, `long_text_words` words each (every rank computes the same
  size from the gathered window frames), so errors and layout signatures never arrive cut off.

Pure numpy: numbers in, numbers out; the driver (`reorder.exchange.exchanger`) gathers the frames
and turns what `config_mismatch` / `decode_window` find into errors.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

import numpy as np

MAGIC = 0x52454F52  # "REOR"
TEXT_BYTES = 1024  # error message or layout signature: its first bytes (all of it in a text frame)
TEXT_WORDS = 4  # a text config field: 32 bytes
_NONE = 0x7FF8_DEAD_0000_0001  # a NaN bit pattern: None for optional floats (finite values never have it)


@dataclass(frozen=True, slots=True)
class Field:
    """One named config value on the wire; kind: "int" (bools as 0 / 1), "float" (None allowed) or "text"."""

    name: str
    kind: str

    @property
    def words(self) -> int:
        return TEXT_WORDS if self.kind == "text" else 1


CONFIG = (Field("micro_batch_size", "int"), Field("grid_size", "int"), Field("dp", "int"), Field("window_size", "int"),
          Field("encoder_weight", "float"), Field("language_weight", "float"),
          Field("encoder_quadratic_weight", "float"), Field("language_quadratic_weight", "float"),
          Field("encoder_image_weight", "float"), Field("spatial_merge_size", "int"), Field("image_token_id", "int"),
          Field("vision_start_token_id", "int"), Field("balancer", "text"), Field("shadow", "int"),
          Field("cross_slot", "int"), Field("min_gain", "float"), Field("min_saving", "float"),
          Field("gate_backoff", "int"), Field("given_costs", "int"), Field("given_image_counts", "int"),
          Field("verify", "int"))
CONFIG_WORDS = 1 + sum(f.words for f in CONFIG)
WINDOW_HEAD = ("magic", "error", "slots", "layout", "text_bytes")
TEXT_AT = len(WINDOW_HEAD)
COUNTS_AT = TEXT_AT + TEXT_BYTES // 8


def _encode(field: Field, value) -> list:
    if field.kind == "text":
        return np.frombuffer(str(value).encode()[:8 * TEXT_WORDS].ljust(8 * TEXT_WORDS, b"\0"), np.int64).tolist()
    if field.kind == "float":
        return [_NONE if value is None else struct.unpack("<q", struct.pack("<d", float(value)))[0]]
    return [int(value)]


def _decode(field: Field, words: np.ndarray):
    if field.kind == "text":
        return text_of(words)
    w = int(words[0])
    if field.kind == "float":
        return None if w == _NONE else struct.unpack("<d", struct.pack("<q", w))[0]
    return w


def encode_config(values: dict) -> np.ndarray:
    """int64 [CONFIG_WORDS]: the config frame of `values` (a value for every field of CONFIG)."""
    out = [MAGIC]
    for f in CONFIG:
        out += _encode(f, values[f.name])
    return np.array(out, dtype=np.int64)


def config_mismatch(gathered: np.ndarray) -> str | None:
    """The error text for the first field whose words differ across the gathered config frames [dp,
    CONFIG_WORDS] (naming each distinct value and its ranks), or None when every rank sent the same
    frame. Fields are compared word for word, not by value: 0.0 and -0.0 differ, as their bits do."""
    if (gathered == gathered[0]).all():
        return None
    if (gathered[:, 0] != MAGIC).any():
        return "the DP group is not all running reorder: a rank sent a metadata frame without its magic number"
    at = 1
    for f in CONFIG:
        ranks = {}  # the words of each distinct value -> (those words, the ranks that sent them)
        for q, row in enumerate(gathered[:, at:at + f.words]):
            ranks.setdefault(row.tobytes(), (row, []))[1].append(q)
        at += f.words
        if len(ranks) > 1:
            return (f"config mismatch across the DP group: {f.name} is "
                    + ", ".join(f"{_decode(f, row)!r} on ranks {qs}" for row, qs in ranks.values()))
    # not reached: the frames differ, the magic numbers do not, and every other word is a field's


def text_of(words: np.ndarray) -> str:
    """The zero-padded UTF-8 text held in int64 words."""
    return np.ascontiguousarray(words).tobytes().rstrip(b"\0").decode(errors="replace")


def window_words(window_size: int, local_batch: int, columns: int, sum_words: int = 0) -> int:
    """Size of the window frame in int64 words (identical on every rank once the configs match);
    sum_words: checksum words per sample (0 with the self-check off)."""
    return COUNTS_AT + window_size * local_batch * (columns + sum_words)


def _blocks(width: int, columns: int, sum_words: int) -> tuple:
    """(samples in a window frame of `width` words, where its checksums start): the counts block
    holds every slot's samples x columns words from COUNTS_AT, the checksums follow it."""
    samples = (width - COUNTS_AT) // (columns + sum_words)
    return samples, COUNTS_AT + samples * columns


def sums_of(gathered: np.ndarray, slots: int, local_batch: int, columns: int, sum_words: int) -> np.ndarray:
    """int64 [slots, B, sum_words]: every rank's checksums (the self-check's words per sample after
    the counts), natural order per slot (as `counts_of`)."""
    dp, width = gathered.shape
    samples, at = _blocks(width, columns, sum_words)
    c = gathered[:, at:at + samples * sum_words].reshape(dp, samples // local_batch, local_batch, sum_words)
    return c[:, :slots].transpose(1, 0, 2, 3).reshape(slots, dp * local_batch, sum_words)


def encode_window(frame: np.ndarray, *, error: str | None, slots: int, layout: str, counts: np.ndarray | None,
                  sums: np.ndarray | None = None):
    """Fill `frame` (int64 [window_words], zeroed) with this rank's window: the error text when it
    failed, else the layout signature; counts [slots, B/dp, columns] when it has a window; the
    checksums [slots, B/dp, sum words] after the counts block in a window the self-check covers."""
    text = window_text(error, layout).encode()
    frame[:TEXT_AT] = (MAGIC, int(error is not None), slots, zlib.crc32(layout.encode()), len(text))
    frame[TEXT_AT:COUNTS_AT] = np.frombuffer(text[:TEXT_BYTES].ljust(TEXT_BYTES, b"\0"), np.int64)
    if counts is not None:
        frame[COUNTS_AT:COUNTS_AT + counts.size] = counts.ravel()
    if sums is not None:
        at = _blocks(len(frame), counts.shape[-1], sums.shape[-1])[1]
        frame[at:at + sums.size] = sums.ravel()
    return frame


def window_text(error: str | None, layout: str) -> str:
    """The text a rank's window frame carries: its error, else its layout signature."""
    return error if error is not None else layout


def long_text_words(gathered: np.ndarray) -> int:
    """Words per rank of the text frame the gathered window frames [dp, window_words] call for: 0 when
    every rank's text fit its window frame, else the longest text's length in int64 words."""
    longest = int(gathered[:, WINDOW_HEAD.index("text_bytes")].max())
    return 0 if longest <= TEXT_BYTES else -(-longest // 8)


def encode_text(text: str, words: int) -> np.ndarray:
    """int64 [words]: the text frame of `text` (zero-padded UTF-8; `words` from `long_text_words`)."""
    return np.frombuffer(text.encode().ljust(8 * words, b"\0"), np.int64).copy()


def window_problem(gathered: np.ndarray, texts: list | None = None) -> tuple[str | None, list | None]:
    """(error text, layout signatures) from the gathered window frames [dp, window_words]: the error
    every rank must raise (a rank's own error, or micro-batch counts that differ), else None; and,
    when the window is not empty and the layout checksums differ, each rank's layout signature,
    else None. texts: every rank's whole text, from the text frames when `long_text_words` asked
    for them (else each frame's first TEXT_BYTES are the whole text)."""
    if texts is None:
        texts = [text_of(gathered[q, TEXT_AT:COUNTS_AT]) for q in range(len(gathered))]
    head = gathered[:, :TEXT_AT]
    failed = np.flatnonzero(head[:, 1])
    if len(failed):
        return "reorder failed on " + "; ".join(f"rank {q}: {texts[q]}" for q in failed.tolist()), None
    slots = head[:, 2].tolist()
    if len(set(slots)) > 1:
        return ("micro-batch count of this window differs across the DP group (a data iterator ended early or "
                "yields a different number of micro-batches): "
                + ", ".join(f"rank {q}: {v}" for q, v in enumerate(slots))), None
    if slots[0] == 0 or (head[:, 3] == head[0, 3]).all():
        return None, None
    return None, list(texts)


def counts_of(gathered: np.ndarray, slots: int, local_batch: int, columns: int, sum_words: int = 0) -> np.ndarray:
    """int64 [slots, B, columns]: every rank's counts, natural order per slot (rank-major within a
    slot); sum_words: checksum words per sample after the counts (the self-check's)."""
    dp, width = gathered.shape
    samples = _blocks(width, columns, sum_words)[0]
    c = gathered[:, COUNTS_AT:COUNTS_AT + samples * columns].reshape(dp, samples // local_batch, local_batch,
                                                                     columns)[:, :slots]
    return c.transpose(1, 0, 2, 3).reshape(slots, dp * local_batch, columns)
