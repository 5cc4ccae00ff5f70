"""Fast start: the CLI's parser and `fxpipe plan PROFILE` never import torch.

Importing torch costs about 1.5 s of a 2 s start; `fxpipe --help` and planning
from a saved profile (JSON or PipeDream graph.txt) need none of it. Checked by
the modules loaded in a fresh interpreter, not by a clock.
"""
import json
import subprocess
import sys

from tests.profiles import PROFILES


def _loaded_after(code: str) -> dict:
    probe = code + "\nimport json, sys\nprint(json.dumps({m: m in sys.modules for m in ('torch', 'ortools')}))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_help_imports_no_torch():
    loaded = _loaded_after("from fxpipe.cli import build_parser\nbuild_parser().format_help()")
    assert not loaded["torch"]


def test_plan_from_a_profile_imports_no_torch():
    vgg = PROFILES / "vgg16.txt"
    loaded = _loaded_after(
        "from fxpipe.cli import main\n"
        f"assert main(['plan', {str(vgg)!r}, '--devices', '8', '--cost-model', 'pipedream', '--json']) == 0")
    assert not loaded["torch"]
    # the segment DP proves this plan, so CP-SAT (OR-Tools loads pandas: most of a second) is never loaded
    assert not loaded["ortools"]
