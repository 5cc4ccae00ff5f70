"""Graphviz output (``--format dot|svg|png``): optional, the HTML never needs it.

The DOT text is written by us; ``svg``/``png`` go through the ``dot`` program
when it is installed. Large graphs are collapsed to the same groups as the
HTML view, since Graphviz takes minutes on a thousand nodes with clusters.
"""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Mapping

from passes.costgraph import CostGraph
from passes.errors import FxpipeError
from fxpipe.show.graph import graph_payload
from fxpipe.show.html import PALETTE, fmt_s


def to_dot(graph: CostGraph, stage_of: Mapping[str, int]) -> str:
    g = graph_payload(graph, stage_of)
    collapsed = g["collapsed"]
    box = [f"g{n['group']}" if collapsed else f"n{i}" for i, n in enumerate(g["nodes"])]
    lines = ["digraph fxpipe {", "  rankdir=LR; node [shape=box, style=filled, fontsize=10];"]
    if collapsed:
        for k, grp in enumerate(g["groups"]):
            f = sum(g["nodes"][i]["fwd"] + g["nodes"][i]["bwd"] for i in grp["members"])
            lines.append(f'  g{k} [label="{_q(grp["label"])}\\n{fmt_s(f)}", fillcolor="{_colour(grp["stage"])}"];')
    else:
        for i, n in enumerate(g["nodes"]):
            cost = fmt_s(n["fwd"] + n["bwd"])
            lines.append(f'  n{i} [label="{_q(n["name"])}\\n{cost}", fillcolor="{_colour(n["stage"])}", '
                         f'tooltip="{_q(n["target"])}"];')
    seen = set()
    for u, v in g["edges"]:
        a, b = box[u], box[v]
        if a == b or (a, b) in seen:
            continue
        seen.add((a, b))
        nu, nv = g["nodes"][u], g["nodes"][v]
        cross = nu["stage"] != nv["stage"] and not nu["input"]
        lines.append(f"  {a} -> {b}" + (' [color="#d62728", penwidth=2, style=dashed];' if cross else ";"))
    lines.append("}")
    return "\n".join(lines) + "\n"


def write(graph: CostGraph, stage_of: Mapping[str, int], out: Path, fmt: str) -> Path:
    dot_text = to_dot(graph, stage_of)
    if fmt == "dot":
        out.write_text(dot_text)
        return out
    exe = shutil.which("dot")
    if exe is None:
        raise FxpipeError(f"--format {fmt} needs Graphviz's `dot` program (apt-get install graphviz); "
                          "use --format dot to write the DOT text, or the HTML view")
    proc = subprocess.run([exe, f"-T{fmt}", "-o", str(out)], input=dot_text, text=True, capture_output=True)
    if proc.returncode != 0:
        raise FxpipeError(f"dot failed: {proc.stderr.strip()[:300]}")
    return out


def _colour(stage: int) -> str:
    return "#dddddd" if stage < 0 else PALETTE[stage % len(PALETTE)] + "99"


def _q(text: str) -> str:
    return str(text).replace("\\", "\\\\").replace('"', '\\"')
