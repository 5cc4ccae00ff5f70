"""`fxpipe split` on the bundled example writes every file, and the stages run like the model."""
import json
from pathlib import Path

import torch

from fxpipe.cli import main
from fxpipe.cli.split_cmd import default_outdir
from fxpipe.loader import load_model
from fxpipe.local import run_local
from fxpipe.plan import Plan
from fxpipe.split_model import SplitModel
from passes.costgraph import CostGraph

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "gpt.py"


def test_split_writes_stage_files_plan_profile_report(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["split", str(EXAMPLE), "--devices", "3", "--replication", "none", "--time-limit", "5"]) == 0
    out = tmp_path / "fxpipe-out" / "gpt"
    names = {p.name for p in out.iterdir()}
    assert names == {"split.json", "plan.json", "profile.json", "report.md"} | {
        f"stage_{j}.{ext}" for j in range(3) for ext in ("py", "pt")}
    printed = capsys.readouterr()
    assert "stage_2.py" in printed.out and str(Path("fxpipe-out") / "gpt") in printed.err
    assert Plan.load(out / "plan.json").num_stages == 3
    assert CostGraph.load(out / "profile.json").nodes
    report = (out / "report.md").read_text()
    assert "## Stages" in report and "`tok.weight`: stages [0, 2]" in report
    assert json.loads((out / "split.json").read_text())["num_stages"] == 3

    split = SplitModel.load(out)
    assert split.plan is not None and split.plan.num_stages == 3
    spec = load_model(str(EXAMPLE))
    spec.model.load_state_dict(split.original_state_dict([s.state_dict() for s in split.stages]))
    (idx,) = spec.example_inputs
    with torch.no_grad():
        assert torch.allclose(run_local(split, idx), spec.model(idx), rtol=1e-5, atol=1e-6)


def test_default_outdir_names():
    assert default_outdir("examples/gpt.py") == Path("fxpipe-out/gpt")
    assert default_outdir("pkg.models:tiny") == Path("fxpipe-out/pkg.models-tiny")
