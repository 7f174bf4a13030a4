"""The layers hold: every import in the package (at module level and inside functions) points down
the stack plan <- batch <- exchange <- runtime <- integrations <- cli, `reorder/plan/` never imports
torch, and `spec/` never imports `reorder`."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ORDER = ["plan", "batch", "exchange", "runtime", "integrations", "cli"]
FORBIDDEN = {"plan": {"torch", "triton"}}  # third-party packages a layer must never import


def imports(path: Path) -> list:
    """(line, imported module) of every import statement in the file, wherever it is."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
    return out


def layer_breaches(package: Path, layer: str, root: Path = ROOT) -> list:
    allowed = set(ORDER[:ORDER.index(layer) + 1])
    bad = []
    for path in sorted(package.rglob("*.py")):
        for line, module in imports(path):
            parts = module.split(".")
            if parts[0] == "reorder" and len(parts) > 1 and parts[1] in ORDER and parts[1] not in allowed:
                bad.append(f"{path.relative_to(root)}:{line} imports {module}")
            if parts[0] in FORBIDDEN.get(layer, ()):
                bad.append(f"{path.relative_to(root)}:{line} imports {module}")
    return bad


@pytest.mark.parametrize("layer", ORDER)
def test_a_layer_imports_only_the_layers_below_it(layer):
    assert layer_breaches(ROOT / "reorder" / layer, layer) == []


def test_spec_never_imports_the_implementation():
    bad = [f"{p.name}:{line} imports {m}" for p in sorted((ROOT / "spec").rglob("*.py"))
           for line, m in imports(p) if m.split(".")[0] == "reorder"]
    assert bad == []


def test_the_check_sees_a_breach(tmp_path):
    (tmp_path / "bad.py").write_text("def f():\n    import torch\n    from reorder.exchange import round\n")
    assert layer_breaches(tmp_path, "plan", root=tmp_path) == ["bad.py:2 imports torch",
                                                              "bad.py:3 imports reorder.exchange"]


@pytest.mark.parametrize("package", ["reorder", "reorder.plan", "reorder.batch", "reorder.exchange", "reorder.runtime",
                                     "reorder.integrations"])
def test_every_package_exports_its_public_names(package):
    """`__all__` names exist, and each is defined in the package's own layer (no re-export of a
    layer above, which would break the import order)."""
    import importlib

    mod = importlib.import_module(package)
    assert mod.__all__ and sorted(mod.__all__) == sorted(set(mod.__all__))
    for name in mod.__all__:
        obj = getattr(mod, name)
        home = getattr(obj, "__module__", None) or package
        if package != "reorder" and isinstance(obj, type | type(len) | type(lambda: 0)):
            assert home.startswith(package), (name, home)
