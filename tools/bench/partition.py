"""Benchmark: fxpipe's partitioner against PipeDream's optimizer, on PipeDream's own profiles.

Every row of examples/pipedream/README.md's table (PipeDream's published runs) is
re-solved with ``--cost-model pipedream`` at the same K and 1.25e9 bytes/s;
the table prints fxpipe's bottleneck ÷ PipeDream's (≤ 1.000 means fxpipe's
plan is at least as good under PipeDream's own model) and both wall times
(PipeDream's measured on the same kind of 2-core box). Then the branchy graphs
PipeDream does not finish on, at K = 8 and 16, with the proven gap.

    python -m tools.bench.partition [--time-limit 10] [--branchy-time-limit 60] [--only vgg16,resnet50]
        [--branchy-only] [--branchy-devices 8,16] [--branchy-cost-models pipedream]

The branchy rows at 10 s on 8-32 devices under both cost models (the inception_v3 table in docs/results.md):
``--branchy-only --only inception_v3 --branchy-time-limit 10 --branchy-devices 8,16,32
--branchy-cost-models fxpipe,pipedream``.

Wall times are CPU-bound: other processes on the machine inflate them.
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import List, Tuple

from tabulate import tabulate

from passes.costgraph import CostGraph
from passes.partition import partition

PROFILES = Path(__file__).resolve().parents[2] / "examples" / "pipedream"
BRANCHY = ("inception_v3", "densenet121", "nasnetamobile", "resnext101")


def pipedream_rows(path: Path) -> List[Tuple[str, int, str, float, float]]:
    """(profile, K, PipeDream's GPUs per stage, its bottleneck s, its wall s) for rows with a result."""
    rows = []
    for line in path.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 6 and re.fullmatch(r"\d+", cells[1]) and re.fullmatch(r"[\d.]+", cells[3]):
            rows.append((cells[0], int(cells[1]), cells[2], float(cells[3]), float(cells[5])))
    return rows


def solve(name: str, k: int, time_limit: float, cost_model: str = "pipedream"):
    graph = CostGraph.load(PROFILES / f"{name}.txt")
    return partition(graph, k, bandwidth=1.25e9, cost_model=cost_model, time_limit=time_limit)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--time-limit", type=float, default=10.0, help="per PipeDream row (target: 10 s)")
    ap.add_argument("--branchy-time-limit", type=float, default=60.0, help="per branchy graph (target: 60 s)")
    ap.add_argument("--only", default="", help="comma-separated profile names")
    ap.add_argument("--branchy-only", action="store_true", help="skip PipeDream's published rows")
    ap.add_argument("--branchy-devices", default="8,16", help="comma-separated K for the branchy graphs")
    ap.add_argument("--branchy-cost-models", default="pipedream", help="comma-separated: fxpipe, pipedream")
    args = ap.parse_args(argv)
    only = set(filter(None, args.only.split(",")))
    table = []
    for name, k, pd_split, pd_s, pd_wall in pipedream_rows(PROFILES / "README.md"):
        if args.branchy_only or (only and name not in only):
            continue
        r = solve(name, k, args.time_limit)
        table.append([name, k, pd_split, "-".join(map(str, r.replicas)), f"{pd_s:.4f}", f"{r.bottleneck_s:.5f}",
                      f"{r.bottleneck_s / pd_s:.4f}", f"{r.wall_s:.2f}", f"{pd_wall:.2f}", r.status, r.method, f"{100 * r.gap:.2f}%"])
        print(" | ".join(map(str, table[-1])), file=sys.stderr, flush=True)
    if table:
        print(tabulate(table, ["profile", "K", "PipeDream r", "fxpipe r", "PipeDream s", "fxpipe s", "ratio",
                               "fxpipe wall s", "PipeDream wall s", "status", "method", "gap"], tablefmt="github"))
        print()
    rows = []
    for name in BRANCHY:
        if only and name not in only:
            continue
        for model in args.branchy_cost_models.split(","):
            for k in (int(x) for x in args.branchy_devices.split(",")):
                r = solve(name, k, args.branchy_time_limit, model)
                rows.append([name, model, k, len(CostGraph.load(PROFILES / f"{name}.txt").nodes), r.units,
                             "-".join(map(str, r.replicas)), f"{r.bottleneck_s:.4f}", f"{r.bound_s:.4f}",
                             f"{100 * r.gap:.2f}%", f"{r.wall_s:.2f}", r.status, r.method])
                print(" | ".join(map(str, rows[-1])), file=sys.stderr, flush=True)
    print(tabulate(rows, ["profile", "charges", "K", "nodes", "units", "fxpipe r", "bottleneck s", "bound s", "gap",
                          "wall s", "status", "method"], tablefmt="github"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
