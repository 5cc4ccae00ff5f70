"""The profiled graph the partitioner reads: plain data, no torch modules.

A ``CostGraph`` is what survives of a model once it is profiled: nodes with
measured costs and the data edges between them. It is built from a profiled
``GraphModule``, saved to and loaded from JSON (so a plan can be redone
without the model), or loaded from PipeDream's ``graph.txt`` profiles, so the
same partitioner runs on PipeDream's published numbers.

Units: seconds, bytes.
"""
from __future__ import annotations

import gzip
import json
import re
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple, Union

import networkx as nx

from passes.errors import FxpipeError

SCHEMA = "fxpipe-profile/1"
GZIP_MAGIC = b"\x1f\x8b"  # a gzip file's first two bytes: ``load`` decompresses such a profile


class ProfileFormatError(FxpipeError):
    """A profile file that cannot be read; the message names file and line."""


@dataclass(frozen=True)
class CostNode:
    """One node's cost. ``is_input`` nodes (the data loader) cost nothing."""

    name: str
    op: str
    target: str
    fwd_s: float
    bwd_s: float
    out_bytes: int
    param_bytes: int
    module_path: str = ""
    is_input: bool = False
    params: Tuple[str, ...] = ()
    peak_mem_bytes: Optional[int] = None

    @property
    def compute_s(self) -> float:
        return self.fwd_s + self.bwd_s


@dataclass
class CostGraph:
    """Nodes in a topological order, plus edges ``(producer, consumer)``.

    ``param_sizes`` maps every parameter name to its bytes; a node's
    ``param_bytes`` counts the parameters it owns (first user), its ``params``
    lists every parameter it uses, so a parameter shared by several nodes
    (tied embeddings) is visible to the partitioner.
    """

    nodes: Dict[str, CostNode]
    edges: List[Tuple[str, str]]
    info: Dict[str, object] = field(default_factory=dict)
    param_sizes: Dict[str, int] = field(default_factory=dict)

    # ------------------------------------------------------------ queries
    def order(self) -> List[str]:
        return list(self.nodes)

    def total_compute_s(self) -> float:
        return sum(n.compute_s for n in self.nodes.values())

    def total_param_bytes(self) -> int:
        return sum(n.param_bytes for n in self.nodes.values())

    def to_networkx(self) -> nx.DiGraph:
        g = nx.DiGraph()
        for name, node in self.nodes.items():
            g.add_node(name, cost=node)
        g.add_edges_from(self.edges)
        return g

    def successors(self) -> Dict[str, List[str]]:
        out: Dict[str, List[str]] = {n: [] for n in self.nodes}
        for u, v in self.edges:
            out[u].append(v)
        return out

    def predecessors(self) -> Dict[str, List[str]]:
        out: Dict[str, List[str]] = {n: [] for n in self.nodes}
        for u, v in self.edges:
            out[v].append(u)
        return out

    def check(self) -> None:
        """Raise ``ProfileFormatError`` on unknown endpoints or a cycle."""
        for u, v in self.edges:
            for x in (u, v):
                if x not in self.nodes:
                    raise ProfileFormatError(f"edge {u} -> {v} names unknown node '{x}'")
        g = self.to_networkx()
        if not nx.is_directed_acyclic_graph(g):
            cycle = nx.find_cycle(g)
            raise ProfileFormatError(f"profile graph has a cycle: {cycle}")

    # ------------------------------------------------------------ JSON
    def to_json(self) -> dict:
        return {
            "schema": SCHEMA,
            "info": self.info,
            "param_sizes": self.param_sizes,
            "nodes": [asdict(n) for n in self.nodes.values()],
            "edges": [list(e) for e in self.edges],
        }

    @classmethod
    def from_json(cls, data: dict, source: str = "<json>") -> "CostGraph":
        if data.get("schema") != SCHEMA:
            raise ProfileFormatError(
                f"{source}: schema is {data.get('schema')!r}, expected {SCHEMA!r}"
            )
        nodes = {}
        for raw in data["nodes"]:
            raw = dict(raw)
            raw["params"] = tuple(raw.get("params", ()))
            nodes[raw["name"]] = CostNode(**raw)
        graph = cls(
            nodes=nodes,
            edges=[(u, v) for u, v in data["edges"]],
            info=dict(data.get("info", {})),
            param_sizes={k: int(v) for k, v in data.get("param_sizes", {}).items()},
        )
        graph.check()
        return graph

    def save(self, path: Union[str, Path]) -> None:
        """Write the profile as JSON; gzip-compressed where ``path`` ends in ``.gz`` (a deep model's profile
        shrinks about twelvefold, and ``load`` reads either)."""
        text = json.dumps(self.to_json(), indent=1)
        if str(path).endswith(".gz"):
            Path(path).write_bytes(gzip.compress(text.encode("utf-8"), mtime=0))  # mtime 0: same bytes each time
        else:
            Path(path).write_text(text)

    @classmethod
    def load(cls, path: Union[str, Path]) -> "CostGraph":
        """Load a JSON profile, or a PipeDream ``graph.txt`` (by content); a damaged file (truncated,
        hand-edited, not a profile) is one clear error."""
        path = _existing(path)
        text = _profile_text(path)
        try:
            if text.lstrip().startswith("{"):
                return cls.from_json(json.loads(text), source=str(path))
            return from_pipedream_text(text, source=str(path))
        except FxpipeError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError, IndexError) as exc:
            what = "is not valid JSON" if isinstance(exc, json.JSONDecodeError) else "is not a profile fxpipe can read"
            raise FxpipeError(f"{path} {what} ({type(exc).__name__}: {exc}); write it again with "
                              "`fxpipe profile MODEL -o FILE` or pass the model itself") from exc


