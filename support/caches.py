"""The library's caches, emptied before every test (tests/conftest.py): a value an earlier test,
or mutmut's parent process, left there would spare a test the code that makes it, and that code's
mutants would survive."""

from __future__ import annotations

import functools
import inspect
import sys


def clear_caches() -> None:
    """Empty every function cache of the `reorder` modules imported so far (`functools.lru_cache`
    around a function; one around a class makes shared values, and is left alone)."""
    for name, module in list(sys.modules.items()):
        if name != "reorder" and not name.startswith("reorder."):
            continue
        for value in vars(module).values():
            if isinstance(value, functools._lru_cache_wrapper) and inspect.isfunction(value.__wrapped__):
                value.cache_clear()
