"""`fxpipe profile`: the table on the bundled example, the JSON it writes, and user errors."""
from pathlib import Path

import pytest
import torch

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


def test_threads_zero_keeps_torchs_threads_and_times_wall_clock(capsys):
    """``--threads 0`` (as its help says): torch's own thread count, timed in wall time."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # torch's count here, whatever this machine's default
    try:
        code = main(["profile", str(EXAMPLES / "cnn.py"), "--threads", "0", "--repeats", "1", "--warmup", "0",
                     "--top", "1"])
        assert code == 0, capsys.readouterr().err
        assert "wall time" in capsys.readouterr().out and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


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


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_device_auto_and_cuda_without_a_gpu(capsys):
    """``--device auto`` profiles on the CPU of a machine without CUDA; ``--device cuda`` there is one line."""
    args = [str(EXAMPLES / "cnn.py"), "--repeats", "1", "--warmup", "0", "--top", "1"]
    assert main(["profile", *args, "--device", "auto"]) == 0
    assert "device cpu" in capsys.readouterr().out
    assert main(["profile", *args, "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert "sees no CUDA device; use --device cpu" in err and "Traceback" not in err
    assert main(["split", str(EXAMPLES / "cnn.py"), "--devices", "2", "--device", "cuda"]) == 2
    assert "sees no CUDA device" in capsys.readouterr().err


def test_profile_and_plan_under_a_precision(tmp_path, capsys):
    """`--precision bf16` profiles under bf16 autocast (values crossing a cut are bf16, half the bytes) and
    the profile says so; `fxpipe plan` refuses to plan that profile for another precision."""
    fp32, bf16 = tmp_path / "fp32.json", tmp_path / "bf16.json"
    for precision, out in (("fp32", fp32), ("bf16", bf16)):
        assert main(["profile", str(EXAMPLES / "gpt.py"), "--repeats", "1", "--warmup", "0",
                     "--precision", precision, "-o", str(out)]) == 0
    a, b = CostGraph.load(fp32), CostGraph.load(bf16)
    assert a.info["precision"] == "fp32" and b.info["precision"] == "bf16"
    assert b.nodes["blocks_0_attn_qkv"].out_bytes * 2 == a.nodes["blocks_0_attn_qkv"].out_bytes
    capsys.readouterr()
    assert main(["plan", str(bf16), "--devices", "2", "--precision", "bf16", "--time-limit", "2"]) == 0
    assert main(["plan", str(bf16), "--devices", "2", "--time-limit", "2"]) == 0
    assert main(["plan", str(bf16), "--devices", "2", "--precision", "fp32"]) == 2
    err = capsys.readouterr().err
    assert "profiled in bf16, not fp32" in err and "--precision fp32" in err


def test_train_names_a_split_planned_in_another_precision(tmp_path, capsys):
    from fxpipe.runtime.launch import _say_precision

    (tmp_path / "profile.json").write_text('{"info": {"precision": "bf16"}}')
    _say_precision(str(tmp_path), "bf16")
    assert capsys.readouterr().err == ""
    _say_precision(str(tmp_path), "fp32")
    assert "planned on bf16 times; training runs in fp32" in capsys.readouterr().err
    (tmp_path / "profile.json").write_text('{"info": {}}')  # profiles before precisions were recorded: fp32
    _say_precision(str(tmp_path), "fp32")
    assert capsys.readouterr().err == ""
