"""The library's caches, emptied before every test (tests/conftest.py): a value an earlier test,
or mutmut's parent process, left there would spare a test the code that makes it, and that code's
mutants would survive."""

from __future__ import annotations

import functools
import inspect
import sys


def function_caches() -> dict:
    """'module.name' -> every `functools.lru_cache` around a plain function of the `reorder` modules
    imported so far, under the module that defines the function (one around a class makes shared
    values, and is left out)."""
    out = {}
    for name, module in list(sys.modules.items()):
        if name == "reorder" or name.startswith("reorder."):
            for attr, value in vars(module).items():
                if isinstance(value, functools._lru_cache_wrapper) and inspect.isfunction(value.__wrapped__) \
                        and value.__wrapped__.__module__ == name:
                    out[f"{name}.{attr}"] = value
    return out


def clear_caches() -> None:
    """Empty every function cache of the `reorder` modules imported so far (`function_caches`)."""
    for cache in function_caches().values():
        cache.cache_clear()
