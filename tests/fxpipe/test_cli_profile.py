"""`fxpipe profile`: the table on the bundled example, the JSON it writes, and user errors."""
import json
from pathlib import Path

import pytest

from fxpipe.cli import main
from passes.costgraph import CostGraph

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_profile_prints_table_and_writes_json(tmp_path, capsys):
    out = tmp_path / "profile.json"
    code = main(["profile", str(EXAMPLES / "gpt.py"), "--repeats", "2", "--warmup", "1", "-o", str(out)])
    captured = capsys.readouterr()
    assert code == 0
    text = captured.out
    for header in ("node", "op", "target", "forward ms", "backward ms", "output bytes", "param bytes"):
        assert header in text
    assert "total (" in text and "whole model: forward" in text and "sum of nodes / whole" in text
    assert "blocks_0_attn_qkv" in text  # readable, module-derived node names
    assert "profile [" in captured.err  # progress bar on stderr
    graph = CostGraph.load(out)
    assert graph.info["capture_method"] == "fx" and graph.info["batch_size"] == 8
    names = [n for n in graph.nodes if n in text]
    assert len(names) >= len(graph.nodes) - 2  # every node but input/output is a row
    # the totals row carries every parameter byte exactly once
    total = next(line for line in text.splitlines() if line.startswith("total ("))
    assert f"{sum(graph.param_sizes.values()):,}" in total
    # the saved profile (what plans read) is calibrated: its node times sum to the whole model's
    cal = graph.info["calibration"]
    assert f"plans scale node times by {cal['fwd']:.2f}x forward" in text
    assert sum(n.fwd_s for n in graph.nodes.values()) == pytest.approx(graph.info["whole_fwd_s"], rel=1e-9)
    assert sum(n.bwd_s for n in graph.nodes.values()) == pytest.approx(graph.info["whole_bwd_s"], rel=1e-9)


def test_profile_export_method_and_top(capsys):
    code = main(["profile", str(EXAMPLES / "cnn.py"), "--method", "export", "--repeats", "1", "--warmup", "0", "--top", "5"])
    text = capsys.readouterr().out
    assert code == 0 and "capture: export" in text
    rows = [line for line in text.splitlines() if "call_function" in line]
    assert len(rows) == 5


def test_missing_file_exit_code_2_no_traceback(tmp_path, capsys):
    code = main(["profile", str(tmp_path / "missing.py")])
    err = capsys.readouterr().err
    assert code == 2
    assert "model file not found" in err and "Traceback" not in err


def test_untraceable_model_error_names_module(tmp_path, capsys):
    path = tmp_path / "flow.py"
    path.write_text(
        "import torch\nfrom tests.models import ControlFlow\n"
        "model = ControlFlow()\nexample_inputs = (torch.randn(5, 12),)\n"
    )
    code = main(["profile", str(path), "--repeats", "1"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert "'gate'" in err and "leaf_modules" in err
