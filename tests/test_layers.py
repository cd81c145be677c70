"""Layers point down (docs/design.md, "Layers"): every import under src/lenscope goes from a package to one in
the same or a lower layer, the package graph has no cycle, and viz never imports a method or an application.

The layers, lowest first (a package is the first name under ``lenscope``; the single modules errors, memory, registry,
results, stats and version are layer 0, each its own node):

    layer 0  errors, memory, registry, results, stats, version
    core     models, data, distributed, training
    viz      draws results
    methods  lenses, attribution, mixing, interventions, circuits, steering, features
    apps     report, evaluate, detect, sweeps, generation, serve
    top      cli, lenscope/__init__.py (``__init__``), __main__

Every import counts: module level and inside functions, ``import x`` and ``from x import y``, relative ones
resolved against the importing module, and those under ``if TYPE_CHECKING:`` too (they never run, but a type
hint naming a higher layer is still a dependency: viz takes results through protocols (each view folder's)
or as payloads, never by naming a method's class). A method's ``.plot()`` importing viz points down, so it is
allowed.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "lenscope"

LAYERS: dict[str, tuple[str, ...]] = {
    "layer 0": ("errors", "memory", "registry", "results", "stats", "version"),
    "core": ("models", "data", "distributed", "training"),
    "viz": ("viz",),
    "methods": ("lenses", "attribution", "mixing", "interventions", "circuits", "steering", "features"),
    "apps": ("report", "evaluate", "detect", "sweeps", "generation", "serve"),
    "top": ("cli", "__init__", "__main__"),
}
RANK = {pkg: i for i, pkgs in enumerate(LAYERS.values()) for pkg in pkgs}
LAYER_OF = {pkg: name for name, pkgs in LAYERS.items() for pkg in pkgs}


# ---------------------------------------------------------------------------------------------- collecting


def module_name(path: Path, root: Path) -> str:
    """``root/mixing/alti.py`` -> ``lenscope.mixing.alti``; ``root/data/__init__.py`` -> ``lenscope.data``."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(["lenscope", *parts])


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


class _Imports(ast.NodeVisitor):
    """Every imported module name (absolute, dotted) with its line; ``if TYPE_CHECKING:`` bodies too unless
    ``type_checking`` is False."""

    def __init__(self, module: str, is_package: bool, root: Path, type_checking: bool = True):
        self.package = module if is_package else module.rpartition(".")[0]
        self.root = root
        self.type_checking = type_checking
        self.found: list[tuple[str, int]] = []

    def visit_If(self, node: ast.If) -> None:
        if _is_type_checking(node.test) and not self.type_checking:
            for child in node.orelse:  # the else branch runs
                self.visit(child)
            return
        self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self.found.append((alias.name, node.lineno))

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            parts = self.package.split(".")
            base = ".".join(parts[: len(parts) - (node.level - 1)])
            base = f"{base}.{node.module}" if node.module else base
        else:
            base = node.module or ""
        for alias in node.names:  # ``from pkg import sub`` imports the submodule pkg.sub when there is one
            sub = f"{base}.{alias.name}"
            self.found.append((sub if _exists(sub, self.root) else base, node.lineno))


def _exists(module: str, root: Path) -> bool:
    parts = module.split(".")
    if parts[0] != "lenscope" or len(parts) < 2:
        return False
    p = root.joinpath(*parts[1:])
    return p.with_suffix(".py").is_file() or (p / "__init__.py").is_file()


def package_of(module: str) -> str | None:
    """``lenscope.mixing.alti`` -> ``mixing``; ``lenscope`` -> ``__init__``; not lenscope -> None."""
    parts = module.split(".")
    if parts[0] != "lenscope":
        return None
    return parts[1] if len(parts) > 1 else "__init__"


def collect_edges(root: Path, type_checking: bool = True) -> dict[tuple[str, str], list[str]]:
    """``(from package, to package) -> ["file:line imports module", ...]`` for every lenscope import between two
    different packages under ``root`` (the ``src/lenscope`` folder); ``type_checking=False`` leaves out the
    imports under ``if TYPE_CHECKING:``."""
    edges: dict[tuple[str, str], list[str]] = {}
    for path in sorted(root.rglob("*.py")):
        module = module_name(path, root)
        src_pkg = package_of(module)
        if path.name == "__init__.py" and path.parent == root:
            src_pkg = "__init__"
        visitor = _Imports(module, path.name == "__init__.py", root, type_checking)
        visitor.visit(ast.parse(path.read_text(encoding="utf-8"), str(path)))
        for target, line in visitor.found:
            dst_pkg = package_of(target)
            if dst_pkg is None or dst_pkg == src_pkg:
                continue
            edges.setdefault((src_pkg, dst_pkg), []).append(f"{path.relative_to(root.parent)}:{line} imports {target}")
    return edges


# ---------------------------------------------------------------------------------------------- checking


