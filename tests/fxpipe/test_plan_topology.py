"""`--gpus-per-node`: the one-line error, the node of every rank in the table, JSON and split report."""
import pytest
import json
from pathlib import Path

from fxpipe.cli import main
from fxpipe.plan import Plan
from tests.profiles import PROFILES

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "gpt.py"
VGG = ["plan", str(PROFILES / "vgg16.txt"), "--devices", "16", "--gpus-per-node", "4",
       "--intra-bandwidth", "10GB/s", "--bandwidth", "1.25e9", "--cost-model", "pipedream"]


def test_devices_not_a_multiple_is_one_line(capsys):
    code = main(["plan", str(PROFILES / "vgg16.txt"), "--devices", "18", "--gpus-per-node", "4"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert "--devices 18 is not a multiple of --gpus-per-node 4" in err and "use --devices 20 or 16" in err


def test_table_and_json_show_the_node_of_every_rank(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(VGG + ["-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "machine node: ranks" in text and "16 devices on 4 nodes of 4" in text
    assert "PipeDream's hierarchical optimizer (levels solved one after another): 0.0671 s, GPUs per stage 12-1-1-1-1" in text
    plan = Plan.load(out)
    for stage in plan.stages:
        assert stage.rank_nodes == [rank // 4 for rank in stage.ranks]
    first = plan.stages[0]
    assert "n0: 0-3, n1: 4-7" in text and len(first.ranks) > 8
    data = json.loads(out.read_text())
    assert data["options"]["gpus_per_node"] == 4 and data["options"]["intra_bandwidth"] == 1e10
    assert data["solver"]["pipedream_hierarchical"]["replicas"] == [12, 1, 1, 1, 1]


def test_flat_plan_has_no_node_column(capsys):
    assert main(["plan", str(PROFILES / "vgg16.txt"), "--devices", "4", "--cost-model", "pipedream"]) == 0
    text = capsys.readouterr().out
    assert "machine node" not in text and "hierarchical" not in text


def test_split_report_shows_nodes(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["split", str(EXAMPLE), "--devices", "4", "--gpus-per-node", "2", "--intra-bandwidth", "10GB/s",
                 "--time-limit", "5", "-o", "out"]) == 0
    report = (tmp_path / "out" / "report.md").read_text()
    assert "machine node: ranks" in report and "n1: " in report
    plan = Plan.load(tmp_path / "out" / "plan.json")
    assert [n for s in plan.stages for n in s.rank_nodes] == [0, 0, 1, 1]


def test_train_takes_the_two_level_options(capsys):
    """`fxpipe train` passes --gpus-per-node/--intra-bandwidth to the planner: K not a multiple of G
    is the planner's one-line error, before any worker starts."""
    gpt = Path(__file__).resolve().parents[2] / "examples" / "gpt.py"
    assert main(["train", str(gpt), "--devices", "3", "--gpus-per-node", "2", "--intra-bandwidth", "1e11"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--devices 3 is not a multiple of --gpus-per-node 2" in err and "Traceback" not in err


def test_cost_options_round_trip_keeps_the_machine():
    """A saved plan's options rebuild the machine it was planned for (two-level included), so what
    re-scores it (--recompute auto, the recompute bench) sees the same costs as the planner."""
    from passes.costgraph import CostGraph
    from passes.partition import evaluate, partition
    from fxpipe.plan import plan_from_result

    g = CostGraph.load(PROFILES / "vgg16.txt")
    for machine in ({}, {"gpus_per_node": 4, "intra_bandwidth": 1e10}):
        res = partition(g, 8, time_limit=10, **machine)
        plan = Plan.from_json(json.loads(json.dumps(plan_from_result(res, g).to_json())))
        opts = plan.cost_options()
        assert opts.gpus_per_node == machine.get("gpus_per_node")
        again = evaluate(g, plan.assignment(), [s.replicas for s in plan.stages], opts)
        assert again.bottleneck_s == pytest.approx(res.bottleneck_s, rel=1e-12)
