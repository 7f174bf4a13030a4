"""The caches of the files mutation testing mutates (`[tool.mutmut] only_mutate` in
pyproject.toml), emptied before every test (tests/conftest.py): a value an earlier test, or
mutmut's parent process, left there would spare a test the code that makes it, and that code's
mutants would survive."""

from __future__ import annotations

import functools
import inspect
import sys
import tomllib
from pathlib import Path


def mutated_modules() -> list:
    """The module names of `[tool.mutmut] only_mutate`."""
    with open(Path(__file__).resolve().parents[1] / "pyproject.toml", "rb") as f:
        files = tomllib.load(f)["tool"]["mutmut"]["only_mutate"]
    return [f.removesuffix(".py").replace("/", ".") for f in files]


MUTATED = mutated_modules()


def clear_caches() -> None:
    """Empty `checksum._PLANS` (launch block layouts) and every function cache of the mutated
    modules imported so far (`functools.lru_cache` around a function; one around a class makes
    shared values, and is left alone)."""
    for name in MUTATED:
        module = sys.modules.get(name)
        if module is None:
            continue
        for value in vars(module).values():
            if isinstance(value, functools._lru_cache_wrapper) and inspect.isfunction(value.__wrapped__):
                value.cache_clear()
    checksum = sys.modules.get("reorder.batch.checksum")
    if checksum is not None:
        checksum._PLANS.clear()
