"""The package's layout (DESIGN.md, "one idea per module"): no import cycle between kvserve's
modules, none between its folders (kvserve/engine, kvserve/kv, ...; a top-level module such as
kvserve/llm.py is a node of its own), and no file over 400 lines.

The import graph is read with `ast` from every import statement of every file, at module level
or inside a function (a lazy import still ties two modules together), relative imports resolved;
only imports under `if TYPE_CHECKING:` are left out (they never run). `from P import n` is an
edge to the module P.n when there is one, else to P (the module that defines n)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "kvserve"
MAX_LINES = 400

# Module cycles allowed, each as the set of its modules: none.
ALLOWED_MODULE_CYCLES: list[frozenset] = []


def modules() -> dict[str, Path]:
    """Dotted name -> file, for every .py file under kvserve/ (a package is its __init__.py)."""
    out = {}
    for p in sorted(PACKAGE.rglob("*.py")):
        parts = p.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imported_names(tree: ast.AST, module: str, is_package: bool) -> list[tuple[str, list[str]]]:
    """(absolute module, names imported from it) of every import statement outside
    `if TYPE_CHECKING:`; `import a.b` gives ("a.b", [])."""
    out: list[tuple[str, list[str]]] = []
    package = module if is_package else module.rpartition(".")[0]

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            out.extend((a.name, []) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module
            out.append((source, [a.name for a in node.names]))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the kvserve modules it imports."""
    mods = modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        for source, names in imported_names(tree, m, path.name == "__init__.py"):
            targets = [f"{source}.{n}" if f"{source}.{n}" in mods else source for n in names] or [source]
            graph[m].update(t for t in targets if t in mods and t != m)
    return graph


def folder(module: str) -> str:
    """kvserve.engine.scheduler -> kvserve.engine; kvserve.llm -> kvserve.llm; kvserve -> kvserve."""
    return ".".join(module.split(".")[:2])


def folder_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {folder(m): set() for m in graph}
    for m, targets in graph.items():
        out[folder(m)].update(folder(t) for t in targets if folder(t) != folder(m))
    return out


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one node (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = set()
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.add(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(comp)
    return found


def edges_within(graph: dict[str, set[str]], comp: set[str]) -> list[str]:
    return [f"{a} -> {b}" for a in sorted(comp) for b in sorted(graph[a] & comp)]


# -- the checker checks ------------------------------------------------------------------------------
def test_cycle_finder_on_a_known_graph():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a", "e"}, "e": {"d"}, "f": set(), "g": {"g"}}
    assert sorted(map(sorted, cycles(g))) == [["a", "b", "c"], ["d", "e"]]


def test_imports_are_read_relative_lazy_and_not_type_checking():
    src = ("from . import kvmath\nfrom ..kv.tiers import parse_size\nimport kvserve.llm\n"
           "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kvserve.engine import x\n"
           "else:\n    import kvserve.outputs\n"
           "def f():\n    from kvserve.server import app\n")
    got = imported_names(ast.parse(src), "kvserve.analysis.cli", is_package=False)
    assert got == [("kvserve.analysis", ["kvmath"]), ("kvserve.kv.tiers", ["parse_size"]), ("kvserve.llm", []),
                   ("typing", ["TYPE_CHECKING"]), ("kvserve.outputs", []), ("kvserve.server", ["app"])]
    assert imported_names(ast.parse("from .tiers import x"), "kvserve.kv", is_package=True) == \
        [("kvserve.kv.tiers", ["x"])]
    assert folder("kvserve.engine.scheduler") == "kvserve.engine" and folder("kvserve.llm") == "kvserve.llm"


def test_the_graph_sees_kvserves_own_imports():
    graph = import_graph()
    assert "kvserve.kv.tier_store" in graph["kvserve.kv.disk_store"]
    assert "kvserve.kv.disk_store" in graph["kvserve.kv.tiers"]          # a lazy import, inside a function


# -- the layout --------------------------------------------------------------------------------------
def test_no_import_cycle_between_modules():
    graph = import_graph()
    bad = [c for c in cycles(graph) if frozenset(c) not in ALLOWED_MODULE_CYCLES]
    assert not bad, "import cycles between modules:\n" + "\n".join(
        ", ".join(sorted(c)) + ":\n  " + "\n  ".join(edges_within(graph, c)) for c in bad)


def test_no_import_cycle_between_folders():
    graph = import_graph()
    fg = folder_graph(graph)
    found = cycles(fg)
    lines = []
    for c in found:
        lines.append(" <-> ".join(sorted(c)) + ":")
        lines += [f"  {a} -> {b}" for a in sorted(graph) for b in sorted(graph[a])
                  if folder(a) in c and folder(b) in c and folder(a) != folder(b)]
    assert not found, "import cycles between folders:\n" + "\n".join(lines)


def test_no_file_over_400_lines():
    long = {str(p.relative_to(PACKAGE.parent)): n for p in modules().values()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"files over {MAX_LINES} lines (split them): {long}"
