"""Every import inside ``needle/`` points down the layers that docs/architecture.md draws.

The layers are read from the page's diagram (so the picture cannot drift from the code), the
graph from the source with ``ast``, not by importing: an import inside a function (a lazy import)
is an edge like any other, because it still means the two modules need each other.
``from needle.model import io`` is an edge to ``needle.model.io`` when that is a module, else to
the package. A circle is reported as the strongly connected component it belongs to. Also here:
every import names the module that defines the name (no re-exports), an import inside a function
says why in a comment, and the package root and ``needle/model/`` stay small.

    python tests/test_import_layers.py     # prints the layer breaches and circles, exit 1 on any
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "needle"
ARCHITECTURE = ROOT / "docs" / "architecture.md"


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


def documented_layers(page: Path = ARCHITECTURE) -> list[tuple[str, list[str]]]:
    """(name, module prefixes) of each layer from top to bottom, as the page's mermaid diagram draws them.

    A box ``name["label"]`` lists paths (``needle/serve/``, ``needle/cli.py``); the ``-->`` chain
    gives the order. Boxes without a ``needle/`` path (the shell) are not layers of the package.
    """
    text = page.read_text(encoding="utf-8")
    diagram = text.split("```mermaid", 1)[1].split("```", 1)[0]
    boxes = dict(re.findall(r'^\s*(\w+)\["([^"]*)"\]', diagram, re.M))
    chain = max((line for line in diagram.splitlines() if "-->" in line), key=lambda line: line.count("-->"))
    layers = []
    for name in (part.strip() for part in chain.split("-->")):
        paths = re.findall(r"\bneedle/[\w/]+(?:\.py)?", boxes[name])
        prefixes = [path.removesuffix(".py").rstrip("/").replace("/", ".") for path in paths]
        if prefixes:
            layers.append((name, prefixes))
    return layers


def layer_of(module: str, layers: list[tuple[str, list[str]]]) -> int | None:
    """Index of the layer whose longest path prefix holds ``module`` (0 = top), or None."""
    best: tuple[int, int] | None = None
    for i, (_, prefixes) in enumerate(layers):
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + "."):
                if best is None or len(prefix) > best[0]:
                    best = (len(prefix), i)
    return None if best is None else best[1]


def layer_breaches(graph: dict[str, set[str]], layers: list[tuple[str, list[str]]]) -> list[str]:
    """Modules in no layer, and imports that point up a layer."""
    found = [f"{m}: in no layer of the diagram" for m in sorted(graph)
             if m != PACKAGE and layer_of(m, layers) is None]  # fmt: skip
    for a in sorted(graph):
        la = layer_of(a, layers)
        for b in sorted(graph[a]):
            lb = layer_of(b, layers)
            if la is not None and lb is not None and lb < la:
                found.append(f"{a} ({layers[la][0]}) -> {b} ({layers[lb][0]}): points up")
    return found


def test_the_layer_rule_sees_upward_imports():
    layers = [("top", ["pkg.top"]), ("low", ["pkg.low", "pkg.low2.py"])]
    graph = {"pkg.top": {"pkg.low"}, "pkg.low": {"pkg.top"}, "pkg.stray": set()}
    assert layer_breaches(graph, layers) == ["pkg.stray: in no layer of the diagram",
                                             "pkg.low (low) -> pkg.top (top): points up"]  # fmt: skip


def test_every_import_points_down_the_documented_layers():
    layers = documented_layers()
    assert [name for name, _ in layers][:2] == ["cli", "pipeline"], layers  # the page still draws the diagram
    found = layer_breaches(import_graph(), layers)
    assert not found, "imports against docs/architecture.md's layers:\n" + "\n".join(found)


def documented_bottom_modules(page: Path = ARCHITECTURE) -> list[str]:
    """The modules in the page's "bottom module" table."""
    text = page.read_text(encoding="utf-8")
    table = text.split("| bottom module |", 1)[1].split("\n\n", 1)[0]
    return [m.removesuffix(".py").replace("/", ".") for m in re.findall(r"^\| `(needle/[\w/]+\.py)`", table, re.M)]


def test_the_bottom_modules_import_nothing_of_their_own_package():
    graph = import_graph()
    bottoms = documented_bottom_modules()
    assert len(bottoms) >= 4, bottoms
    found = {m: sorted(d for d in graph[m] if d.rsplit(".", 1)[0] == m.rsplit(".", 1)[0]) for m in bottoms}
    assert not any(found.values()), found


def _definitions(path: Path) -> set[str]:
    """The names a module binds itself at its top (functions, classes, assignments), not by import."""
    names: set[str] = set()
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in tree.body:
        for n in [node, *getattr(node, "body", []), *getattr(node, "orelse", [])] if isinstance(node, (ast.If, ast.Try)) else [node]:
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(n.name)
            elif isinstance(n, (ast.Assign, ast.AnnAssign)):
                targets = n.targets if isinstance(n, ast.Assign) else [n.target]
                names |= {x.id for t in targets for x in ast.walk(t) if isinstance(x, ast.Name)}
    return names