def find_cycle(edges) -> list[str] | None:
    """One cycle of the package graph (``[a, b, ..., a]``), or None when it has none."""
    graph: dict[str, list[str]] = {}
    for a, b in sorted(edges):
        graph.setdefault(a, []).append(b)
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        path.append(n)
        for m in graph.get(n, []):
            if state.get(m) == 1:
                return path[path.index(m):] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        path.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def violations(edges) -> list[str]:
    """What breaks the layering: packages outside the table, imports that point up, viz importing a method or
    an application, and a cycle."""
    out = []
    for pkg in sorted({p for e in edges for p in e} - set(RANK)):
        out.append(f"package {pkg!r} is in no layer: add it to LAYERS here and to docs/design.md")
    for (a, b), where in sorted(edges.items()):
        if a not in RANK or b not in RANK:
            continue
        if a == "viz" and LAYER_OF[b] in ("methods", "apps"):
            out.append(f"viz imports {LAYER_OF[b]} package {b!r} (viz draws results only): {where[0]}")
        elif RANK[b] > RANK[a]:
            out.append(f"{a!r} ({LAYER_OF[a]}) imports {b!r} ({LAYER_OF[b]}), a higher layer: {'; '.join(where)}")
    cycle = find_cycle(edges)
    if cycle:
        steps = "; ".join(f"{x} -> {y}: {edges[(x, y)][0]}" for x, y in zip(cycle, cycle[1:]))
        out.append(f"the package graph has a cycle {' -> '.join(cycle)} ({steps})")
    return out


# ---------------------------------------------------------------------------------------------- the tests


def test_every_package_is_in_a_layer():
    on_disk = {p.name for p in SRC.iterdir() if (p / "__init__.py").is_file() or (p.is_dir() and any(p.glob("*.py")))}
    on_disk |= {p.stem for p in SRC.glob("*.py")}
    assert on_disk - set(RANK) == set(), "add the new package to LAYERS (and to docs/design.md)"


def test_layers_point_down():
    edges = collect_edges(SRC)
    assert edges, "no imports found: the walker is broken"
    assert ("mixing", "models") in edges  # sanity: a known downward import is seen
    problems = violations(edges)
    assert not problems, "\n".join(problems)


def test_no_package_cycle_counting_type_checking_imports():
    """Issue 30: the package graph has no cycle even with the imports under ``if TYPE_CHECKING:`` counted, and
    viz names no method or application type, not even for a type hint."""
    edges = collect_edges(SRC, type_checking=True)
    runtime = collect_edges(SRC, type_checking=False)
    assert set(runtime) <= set(edges) and ("__init__", "attribution") in edges  # lenscope/__init__'s hints seen
    assert find_cycle(edges) is None, find_cycle(edges)
    assert not [e for e in edges if e[0] == "viz" and LAYER_OF.get(e[1]) in ("methods", "apps")], \
        {e: w for e, w in edges.items() if e[0] == "viz" and LAYER_OF.get(e[1]) in ("methods", "apps")}


def test_methods_compute_and_viz_draws():
    """Issue 30: no methods package draws (imports matplotlib); its results' ``plot()`` calls viz."""
    drawing = [str(p.relative_to(SRC)) for pkg in LAYERS["methods"] for p in sorted((SRC / pkg).rglob("*.py"))
               if "import matplotlib" in p.read_text(encoding="utf-8")]
    assert not drawing, f"drawing code in a methods package (move it under viz/): {drawing}"
    assert any("import matplotlib" in p.read_text(encoding="utf-8") for p in (SRC / "viz").glob("*_plots.py"))
    from lenscope.interventions import plots as old  # the heat maps moved to viz; their old names still import
    from lenscope.viz import intervention_plots as new

    assert old.heatmap is new.heatmap and old.heatmaps is new.heatmaps


def test_checker_finds_upward_edges_cycles_and_viz_imports():
    edges = {("models", "lenses"): ["models/x.py:3 imports lenscope.lenses"],
             ("lenses", "attribution"): ["lenses/a.py:1 imports lenscope.attribution"],
             ("attribution", "lenses"): ["attribution/b.py:9 imports lenscope.lenses.c"],
             ("viz", "detect"): ["viz/p.py:2 imports lenscope.detect"],
             ("cli", "models"): ["cli/m.py:5 imports lenscope.models.load"],
             ("newpkg", "errors"): ["newpkg/x.py:1 imports lenscope.errors"]}
    problems = violations(edges)
    assert any("'models' (core) imports 'lenses' (methods)" in p for p in problems)
    assert any(p.startswith("viz imports apps package 'detect'") for p in problems)
    assert any("cycle attribution -> lenses -> attribution" in p for p in problems)
    assert any("'newpkg' is in no layer" in p for p in problems)
    assert not any(p.startswith("'cli'") for p in problems)  # top -> core points down
    assert find_cycle({("a", "b"): [], ("b", "c"): []}) is None
    assert find_cycle({("a", "b"): [], ("b", "c"): [], ("c", "a"): []}) == ["a", "b", "c", "a"]


