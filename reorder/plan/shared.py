"""Values that a cache hands to every caller alike (`functools.lru_cache` around a function): their
arrays are made read-only, so that no caller can change them for the others."""

from __future__ import annotations

import numpy as np


def read_only(a: np.ndarray) -> np.ndarray:
    """`a`, made read-only in place (a view of it can no longer be made writeable either)."""
    a.setflags(write=False)
    return a
