"""docs/faults.md is what ci/fault_table.py renders from tests/faults.py, and every fault record is run
by the test its suite names."""

import ast
import difflib
import importlib.util
from pathlib import Path

from expecttest import TestCase

import faults

ROOT = Path(__file__).resolve().parents[1]


def _renderer():
    spec = importlib.util.spec_from_file_location("fault_table", ROOT / "ci" / "fault_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_docs_fault_table_is_up_to_date():
    table = _renderer()
    want = table.render(faults.CASES, faults.SUITES)
    have = table.DOC.read_text() if table.DOC.exists() else ""
    diff = "".join(list(difflib.unified_diff(have.splitlines(True), want.splitlines(True), "docs/faults.md",
                                             "rendered", n=0))[:40])
    assert have == want, f"docs/faults.md is stale: regenerate it with `.venv/bin/python ci/fault_table.py`\n{diff}"


def test_every_suite_names_a_test_that_runs_its_records():
    """The test a suite names exists and is parametrized over faults.cases(<that suite>), so no record
    sits in the table untested."""
    for suite, (node, _) in faults.SUITES.items():
        path, _, name = node.partition("::")
        tree = ast.parse((ROOT / path).read_text())
        fn = next((f for f in tree.body if isinstance(f, ast.FunctionDef) and f.name == name), None)
        assert fn is not None, f"suite {suite!r}: {node} does not exist"
        marks = [ast.unparse(d) for d in fn.decorator_list]
        assert any(f"faults.cases({suite!r})" in m for m in marks), (suite, marks)
        assert faults.cases(suite), f"suite {suite!r} has no case"


class Golden(TestCase):
    def test_rendered_rows(self):
        cases = [
            faults.FaultCase("one", "emulated", where="rank 1's micro-batch", input="a | pipe",
                             sees=(faults.Seen("every rank", "ReorderError", "exact text", "equals"),)),
            faults.FaultCase("two", "gloo", where="vision rank 0", input="short input_ids",
                             sees=(faults.Seen("vision", "ReorderError", ("key", "other key"), note="exit 1"),
                                   faults.Seen("language", None, note="serves all"),
                                   faults.Seen("torchrun", "ChildFailedError", "Root", "starts"))),
        ]
        suites = {"emulated": ("tests/a.py::test_a", ""), "gloo": ("tests/b.py::test_b", ""),
                  "unused": ("tests/c.py::test_c", "")}
        text = _renderer().render(cases, suites)
        self.assertExpectedInline(text.partition("message.\n")[2], """\

## emulated

Tested by `tests/a.py::test_a`.

| case | injected at | input | what every rank sees |
|---|---|---|---|
| `one` | rank 1's micro-batch | a \\| pipe | **every rank**: `ReorderError`, exactly: `exact text` |

## gloo

Tested by `tests/b.py::test_b`.

| case | injected at | input | what every rank sees |
|---|---|---|---|
| `two` | vision rank 0 | short input_ids | **vision**: `ReorderError` containing `key` and `other key` (exit 1)<br>**language**: no error (serves all)<br>**torchrun**: `ChildFailedError` starting `Root` |
""")