def test_collector_resolves_relative_imports_and_skips_type_checking(tmp_path):
    root = tmp_path / "lenscope"
    for d in ("models", "viz", "lenses"):
        (root / d).mkdir(parents=True)
        (root / d / "__init__.py").write_text("")
    (root / "__init__.py").write_text("from .models import load\n")
    (root / "errors.py").write_text("")
    (root / "models" / "load.py").write_text("from ..errors import X\n\ndef f():\n    from ..lenses import y\n")
    (root / "viz" / "plots.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..lenses import Lens\nelse:\n"
        "    import lenscope.errors\nfrom .. import errors\n")
    edges = collect_edges(root, type_checking=False)
    assert set(edges) == {("__init__", "models"), ("models", "errors"), ("models", "lenses"), ("viz", "errors")}
    assert edges[("models", "lenses")] == ["lenscope/models/load.py:4 imports lenscope.lenses"]
    assert len(edges[("viz", "errors")]) == 2  # the else branch of TYPE_CHECKING counts; its body does not
    assert [p for p in violations(edges) if "'models' (core) imports 'lenses'" in p]
    everything = collect_edges(root)  # by default the TYPE_CHECKING body counts too
    assert set(everything) == set(edges) | {("viz", "lenses")}
    assert everything[("viz", "lenses")] == ["lenscope/viz/plots.py:3 imports lenscope.lenses"]
    assert [p for p in violations(everything) if p.startswith("viz imports methods package 'lenses'")]


def private_imports(root: Path) -> list[str]:
    """``file:line imports NAME from MODULE`` for every ``from MODULE import _NAME`` (a private name: one leading
    underscore) where MODULE lies in another package than the importing file, inside functions and under
    ``TYPE_CHECKING`` too. A package's private names are its own; what another package needs is public."""
    out = []
    for path in sorted(root.rglob("*.py")):
        module = module_name(path, root)
        src_pkg = "__init__" if path.name == "__init__.py" and path.parent == root else package_of(module)
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - (node.level - 1)])
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module or ""
            dst_pkg = package_of(base)
            if dst_pkg is None or dst_pkg == src_pkg:
                continue
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    out.append(f"{path.relative_to(root.parent)}:{node.lineno} imports {alias.name} from {base}")
    return out


def test_no_module_imports_another_packages_private_name():
    found = private_imports(SRC)
    assert not found, "private names imported across packages (make them public in their home):\n" + "\n".join(found)


def test_private_import_checker(tmp_path):
    root = tmp_path / "lenscope"
    for d in ("models", "serve", "attribution"):
        (root / d).mkdir(parents=True)
        (root / d / "__init__.py").write_text("")
    (root / "attribution" / "dla.py").write_text("from ..models.algebra import head_writes\nfrom .x import _own\n")
    (root / "serve" / "api.py").write_text("def f():\n    from ..attribution.dla import _head_writes, ok\n"
                                           "from lenscope.models.load import __version__\n")
    assert private_imports(root) == ["lenscope/serve/api.py:2 imports _head_writes from lenscope.attribution.dla"]


if __name__ == "__main__":  # pragma: no cover - print the package graph
    for (a, b), where in sorted(collect_edges(SRC).items()):
        print(f"{a:>14} -> {b:<14} {len(where)}")
    pytest.main([__file__])


MAX_LINES = 600


def test_no_source_file_over_max_lines():
    """Issue 17: no module grows past MAX_LINES lines (split it along what it mixes)."""
    src = Path(__file__).resolve().parents[1] / "src" / "lenscope"
    long = {str(p.relative_to(src)): n for p in src.rglob("*.py") if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"source files over {MAX_LINES} lines: {long}"
    assert len(list(src.rglob("*.py"))) > 50  # the walk really saw the package


MAX_FUNCTION_LINES = 150


def long_functions(root: Path, limit: int = MAX_FUNCTION_LINES) -> dict[str, int]:
    """``{"file:qualified.name": lines}`` for every function or method under ``root`` longer than ``limit`` lines
    (from its ``def``, decorators excluded, to its last line; a nested function counts inside its parent and on its
    own)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))

        def walk(node, prefix: str) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    name = f"{prefix}{child.name}"
                    if not isinstance(child, ast.ClassDef) and (n := child.end_lineno - child.lineno + 1) > limit:
                        out[f"{path.relative_to(root).as_posix()}:{name}"] = n
                    walk(child, name + ".")
                else:
                    walk(child, prefix)

        walk(tree, "")
    return out


def test_no_function_over_max_lines():
    """Issue 43: no function or method under src/lenscope is longer than MAX_FUNCTION_LINES lines (split it into
    well-named pieces)."""
    found = long_functions(SRC)
    assert not found, f"functions over {MAX_FUNCTION_LINES} lines: {found}"


def test_long_function_checker(tmp_path):
    six = [f"x{i} = {i}" for i in range(6)]
    src = ["def short():", "    pass", "", "", "class C:", "    def long(self):", *("        " + x for x in six), "",
           "        def inner():", *("            " + x for x in six)]
    (tmp_path / "m.py").write_text("\n".join(src) + "\n")
    assert long_functions(tmp_path, limit=5) == {"m.py:C.long": 15, "m.py:C.long.inner": 7}
    assert long_functions(tmp_path, limit=15) == {}
