"""``fxpipe profile MODEL``: capture a model, time every node, print the table, save the profile.

MODEL is a model file (``examples/gpt.py``) or ``package.module:factory``.
Every node is run in isolation on the inputs it sees in a real forward pass:
forward time, measured backward time (gradient of its outputs with respect to
its inputs and parameters), bytes of its outputs and of the parameters it
owns. The whole model's forward and backward, timed the same way, are printed
below the totals so you can see how close the sum of the parts is to the
whole. ``-o profile.json`` saves the profile for ``fxpipe plan``.
"""
from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, List, Optional

from fxpipe.cli.plan_cmd import add_precision_option
from fxpipe.runtime.devices import DEVICES
from fxpipe.units import at_least

if TYPE_CHECKING:
    from passes.costgraph import CostGraph


def register(subparsers) -> None:
    p = subparsers.add_parser("profile", help="measure every node of a model (forward, backward, bytes)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", metavar="MODEL", help="model .py file or package.module:factory")
    p.add_argument("--device", choices=DEVICES, default="cpu",
                   help="device to time on: cpu (default), cuda, or auto (cuda where this machine has a GPU)")
    p.add_argument("--repeats", type=at_least(1), default=5, help="timed repetitions per node; the median is kept (default 5)")
    p.add_argument("--warmup", type=at_least(0), default=2, help="untimed repetitions first (default 2)")
    p.add_argument("--method", choices=("auto", "fx", "export"), default="auto",
                   help="capture: symbolic tracing, torch.export, or fx then export (default auto)")
    p.add_argument("--threads", type=at_least(0), default=1,
                   help="torch intra-op threads while timing on CPU (default 1: then each node is timed in "
                        "CPU time of its thread, which other jobs on the machine do not inflate; 0 = torch's default, "
                        "timed in wall time)")
    add_precision_option(p)
    p.add_argument("--top", type=at_least(1), default=None, help="show only the N nodes with the largest forward+backward")
    p.add_argument("-o", "--output", help="write the profile JSON here (input of `fxpipe plan`); a name ending in .gz compresses it")
    p.set_defaults(func=run)


def run(args) -> int:
    from fxpipe.loader import load_model
    from fxpipe.profiling import profile_model
    from fxpipe.runtime.devices import resolve_device
    from passes.profile import to_cost_graph

    spec = load_model(args.model)
    gm = profile_model(spec, device=resolve_device(args.device, None), repeats=args.repeats, warmup=args.warmup,
                       method=args.method, threads=args.threads or None, precision=args.precision)
    graph = to_cost_graph(gm)  # what plans read: node times calibrated to the whole model's
    print(render_table(to_cost_graph(gm, calibrate=False), args.top))  # the node timings as measured
    cal = graph.info.get("calibration")
    if cal:
        print(f"plans scale node times by {cal['fwd']:.2f}x forward, {cal['bwd']:.2f}x backward "
              f"so that they sum to the whole model" + (" (as saved)" if args.output else ""))
    if args.output:
        graph.save(args.output)
        print(f"wrote {args.output}", file=sys.stderr)
    return 0


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}"


def render_table(graph: "CostGraph", top: Optional[int] = None) -> str:
    """The per-node table, a totals row, and the whole-model comparison."""
    from tabulate import tabulate

    nodes = [n for n in graph.nodes.values() if not n.is_input and n.op != "output"]
    shown = sorted(nodes, key=lambda n: -n.compute_s)[:top] if top else nodes
    rows: List[list] = [
        [n.name, n.op, _short(n.target), _ms(n.fwd_s), _ms(n.bwd_s), f"{n.out_bytes:,}", f"{n.param_bytes:,}"]
        for n in shown
    ]
    fwd = sum(n.fwd_s for n in nodes)
    bwd = sum(n.bwd_s for n in nodes)
    rows.append([f"total ({len(nodes)} nodes)", "", "", _ms(fwd), _ms(bwd),
                 f"{sum(n.out_bytes for n in nodes):,}", f"{graph.total_param_bytes():,}"])
    headers = ["node", "op", "target", "forward ms", "backward ms", "output bytes", "param bytes"]
    text = tabulate(rows, headers=headers, disable_numparse=True, colalign=("left", "left", "left", "right", "right", "right", "right"))
    info = graph.info
    whole_f, whole_b = float(info.get("whole_fwd_s", 0.0)), float(info.get("whole_bwd_s", 0.0))
    lines = [text, ""]
    if whole_f > 0:
        lines.append(
            f"whole model: forward {_ms(whole_f)} ms, backward {_ms(whole_b)} ms; "
            f"sum of nodes / whole: forward {fwd / whole_f:.2f}x, backward {bwd / whole_b if whole_b else float('nan'):.2f}x"
        )
    lines.append(
        f"capture: {info.get('capture_method', '?')}; device {info.get('device', '?')}, "
        f"batch {info.get('batch_size', '?')}, median of {info.get('repeats', '?')} runs"
        + (f" ({info['clock']})" if info.get("clock") else "") + f", torch {info.get('torch_version', '?')}"
    )
    return "\n".join(lines)


def _short(text: str, width: int = 40) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"
