"""The self-check's checksum layout (numbers only): how many checksum words a sample carries in the
window frame, which word a field's checksum goes to, and the word width a field is read in.

A shard's buffers are laid out as `reorder.batch.blocks.field_buffers` gives them, in `byte_fields`
order: a dense field of `pre` leading entries holds its n samples as `[pre, n, unit]` bytes, a
per-row or per-image field its entries (`unit` bytes each) sample after sample, the list field the
samples' pickled bytes one after the other. `reorder.batch.checksum` reads each field in words of
`word_width` bytes: a width that divides every entry, so sender and receiver, whose buffers hold
the same layout, cut the bytes alike.
"""

from __future__ import annotations

CHECKED_FIELDS = 16  # checksum words per sample in the window frame: fields 15, 16, ... share the last


def field_slot(field: int) -> int:
    """The checksum word of field `field` (layout order) in its sample's CHECKED_FIELDS words."""
    return min(field, CHECKED_FIELDS - 1)


def field_salt(field: int) -> int:
    """What field `field`'s entry indices are offset by in its checksum: 0 for a field with a word of
    its own, (field - CHECKED_FIELDS + 1) * 2**32 for those that share the last word, so that they
    differ there."""
    return max(0, field - (CHECKED_FIELDS - 1)) << 32


def word_width(kind: str, unit: int) -> int:
    """Bytes per word a field is read in: the widest of 8, 4, 2, 1 dividing its unit (1 for list
    bytes, whose lengths vary)."""
    if kind == "list":
        return 1
    return (unit | 8) & -(unit | 8)
