"""Benchmark: fxpipe's partitioner against PipeDream's optimizer, on PipeDream's own profiles.

Every row of examples/pipedream/README.md's table (PipeDream's published runs) is
re-solved with ``--cost-model pipedream`` at the same K and 1.25e9 bytes/s;
the table prints fxpipe's bottleneck ÷ PipeDream's (≤ 1.000 means fxpipe's
plan is at least as good under PipeDream's own model) and both wall times
(PipeDream's measured on the same kind of 2-core box). Then the branchy graphs
PipeDream does not finish on, at K = 8 and 16, with the proven gap.

    python -m tools.bench.partition [--time-limit 10] [--branchy-time-limit 60] [--only vgg16,resnet50]
        [--branchy-only] [--branchy-devices 8,16] [--branchy-cost-models pipedream]
        [--scale [--scale-devices 64,256,1024]]

The branchy rows at 10 s on 8-32 devices under both cost models (the inception_v3 table in docs/results.md):
``--branchy-only --only inception_v3 --branchy-time-limit 10 --branchy-devices 8,16,32
--branchy-cost-models fxpipe,pipedream``.

``--scale``: instead, every profile on many devices (``--scale-devices``, default 64,256,1024) under
both cost models at 1.25e9 B/s, each row in its own process (its RSS is the plan's own): wall time,
RSS, status, proven gap, and the plan against the best uniform layout (``uniform.best_layout``:
equal-compute stages, equal replicas, the layout a person would pick by hand) under the same model.

Wall times are CPU-bound: other processes on the machine inflate them.
"""
from __future__ import annotations

import argparse
import json
import re
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import List, Tuple

from tabulate import tabulate

from passes.costgraph import CostGraph
from passes.partition import partition

ROOT = Path(__file__).resolve().parents[2]
PROFILES = ROOT / "examples" / "pipedream"
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


def scale_row(name: str, k: int, cost_model: str, time_limit: float) -> dict:
    """One ``--scale`` row, in this process (``scale`` runs it in a subprocess so RSS is the row's own)."""
    from passes.partition.uniform import best_layout

    graph = CostGraph.load(PROFILES / f"{name}.txt")
    start = time.monotonic()
    r = partition(graph, k, bandwidth=1.25e9, cost_model=cost_model, time_limit=time_limit)
    wall = time.monotonic() - start
    uniform = best_layout(graph, r.options)
    return {"wall_s": wall, "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "status": r.status, "gap": r.gap, "plan_s": r.bottleneck_s, "stages": len(r.replicas),
            "method": r.method, "uniform_s": uniform[0].bottleneck_s if uniform else None}


def scale(names: List[str], devices: List[int], cost_models: List[str], time_limit: float) -> None:
    """The ``--scale`` table (see the module's docstring)."""
    rows = []
    for name in names:
        for model in cost_models:
            for k in devices:
                out = subprocess.run([sys.executable, "-m", "tools.bench.partition", "--scale-row",
                                      f"{name},{k},{model}", "--time-limit", str(time_limit)],
                                     cwd=ROOT, capture_output=True, text=True)
                if out.returncode:
                    print(out.stderr, file=sys.stderr)
                    continue
                r = json.loads(out.stdout.strip().splitlines()[-1])
                versus = f"{r['uniform_s'] / r['plan_s']:.2f}" if r["uniform_s"] else "-"
                rows.append([name, model, k, f"{r['wall_s']:.2f}", f"{r['rss_mb']:.0f}", r["status"],
                             f"{100 * r['gap']:.2f}%", r["stages"], f"{r['plan_s'] * 1e3:.3f}", versus, r["method"]])
                print(" | ".join(map(str, rows[-1])), file=sys.stderr, flush=True)
    print(f"flat, 1.25e9 B/s; time limit {time_limit:g} s")
    print(tabulate(rows, ["profile", "charges", "K", "wall s", "RSS MB", "status", "gap", "stages", "plan ms",
                          "uniform ÷ plan", "method"], tablefmt="github"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--time-limit", type=float, default=10.0, help="per PipeDream row (target: 10 s)")
    ap.add_argument("--branchy-time-limit", type=float, default=60.0, help="per branchy graph (target: 60 s)")
    ap.add_argument("--only", default="", help="comma-separated profile names")
    ap.add_argument("--branchy-only", action="store_true", help="skip PipeDream's published rows")
    ap.add_argument("--branchy-devices", default="8,16", help="comma-separated K for the branchy graphs")
    ap.add_argument("--branchy-cost-models", default="pipedream", help="comma-separated: fxpipe, pipedream")
    ap.add_argument("--scale", action="store_true", help="every profile on many devices instead (see above)")
    ap.add_argument("--scale-devices", default="64,256,1024", help="comma-separated K for --scale")
    ap.add_argument("--scale-row", default=None, help=argparse.SUPPRESS)  # name,K,model: one row as JSON
    args = ap.parse_args(argv)
    only = set(filter(None, args.only.split(",")))
    if args.scale_row:
        from fxpipe.runtime.heap import keep_freed_memory

        keep_freed_memory()  # as `fxpipe plan` does before planning
        name, k, model = args.scale_row.split(",")
        print(json.dumps(scale_row(name, int(k), model, args.time_limit)))
        return 0
    if args.scale:
        names = sorted(p.stem for p in PROFILES.glob("*.txt") if not only or p.stem in only)
        scale(names, [int(x) for x in args.scale_devices.split(",")], ["fxpipe", "pipedream"], args.time_limit)
        return 0
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
