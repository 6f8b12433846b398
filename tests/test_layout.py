"""The Python layer's layout (issue 29): data flows one way, so no import circle between modules
or between subpackages, function-level imports included; and no module or class so large that
it decides several things."""
from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "python" / "stowlm"
MAX_MODULE_LINES = 550  # "about 500"
MAX_CLASS_LINES = 275   # "about 250"


def module_name(path: Path) -> str:
    parts = ["stowlm"] + list(path.relative_to(PKG).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict:
    return {module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def imports_of(name: str, path: Path, known: set) -> set:
    """The stowlm modules `name` imports anywhere in its body (a package counts as its
    __init__; `from pkg import mod` as mod where mod is a module)."""
    is_pkg = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            # `from pkg import mod` imports the module mod; `from mod import name`, mod
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t.startswith("stowlm") and t != name:
                out.add(t)
    return out


def graph() -> dict:
    mods = modules()
    # the native extension (_core*.so) is a leaf
    known = set(mods) | {"stowlm." + p.name.split(".")[0] for p in PKG.glob("_core*") if p.suffix in (".so", ".pyd")} | {"stowlm._core"}
    return {n: imports_of(n, p, known) for n, p in mods.items()}


def cycles(g: dict) -> list:
    """Strongly connected components of more than one node (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def unit(name: str) -> str:
    """A subpackage stands for all its modules; a top-level module for itself."""
    parts = name.split(".")
    return ".".join(parts[:2])


def test_no_import_circle_between_modules():
    found = cycles(graph())
    assert not found, "import circles (function-level imports included): " + "; ".join(" <-> ".join(c) for c in found)


def test_no_import_circle_between_subpackages():
    g = {}
    for src, dsts in graph().items():
        g.setdefault(unit(src), set()).update(unit(d) for d in dsts if unit(d) != unit(src))
    found = cycles(g)
    assert not found, "circles between subpackages / top-level modules: " + "; ".join(" <-> ".join(c) for c in found)


def test_modules_and_classes_stay_small():
    big = []
    for name, path in modules().items():
        text = path.read_text()
        n = text.count("\n")
        if n > MAX_MODULE_LINES:
            big.append(f"{name}: {n} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                big.append(f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert not big, "too large to decide one thing: " + ", ".join(big)


def test_the_checker_sees_circles(tmp_path):
    """The oracle itself: a planted circle, function-level import included, is found."""
    g = {"stowlm.a": {"stowlm.b"}, "stowlm.b": {"stowlm.c"}, "stowlm.c": {"stowlm.a"}, "stowlm.d": {"stowlm.a"}}
    assert cycles(g) == [["stowlm.a", "stowlm.b", "stowlm.c"]]
    src = tmp_path / "m.py"
    src.write_text("import os\n\ndef f():\n    from .engine import plan\n    from . import fit as fitting\n")
    known = {"stowlm.engine", "stowlm.fit", "stowlm.m"}
    assert imports_of("stowlm.m", src, known) == {"stowlm.engine", "stowlm.fit"}