SOURCES = ("needle", "flows", "tasks", "bench", "tests")
# Scripts run in cactus-needle's own virtualenv: their `needle` is cactus-needle, not this package.
OTHER_NEEDLE = {"needle/model/needle3/cact_worker.py", "bench/cactus_worker.py", "tests/model/cactus_roundtrip.py",
                "tests/data/make_needle3_format_fixtures.py", "tests/model/make_needle3_fixtures.py"}


def _sources() -> list[Path]:
    return [p for d in SOURCES for p in sorted((ROOT / d).rglob("*.py"))
            if "fixtures" not in p.relative_to(ROOT).parts and str(p.relative_to(ROOT)) not in OTHER_NEEDLE]


def reexported_uses(paths: list[Path]) -> list[str]:
    """``from M import name`` and ``M.name`` (M imported as a module) where M does not define name itself."""
    modules = module_names()
    for folder, package in (("flows", "needle_flows"), ("tasks", "needle_tasks")):  # the shell, as installed
        modules.update({f"{package}.{p.stem}": p for p in (ROOT / folder).glob("*.py") if p.stem != "__init__"})
        modules[package] = ROOT / folder / "__init__.py"
    defined: dict[str, set[str]] = {}

    def defines(module: str, name: str) -> bool:
        if module not in defined:
            defined[module] = _definitions(modules[module])
        return name in defined[module] or f"{module}.{name}" in modules

    found = []
    for path in paths:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        as_module: dict[str, str] = {}  # local name -> a module imported as an object
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] in (
                    PACKAGE, "needle_flows", "needle_tasks") and node.module not in modules:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: no module {node.module}")
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module in modules:
                for alias in node.names:
                    if f"{node.module}.{alias.name}" in modules:
                        as_module[alias.asname or alias.name] = f"{node.module}.{alias.name}"
                    elif not defines(node.module, alias.name):
                        found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {alias.name} is not defined in {node.module}")
            elif isinstance(node, ast.Import):
                as_module.update({a.asname: a.name for a in node.names if a.asname and a.name in modules})
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in as_module:
                if not defines(as_module[node.value.id], node.attr):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value.id}.{node.attr} is not "
                                 f"defined in {as_module[node.value.id]}")  # fmt: skip
    return found


def test_every_import_names_the_module_that_defines_the_name():
    found = reexported_uses(_sources())
    assert not found, "names reached through a module that only re-exports them:\n" + "\n".join(found)


def _commented(lines: list[str], i: int) -> bool:
    """Line ``i`` (0-based) carries a comment, or the block of imports it belongs to starts under one."""
    if "#" in lines[i]:
        return True
    while i > 0 and lines[i - 1].strip().startswith(("from ", "import ")):
        i -= 1
        if "#" in lines[i]:
            return True
    return i > 0 and lines[i - 1].strip().startswith("#")


def lazy_imports_without_reason(paths: list[Path]) -> list[str]:
    """Imports of needle's own modules inside a function with no comment (on the line or just above) saying why."""
    found = []
    for path in paths:
        lines = path.read_text(encoding="utf-8").splitlines()

        def visit(node: ast.AST, in_function: bool) -> None:
            for child in ast.iter_child_nodes(node):
                inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
                names = ([child.module or ""] if isinstance(child, ast.ImportFrom) and not child.level
                         else [a.name for a in child.names] if isinstance(child, ast.Import) else [])  # fmt: skip
                if in_function and any(n.split(".")[0] in ("needle", "needle_flows", "needle_tasks") for n in names):
                    said = _commented(lines, child.lineno - 1)
                    if not said:
                        found.append(f"{path.relative_to(ROOT)}:{child.lineno}: {lines[child.lineno - 1].strip()}")
                visit(child, inside)

        visit(ast.parse("\n".join(lines)), False)
    return found


def test_imports_inside_functions_say_why():
    paths = [p for d in ("needle", "flows", "tasks", "bench") for p in sorted((ROOT / d).rglob("*.py"))
             if str(p.relative_to(ROOT)) not in OTHER_NEEDLE]
    found = lazy_imports_without_reason(paths)
    assert not found, "imports inside a function with no comment saying why (a cycle, an optional dependency, an environment set first):\n" + \
        "\n".join(found)


def test_the_package_root_and_model_hold_at_most_eight_modules():
    for folder in ("needle", "needle/model"):
        modules = {p.stem for p in (ROOT / folder).glob("*.py") if p.name != "__init__.py"}
        assert len(modules) <= 8, (folder, sorted(modules))


if __name__ == "__main__":
    g = import_graph()
    cs = circles(g)
    breaches = layer_breaches(g, documented_layers())
    print(f"{len(g)} modules in {PACKAGE}/, {sum(map(len, g.values()))} import edges")
    print("\n".join(breaches) or "every import points down the documented layers")
    for c in cs:
        print(describe(c, g))
    print("no import circle" if not cs else f"{len(cs)} import circle(s), {len(circle_edges(g))} edge(s) on them")
    sys.exit(1 if cs or breaches else 0)