# ------------------------------------------------------------ PipeDream

_NODE_RE = re.compile(
    r"^(?P<name>\S+) -- (?P<desc>.*) -- forward_compute_time=(?P<f>[-\d.eE+]+), "
    r"backward_compute_time=(?P<b>[-\d.eE+]+), activation_size=(?P<a>\[[^\]]*\]|[-\d.eE+]+), "
    r"parameter_size=(?P<p>[-\d.eE+]+)\s*$"
)
_EDGE_RE = re.compile(r"^\s+(?P<u>\S+) -- (?P<v>\S+)\s*$")


def closure(start, step) -> set:
    """``start`` and everything reachable from it through ``step`` (a mapping or list of next items)."""
    seen, todo = {start}, [start]
    while todo:
        for v in step[todo.pop()]:
            if v not in seen:
                seen.add(v)
                todo.append(v)
    return seen


def from_pipedream_text(text: str, source: str = "<graph.txt>") -> CostGraph:
    """Parse PipeDream's profiler output (``graph.txt``).

    Times there are milliseconds, sizes bytes. Nodes whose layer starts with
    ``Input`` are the data loader: PipeDream's optimizer gives them zero cost,
    and so do we (``is_input``). Nodes are returned in a topological order.
    """
    raw_nodes: Dict[str, CostNode] = {}
    edges: List[Tuple[str, str]] = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        m = _EDGE_RE.match(line)
        if m:
            edges.append((m["u"], m["v"]))
            continue
        m = _NODE_RE.match(line)
        if not m:
            raise ProfileFormatError(f"{source}:{lineno}: not a PipeDream node or edge line: {line[:80]!r}")
        desc = m["desc"]
        is_input = desc.startswith("Input")
        raw_nodes[m["name"]] = CostNode(
            name=m["name"],
            op="pipedream",
            target=desc,
            fwd_s=0.0 if is_input else float(m["f"]) / 1e3,
            bwd_s=0.0 if is_input else float(m["b"]) / 1e3,
            out_bytes=_activation_bytes(m["a"]),
            param_bytes=int(round(float(m["p"]))),
            is_input=is_input,
        )
    graph = CostGraph(nodes=raw_nodes, edges=edges, info={"source": source, "format": "pipedream"})
    graph.check()
    order = list(nx.lexicographical_topological_sort(graph.to_networkx(), key=_natural_key))
    graph.nodes = {n: raw_nodes[n] for n in order}
    return graph


def _activation_bytes(text: str) -> int:
    """A single size, or PipeDream's ``[a; b; c]`` for a tuple output (summed)."""
    text = text.strip()
    if text.startswith("["):
        return int(round(sum(float(x) for x in text[1:-1].split(";") if x.strip())))
    return int(round(float(text)))


def _existing(path: Union[str, Path]) -> Path:
    path = Path(path)
    if not path.exists():
        raise FxpipeError(f"profile file not found: {path}")
    return path


def _profile_text(path: Path) -> str:
    """A profile file's text, decompressed where it is gzip; a binary or damaged file is a clear error
    (read as text it raised a bare ``UnicodeDecodeError``)."""
    raw = path.read_bytes()
    if raw[:2] == GZIP_MAGIC:
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as exc:
            raise FxpipeError(f"{path} is a damaged gzip file ({exc}); write the profile again with "
                              "`fxpipe profile MODEL -o FILE` (a name ending in .gz compresses it)") from exc
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise FxpipeError(f"{path} is not a profile fxpipe can read (binary, neither JSON nor PipeDream's "
                          f"graph.txt: {exc}); write it again with `fxpipe profile MODEL -o FILE` or pass "
                          "the model itself") from exc


def _natural_key(name: str) -> Tuple:
    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name))


def load_pipedream(path: Union[str, Path]) -> CostGraph:
    """Read a PipeDream profiler ``graph.txt``."""
    path = _existing(path)
    return from_pipedream_text(_profile_text(path), source=str(path))
