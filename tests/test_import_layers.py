"""Every import inside ``needle/`` points down a layer: no module imports one that imports it back.

The graph is read from the source with ``ast``, not by importing: an import inside a function
(a lazy import) is an edge like any other, because it still means the two modules need each
other. ``from needle.model import hf`` is an edge to ``needle.model.hf`` when that is a module,
else to the package. A circle is reported as the strongly connected component it belongs to.

    python tests/test_import_layers.py     # prints the circles (or "no import circle"), exit 1 on any
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "needle"


def module_names(root: Path = ROOT, package: str = PACKAGE) -> dict[str, Path]:
    """Dotted name -> file of every module of the package (a package is its ``__init__``)."""
    names = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _resolve(name: str, level: int, current: str, is_package: bool) -> str:
    if not level:
        return name
    base = current.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that ``module`` imports anywhere in its file (lazy imports included)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    is_package = path.name == "__init__.py"
    found: set[str] = set()

    def add(name: str) -> None:
        # The deepest prefix that is one of the package's modules.
        parts = name.split(".")
        for n in range(len(parts), 0, -1):
            candidate = ".".join(parts[:n])
            if candidate in modules:
                found.add(candidate)
                return

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(node.module or "", node.level, module, is_package)
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                add(sub if sub in modules else target)
    found.discard(module)
    # A module's own package (its __init__) runs first anyway; an edge up to it is no layer breach.
    return {m for m in found if not module.startswith(m + ".")}


def import_graph(root: Path = ROOT, package: str = PACKAGE) -> dict[str, set[str]]:
    modules = module_names(root, package)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def describe(component: list[str], graph: dict[str, set[str]]) -> str:
    members = set(component)
    edges = [f"{a} -> {b}" for a in component for b in sorted(graph[a] & members)]
    return f"circle of {len(component)}: " + "; ".join(edges)


def test_the_graph_sees_lazy_and_relative_imports(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "low.py").write_text("X = 1\n")
    (pkg / "sub" / "a.py").write_text("def f():\n    from pkg.sub import b\n")
    (pkg / "sub" / "b.py").write_text("from . import a\nfrom ..low import X\n")
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.sub.a"] == {"pkg.sub.b"}
    assert graph["pkg.sub.b"] == {"pkg.sub.a", "pkg.low"}
    assert circles(graph) == [["pkg.sub.a", "pkg.sub.b"]]


def circle_edges(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    """Every import edge that lies on a circle (both ends in one strongly connected component)."""
    return {(a, b) for c in circles(graph) for a in c for b in graph[a] & set(c)}


def test_no_import_circle_in_needle():
    graph = import_graph()
    found = circles(graph)
    assert not found, "imports that close a circle in needle/ (move the shared piece down a layer):\n" + "\n".join(
        describe(c, graph) for c in found)


def test_the_untangled_circles_stay_untangled():
    # tokenizer <-> hf_tokenizer (shared layer: tokenizer_base), tracking <-> mlflow_tracker
    # (redaction), io -> adapter -> hf_export -> hf_weights -> io (layout); Needle 3: needle3_io <-> io
    # and needle3_export <-> adapter (layout), needle3_format <-> eval.parse <-> render and
    # needle3_tokenizer <-> needle3_format (needle3_markers; parse_needle3 in eval/parse.py).
    graph = import_graph()
    on_circles = {m for c in circles(graph) for m in c}
    untangled = {"needle.tokenizer", "needle.hf_tokenizer", "needle.tracking", "needle.mlflow_tracker",
                 "needle.model.hf_export", "needle.model.hf_weights", "needle.tokenizer_base",
                 "needle.redaction", "needle.model.layout", "needle.model.io", "needle.model.needle3_io",
                 "needle.model.adapter", "needle.model.needle3_export", "needle.data.needle3_format",
                 "needle.data.render", "needle.eval.parse", "needle.needle3_tokenizer", "needle.needle3_markers"}
    assert not on_circles & untangled, sorted(on_circles & untangled)


def test_evaluation_decodes_without_serving():
    # The grammars and token masks live in needle/eval/constrain.py (needle/serve/constrain.py
    # re-exports them) and decoding in needle/eval/decode.py: nothing in needle/eval imports
    # needle/serve. The `needle predict` / `needle evaluate` runner drives serving's Predictor, so
    # it is needle/serve/predict.py, above both.
    graph = import_graph()
    up = sorted(f"{a} -> {b}" for a, deps in graph.items() for b in deps
                if a.startswith("needle.eval") and b.startswith("needle.serve"))
    assert not up, up


if __name__ == "__main__":
    g = import_graph()
    cs = circles(g)
    print(f"{len(g)} modules in {PACKAGE}/, {sum(map(len, g.values()))} import edges")
    for c in cs:
        print(describe(c, g))
    print("no import circle" if not cs else f"{len(cs)} import circle(s), {len(circle_edges(g))} edge(s) on them")
    sys.exit(1 if cs else 0)
