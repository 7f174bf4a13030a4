"""Every function cache of the library hands out one value to every caller: no caller may be able
to change it for the others. Arrays come back read-only; containers are tuples (or read-only
mappings); nothing else that can be written."""

import importlib
import pkgutil
import types

import numpy as np
import pytest

import reorder
from reorder.plan.counts import SampleCounts
from reorder.plan.moves import ByteField
from support import caches

FIELDS = (ByteField("dense", 2, 8), ByteField("row", 1, 12), ByteField("list", 1, 1))

# cache -> the arguments it is called with here (None: it caches no data a caller could write)
CALLS = {
    "reorder.plan.balancers._partitions": [(2, 3), (3, 2)],
    "reorder.plan.balancers._partition_columns": [(2, 3), (3, 2)],
    "reorder.plan.balancers._subset_matrix": [(3,)],
    "reorder.plan.balancers._half_masks": [(3,)],
    "reorder.plan.balancers._permutations": [(3,)],
    "reorder.plan.moves._columns": [(FIELDS,), ((),)],
    "reorder.batch.checksum._block_plan": [(FIELDS, (3, 2), 16)],
    "reorder.batch.keepalive._stream": None,  # a torch.cuda.Stream, made for the current stream's handle
}


def function_caches() -> dict:
    """`support.caches.function_caches` of every module of the library."""
    for info in pkgutil.walk_packages(reorder.__path__, "reorder."):
        if not info.name.endswith("__main__"):
            importlib.import_module(info.name)
    return caches.function_caches()


def writable(value, where="value") -> list:
    """Where in `value` a caller could write: writeable arrays, lists, dicts, sets, other objects."""
    if isinstance(value, np.ndarray):
        return [where] if value.flags.writeable or value.dtype == object else []
    if isinstance(value, (bool, int, float, str, bytes, type(None), np.generic)):
        return []
    if isinstance(value, tuple):
        return [w for i, v in enumerate(value) for w in writable(v, f"{where}[{i}]")]
    if isinstance(value, types.MappingProxyType):
        return [w for k, v in value.items() for w in writable(v, f"{where}[{k!r}]")]
    if hasattr(value, "unpack_from") and hasattr(value, "format"):  # struct.Struct: no state to change
        return []
    return [f"{where} ({type(value).__name__})"]


def test_every_function_cache_is_listed():
    assert sorted(function_caches()) == sorted(CALLS)


@pytest.mark.parametrize("name", [n for n, calls in CALLS.items() if calls])
def test_a_cached_value_cannot_be_changed_by_its_caller(name):
    cache = function_caches()[name]
    for args in CALLS[name]:
        assert writable(cache(*args)) == [], args


def test_the_writability_check_finds_what_a_caller_could_change():
    a = np.zeros(3)
    frozen = np.zeros(3)
    frozen.setflags(write=False)
    value = (frozen, a, [1], {"k": 1}, types.MappingProxyType({"x": a}), SampleCounts.of(rows=np.zeros(1, np.int64)))
    assert writable(value) == ["value[1]", "value[2] (list)", "value[3] (dict)", "value[4]['x']",
                               "value[5] (SampleCounts)"]
