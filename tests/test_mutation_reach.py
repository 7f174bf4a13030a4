"""What mutation testing reaches: mutmut leaves out every function with a decorator but
@staticmethod and @classmethod, so the mutated files (`[tool.mutmut] only_mutate`) keep their
caches as plain functions wrapped by a call, and properties are the only decorated functions
there (`ci/mutation/summary.md` counts them); and the tests' cache fixture empties every function
cache of the library, so a value cached before a test never spares it the code that makes it."""

import functools
from pathlib import Path

import pytest

from ci.mutation_sample import decorated_functions, module_of, mutated_files
from support.caches import clear_caches

pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11")
ROOT = Path(__file__).resolve().parents[1]
MUTATED = [module_of(path) for path in mutated_files()]


def unmutated(path: Path) -> list:
    """(line, function, decorators) of every function of the file that mutmut leaves out and that
    is not a property."""
    return [(line, name, names) for line, name, names, _ in decorated_functions(path) if names != ["property"]]


def test_mutmut_mutates_every_function_of_the_mutated_files_but_properties():
    paths = [ROOT / (name.replace(".", "/") + ".py") for name in MUTATED]
    assert paths and all(p.exists() for p in paths)
    left_out = [f"{p.relative_to(ROOT)}:{line} {fn} {names}" for p in paths for line, fn, names in unmutated(p)]
    assert left_out == []


def test_the_reach_check_sees_a_decorated_function(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("import functools\n\n@functools.lru_cache(maxsize=None)\ndef f(x):\n    return x\n\n"
                 "class C:\n    @property\n    def p(self):\n        return 1\n\n    @staticmethod\n    def s():\n"
                 "        return 2\n")
    assert unmutated(f) == [(4, "f", ["functools.lru_cache(maxsize=None)"])]


def test_the_cache_fixture_empties_every_function_cache_of_the_mutated_files():
    from reorder.batch import checksum, layout
    from reorder.plan import balancers, moves

    caches = [balancers._partitions, balancers._permutations, balancers._subset_matrix, balancers._half_masks,
              balancers._partition_columns, moves._columns, checksum._block_plan]
    balancers._partition_columns(2, 3)
    balancers._half_masks(3)  # and _partitions(2, 3)
    balancers._subset_matrix(3)
    balancers._permutations(3)
    moves._columns(())
    shared = layout._dense_field(("x",), 0, layout.torch.int64, (2,))  # a class cache: shared field values
    checksum._block_plan((), (1,), 16)
    assert all(c.cache_info().currsize for c in caches)
    clear_caches()
    assert [c.cache_info().currsize for c in caches] == [0] * len(caches)
    assert layout._dense_field(("x",), 0, layout.torch.int64, (2,)) is shared


@pytest.mark.parametrize("name", MUTATED)
def test_every_function_cache_of_a_mutated_file_wraps_a_plain_function(name):
    module = __import__(name, fromlist=["_"])
    wrapped = [v.__wrapped__ for v in vars(module).values() if isinstance(v, functools._lru_cache_wrapper)]
    # a cache around a plain function of the module: mutmut mutates that function (no decorator)
    for fn in wrapped:
        assert isinstance(fn, type) or fn.__module__ == name, fn
