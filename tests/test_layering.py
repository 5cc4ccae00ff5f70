"""The arrows between fxpipe's layers run one way, and no module imports itself back.

Layers, lowest first: ``passes`` (the pass library) → ``fxpipe`` (its core:
plan, schedules, simulator, runtime, API) → ``fxpipe.show`` (the plan viewer)
and ``fxpipe.cli`` (the command, with ``fxpipe/__main__.py``). A layer imports
only itself and the layers below it; the benchmarks in ``tools`` may import
any of them but nothing from ``tests``.

Imports are read from the source, at any depth (a lazy import inside a
function counts: it runs the same code, only later), except those under
``if TYPE_CHECKING:``, which never run. ``importlib`` calls on computed names
(the lazy public names of ``fxpipe`` and ``passes``, the CLI's subcommands)
are not seen; ``passes`` is therefore also checked by importing every module in
a fresh interpreter and looking at what got loaded.
"""
import ast
import pathlib
import subprocess
import sys
from typing import Dict, List, Set, Tuple

import networkx as nx

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("passes", "fxpipe", "tools")

# layer -> the layers it may import
ALLOWED = {
    "passes": {"passes"},
    "fxpipe": {"passes", "fxpipe"},
    "show": {"passes", "fxpipe", "show"},
    "cli": {"passes", "fxpipe", "show", "cli"},
    "tools": {"passes", "fxpipe", "show", "cli", "tools"},
}


def _modules(package: str) -> Dict[str, Tuple[pathlib.Path, bool]]:
    """Dotted module name -> (file, is a package's ``__init__``), for every module of ``package``."""
    out = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        is_init = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_init else parts)] = (path, is_init)
    return out


MODULES = {name: where for package in PACKAGES for name, where in _modules(package).items()}


def layer(module: str) -> str:
    if module == "fxpipe.__main__" or module.startswith("fxpipe.cli"):
        return "cli"
    if module.startswith("fxpipe.show"):
        return "show"
    return module.split(".")[0]


def _is_type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def _import_statements(tree: ast.AST):
    """Every import statement in ``tree``, at any depth, except under ``if TYPE_CHECKING:``."""
    for child in ast.iter_child_nodes(tree):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child
        elif not _is_type_checking(child):
            yield from _import_statements(child)


def imported_names(module: str) -> List[Tuple[str, int]]:
    """(absolute dotted name, line) for each name ``module`` imports; ``from a import b`` gives ``a.b``."""
    path, is_init = MODULES[module]
    package = module if is_init else module.rpartition(".")[0]
    out = []
    for node in _import_statements(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out += [(alias.name, node.lineno) for alias in node.names]
            continue
        base = node.module or ""
        if node.level:
            parent = package.split(".")[: len(package.split(".")) - node.level + 1]
            base = ".".join(parent + ([base] if base else []))
        out += [(f"{base}.{alias.name}", node.lineno) for alias in node.names]
    return out


def _resolve(name: str) -> str:
    """The project module that ``name`` (a module, or a name inside one) lives in; '' if not ours."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def import_graph() -> nx.DiGraph:
    graph = nx.DiGraph()
    graph.add_nodes_from(MODULES)
    for module in MODULES:
        for name, line in imported_names(module):
            target = _resolve(name)
            if target and target != module:
                graph.add_edge(module, target, line=line)
    return graph


def against_layering(module: str, imports: List[Tuple[str, int]]) -> List[str]:
    """``module``'s imports that reach a layer it may not import (or ``tests``)."""
    bad = []
    for name, line in imports:
        target = _resolve(name)
        reached = layer(target) if target else ("tests" if name.split(".")[0] == "tests" else None)
        if reached is not None and reached not in ALLOWED[layer(module)]:
            bad.append(f"{module}:{line} imports {name}")
    return bad


def test_layers_import_only_downwards():
    offenders = [bad for module in MODULES for bad in against_layering(module, imported_names(module))]
    assert offenders == [], "imports against the layering:\n" + "\n".join(offenders)


def test_no_import_cycles():
    graph = import_graph()
    cycles = []
    for component in nx.strongly_connected_components(graph):
        if len(component) > 1:
            cycle = nx.find_cycle(graph.subgraph(component))
            cycles.append(" -> ".join(f"{a} (line {graph.edges[a, b]['line']})" for a, b in cycle)
                          + f" -> {cycle[-1][1]}")
    assert cycles == [], "modules that import each other:\n" + "\n".join(cycles)


def test_the_checks_see_lazy_imports_and_wrong_arrows():
    tree = ast.parse("import a\nif TYPE_CHECKING:\n    import b\ndef f():\n    from c import d\n")
    assert [ast.unparse(n) for n in _import_statements(tree)] == ["import a", "from c import d"]
    assert any(n.startswith("fxpipe.show.") for n, _ in imported_names("fxpipe.cli.show_cmd"))  # in a function
    assert against_layering("passes.meta", [("fxpipe.plan.Plan", 1)]) == ["passes.meta:1 imports fxpipe.plan.Plan"]
    assert against_layering("fxpipe.plan", [("fxpipe.show.data", 2), ("fxpipe.cli", 3)]) == [
        "fxpipe.plan:2 imports fxpipe.show.data", "fxpipe.plan:3 imports fxpipe.cli"]
    assert against_layering("fxpipe.show.html", [("fxpipe.cli.show_cmd", 4)]) == [
        "fxpipe.show.html:4 imports fxpipe.cli.show_cmd"]
    assert against_layering("tools.bench.predict", [("tests.models", 5)]) == ["tools.bench.predict:5 imports tests.models"]
    assert against_layering("fxpipe.cli.show_cmd", [("fxpipe.show.data", 6), ("passes.meta", 7)]) == []


def _loaded_by_importing(modules: List[str], prefixes: Tuple[str, ...]) -> Set[str]:
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        f"print(sorted(k for k in sys.modules if k.startswith({prefixes!r})))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    return set(ast.literal_eval(out.stdout.strip()))


def test_importing_passes_loads_no_fxpipe_module():
    assert _loaded_by_importing([m for m in MODULES if layer(m) == "passes"], ("fxpipe",)) == set()


def test_every_public_name_resolves_with_a_description():
    import passes

    for name, (module, doc) in passes.PUBLIC.items():
        obj = getattr(passes, name)
        assert obj is not None and doc.strip(), name
        assert module.startswith("passes."), name
