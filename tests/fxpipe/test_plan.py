"""Plan: built from a partition, JSON round trip, and the ``fxpipe plan`` command."""
import json
from pathlib import Path

import pytest

from passes.costgraph import CostGraph
from passes.partition import partition
from fxpipe.cli import main
from fxpipe.plan import Plan, plan_from_result

from tests.profiles import PROFILES

VGG = PROFILES / "vgg16.txt"


@pytest.fixture(scope="module")
def vgg_plan():
    g = CostGraph.load(VGG)
    return g, plan_from_result(partition(g, 8, cost_model="pipedream", time_limit=20), g, batch_size=128)


def test_plan_numbers(vgg_plan):
    g, plan = vgg_plan
    assert [s.ranks for s in plan.stages] == [list(range(7)), [7]]
    assert plan.bottleneck_s == pytest.approx(max(s.time_s for s in plan.stages))
    assert plan.samples_per_s == pytest.approx(128 / plan.bottleneck_s)
    assert plan.speedup_vs_one == pytest.approx(g.total_compute_s() / plan.bottleneck_s)
    assert plan.speedup_vs_dp > 1.0  # vgg16's 550 MB of weights make pure data parallelism slow
    assert sorted(n for s in plan.stages for n in s.nodes) == sorted(g.nodes)
    for s in plan.stages:
        assert s.compute_s == pytest.approx((s.fwd_s + s.bwd_s) / s.replicas)
    assert "bottleneck" in plan.table()


def test_json_round_trip(vgg_plan, tmp_path):
    _, plan = vgg_plan
    plan.save(tmp_path / "plan.json")
    again = Plan.load(tmp_path / "plan.json")
    assert again == plan
    assert again.layout.world_size == 8


def test_cli_json(tmp_path, capsys):
    out = tmp_path / "p.json"
    code = main(["plan", str(VGG), "--devices", "4", "--cost-model", "pipedream", "--bandwidth", "10Gbit/s",
                 "--json", "-o", str(out)])
    assert code == 0
    data = json.loads(capsys.readouterr().out)
    assert data["bottleneck_s"] == pytest.approx(0.1763, rel=1e-3)
    assert [s["replicas"] for s in data["stages"]] == [3, 1]
    assert all({"nodes", "replicas", "time_s"} <= set(s) for s in data["stages"])
    assert {"status", "bound_s", "gap", "wall_s"} <= set(data["solver"])
    assert Plan.load(out).bottleneck_s == data["bottleneck_s"]


def test_cli_memory_error(capsys):
    code = main(["plan", str(VGG), "--devices", "4", "--memory", "1GiB"])
    assert code == 2
    assert "a plan fits in" in capsys.readouterr().err


def test_plan_of_a_model_times_nodes_as_split_does(monkeypatch):
    """``fxpipe plan model.py`` and ``fxpipe split`` profile through one entry point, with one clock."""
    import runpy

    import torch

    import fxpipe.profiling as profiling
    from fxpipe.api import split
    from fxpipe.cli.plan_cmd import load_source

    seen, real = [], profiling.profile

    def spy(gm, inputs, **kw):
        seen.append(dict(kw, threads=torch.get_num_threads(), progress=None))
        return real(gm, inputs, **kw)

    monkeypatch.setattr(profiling, "profile", spy)
    model = Path(__file__).resolve().parents[2] / "examples" / "gpt.py"
    load_source(str(model))
    ns = runpy.run_path(str(model))
    split(ns["model"], ns["example_inputs"], 2, time_limit=2, progress=False)
    assert len(seen) == 2 and seen[0] == seen[1] and seen[0]["threads"] == 1


@pytest.mark.parametrize("option,value,says", [("--devices", "0", "--devices/-k: must be at least 1"),
                                               ("--microbatches", "0", "--microbatches: must be at least 1"),
                                               ("--time-limit", "0", "--time-limit: must be positive"),
                                               ("--workers", "-1", "--workers: must be at least 1")])
def test_cli_refuses_a_zero_before_loading_anything(option, value, says, capsys):
    args = ["plan", str(VGG), "--devices", "4", option, value]
    with pytest.raises(SystemExit) as exc:
        main(args)
    assert exc.value.code == 2
    assert says in capsys.readouterr().err


def test_cli_plan_keeps_freed_memory_before_planning(monkeypatch, capsys):
    """`fxpipe plan` raises glibc's malloc thresholds before the partitioner runs (its DP passes allocate
    and free the same large arrays: a charged pass 1.45 -> 0.82-1.14 s), as training does."""
    from fxpipe.runtime import heap
    import passes.partition as partition_pkg

    order = []
    monkeypatch.setattr(heap, "keep_freed_memory", lambda *a, **k: order.append("heap") or True)
    real = partition_pkg.partition
    monkeypatch.setattr(partition_pkg, "partition", lambda *a, **k: order.append("partition") or real(*a, **k))
    assert main(["plan", str(VGG), "--devices", "4"]) == 0
    assert order == ["heap", "partition"]


def test_cli_memory_names_a_faster_plan_on_fewer_devices(capsys):
    """gnmt_large on 256 devices under 4 GB: every device must take a replica, and the one stage that can
    take them all-reduces its embedding for 211 ms; the walk's plan on fewer devices within the same memory
    runs 76.8 ms, and the plan says so (the user decides to leave devices idle)."""
    gnmt = PROFILES / "gnmt_large.txt"
    assert main(["plan", str(gnmt), "--devices", "256", "--memory", "4e9", "--time-limit", "5", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    fewer = data["solver"]["fewer_devices"]
    assert fewer["devices"] < 256 and fewer["bottleneck_s"] < 0.5 * data["bottleneck_s"]
    assert main(["plan", str(gnmt), "--devices", "256", "--memory", "4e9", "--time-limit", "5"]) == 0
    assert f"a plan on {fewer['devices']} of the 256 devices runs" in capsys.readouterr().out
    assert main(["plan", str(gnmt), "--devices", "256", "--memory", "4e9", "--time-limit", "5", "--fewer-devices",
                 "--json"]) == 0
    idle = json.loads(capsys.readouterr().out)
    assert idle["bottleneck_s"] <= fewer["bottleneck_s"] * (1 + 1e-9)
    assert max(s["memory_bytes"] for s in idle["stages"]) <= 4e9 and "fewer_devices" not in idle["solver"]
