"""A clone is self-contained: no file points at a path outside the repository.

The PipeDream profiles the tests, the benchmark and the README use are vendored
in examples/pipedream; a path to the build machine's folders would work there
and fail in every user's clone.
"""
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Spelled in pieces so this file does not match itself.
FORBIDDEN = ("/" + "work/", "../" + "shared", "shared/" + "anchors", "/" + "root/", "/" + "home/", "/" + "tmp/fxpipe")
TEXT = (".py", ".md", ".toml", ".txt", ".cfg", ".sh", ".json", ".yaml", ".yml", "run")


def tracked_files():
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:  # not a git checkout (an sdist): walk the tree instead
        return [p for p in ROOT.rglob("*") if p.is_file() and ".venv" not in p.parts and ".git" not in p.parts]
    return [ROOT / line for line in out.stdout.splitlines()]


def test_no_file_points_outside_the_repository():
    hits = []
    for path in tracked_files():
        if not path.name.endswith(TEXT) or not path.exists():
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            hits += [f"{path.relative_to(ROOT)}:{number}: {bad!r}" for bad in FORBIDDEN if bad in line]
    assert not hits, "paths outside the repository:\n" + "\n".join(hits)


def test_vendored_profiles_carry_their_license():
    folder = ROOT / "examples" / "pipedream"
    assert "MIT License" in (folder / "LICENSE").read_text()
    assert len(list(folder.glob("*.txt"))) >= 14
    assert "msr-fiddle/pipedream" in (folder / "README.md").read_text()
