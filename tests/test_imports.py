"""Imports point down: the packages' layering, read from the source (every import, function-level ones included).

    kernels  <-  engine  <-  serving  <-  kv_transfer  <-  prefill_svc, decode_svc
                        protos  <-'         router (serving, engine, protos)
                                            cli: anything; nothing imports cli

A service never imports a sibling service, the engine never imports a service, and no module imports itself
through others (no cycle).
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

BASE = {"engine", "kernels", "protos"}
ALLOWED = {  # package -> the first-party packages its modules may import
    "kernels": {"kernels"},
    "engine": {"engine", "kernels"},
    "protos": {"protos"},
    "serving": {"serving"} | BASE,
    "kv_transfer": {"kv_transfer", "serving"} | BASE,
    "prefill_svc": {"prefill_svc", "kv_transfer", "serving"} | BASE,
    "decode_svc": {"decode_svc", "kv_transfer", "serving"} | BASE,
    "router": {"router", "serving"} | BASE,
    "cli": {"cli", "router", "prefill_svc", "decode_svc", "kv_transfer", "serving"} | BASE,
}
PACKAGES = tuple(ALLOWED)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts) if path.is_relative_to(ROOT) else [path.stem]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def source_modules() -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if "_pb2" not in path.name:
                mods[module_name(path)] = path
    return mods


def imported(path: Path, mods: dict[str, Path]) -> set[str]:
    """The first-party modules `path` imports, anywhere in the file (importlib.import_module of a literal too)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                names.add(full if full in mods else base)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "import_module" and node.args and isinstance(node.args[0], ast.Constant)):
            names.add(str(node.args[0].value))
    out = set()
    for name in names:
        while name and name not in mods:  # `import a.b.c` where c is a name inside a.b
            name = name.rpartition(".")[0]
        if name and name.split(".")[0] in PACKAGES:
            out.add(name)
    out.discard(me)
    return out


MODS = source_modules()
GRAPH = {m: imported(p, MODS) for m, p in MODS.items()}


@pytest.mark.parametrize("package", PACKAGES)
def test_package_imports_only_what_it_may(package):
    bad = sorted(f"{m} imports {dep}" for m, deps in GRAPH.items() if m.split(".")[0] == package
                 for dep in deps if dep.split(".")[0] not in ALLOWED[package])
    assert not bad, "\n".join(bad)


def test_nothing_imports_the_cli():
    bad = sorted(f"{m} imports {dep}" for m, deps in GRAPH.items() if not m.startswith("cli")
                 for dep in deps if dep.split(".")[0] == "cli")
    assert not bad, "\n".join(bad)


def test_no_import_cycle():
    """Tarjan's strongly connected components over the module graph: every component is one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_the_checker_sees_function_level_imports(tmp_path):
    """The rules would be empty words if lazy imports slipped through: a function-level import counts."""
    assert "engine.model" in GRAPH["engine.model_runner"]
    fake = tmp_path / "x.py"
    fake.write_text("def f():\n    from router.core import RouterCore\n")
    assert imported(fake, {**MODS, "x": fake}) == {"router.core"}
