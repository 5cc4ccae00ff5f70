"""The one-way arrow: ``passes`` never imports ``fxpipe`` (see DESIGN.md).

Checked two ways: statically (no import statement names fxpipe) and
dynamically (importing every passes module in a fresh interpreter loads no
fxpipe module), so a lazy import inside a function is caught too when it runs
at import time.
"""
import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _passes_modules():
    for path in sorted((ROOT / "passes").rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        yield path, ".".join(parts)


def test_no_import_statement_names_fxpipe():
    offenders = []
    for path, _ in _passes_modules():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            offenders += [f"{path.name}:{node.lineno} {n}" for n in names if n.split(".")[0] == "fxpipe"]
    assert offenders == []


def test_importing_passes_loads_no_fxpipe_module():
    mods = [m for _, m in _passes_modules()]
    code = (
        "import importlib, sys\n"
        f"for m in {mods!r}: importlib.import_module(m)\n"
        "print(sorted(k for k in sys.modules if k.split('.')[0] == 'fxpipe'))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_every_public_name_resolves_with_a_description():
    import passes

    for name, (module, doc) in passes.PUBLIC.items():
        obj = getattr(passes, name)
        assert obj is not None and doc.strip(), name
        assert module.startswith("passes."), name
