"""``tools.bench.partition --scale``: a row as the table reads it, and the table from its subprocesses."""
from __future__ import annotations

from tools.bench import partition as bench


def test_a_scale_row_compares_the_plan_with_the_uniform_layout():
    row = bench.scale_row("alexnet", 64, "fxpipe", 5.0)
    assert row["status"] == "OPTIMAL" and row["gap"] <= 1e-3
    assert row["uniform_s"] >= row["plan_s"] * (1 - 1e-9)  # the plan is never slower than the hand layout
    assert 0 < row["wall_s"] <= 6.0 and row["rss_mb"] > 0


def test_the_scale_table_runs_each_row_in_its_own_process(capsys):
    bench.main(["--scale", "--only", "gnmt", "--scale-devices", "16", "--time-limit", "5"])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| gnmt")]
    assert len(rows) == 2 and {"fxpipe", "pipedream"} == {r.split("|")[2].strip() for r in rows}
    assert all("OPTIMAL" in r for r in rows)
