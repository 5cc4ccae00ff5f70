"""Benchmark: the planner at cluster scale (deep GPTs, K up to 1024) against the hand-made Megatron layout.

Graphs: examples/gpt.py (dim 128, context 64, microbatch 8) with 2 blocks,
profiled once (2 repeats); deeper models are built by repeating the profiled
second block's nodes and costs (renamed, rewired along the residual stream),
because profiling 96 blocks takes minutes here. Tied embedding/head stay tied.

The profiles the README's tables were measured on are bundled in
``tools/bench/data/`` and read by default, so a table is reproducible on any
machine: a fresh profile of the same model moved the repeated block's cost by
up to 30 % run to run, and the planner's gaps move with it (``--reprofile``
profiles the models on this machine instead, cached in ``fxpipe-out/``).

Each row runs in its own subprocess (so RSS is the solve's own: ru_maxrss of
that process, including Python and numpy) with a wall-clock limit, and prints
the plan's throughput against the best uniform layout a user would pick: PP x
DP with the same number of blocks per stage (embedding with the first, head
with the last), each of the PP stages replicated DP times, scored by
``costmodel.evaluate`` under the same cost model.

    python -m tools.bench.partition_scale [--depths 8,32,96] [--devices 8,16,...,1024] [--time-limit 10]
        [--bandwidth B] [--gpus-per-node G --intra-bandwidth B1]   # flat, or a two-level machine
        [--cost-model fxpipe|pipedream] [--replication any|pow2|none] [--schedule 1f1b-stash|...]
        [--hf-gpt2]   # also HF GPT-2, 12 layers, tied and untied head (bundled; --reprofile needs transformers)
        [--hf-llama]  # also HF Llama, 24 layers (bundled; likewise)
        [--hf-llama-96]  # also the same HF Llama with 96 layers (bundled; likewise)
        [--hf-family]  # also HF Mistral, Qwen2, Phi3, GPT-NeoX and Gemma, 24 layers (bundled; likewise)
        [--reprofile [--device cpu|cuda]]   # profile the models here (cached in fxpipe-out/) instead
        [--profiles DIR]   # read (with --reprofile: make) the profiles in DIR, e.g. tools/bench/data/h100
        [--drop-guards]   # the HF profiles without export's ``_assert_tensor_metadata`` nodes (see below)
        [--memory BYTES]   # plans and uniform layouts within this memory per device (a row with none: the
                           # least memory a plan was found in)

HF GPT-2 (``--hf-gpt2``): GPT2LMHeadModel from a tiny config (vocab 512,
context 64, width 64, 12 layers, 2 heads; batch 4), captured through export
and profiled once per head kind (bundled, as above). Its graph keeps
what export makes of the attention mask: a few dozen small weightless nodes
beside the embeddings.

HF Llama (``--hf-llama``): LlamaForCausalLM from a tiny config (vocab 512, width 64, MLP 176, 24
layers, 4 heads over 2 key-value heads, context 64; batch 4), captured through export and profiled
once. Every layer reads the rotary tables computed once from the positions (``anchors.py``) and
runs its query, key and value projections side by side, a segment too wide for the exact lattice
(``wide_segments.py``). ``--hf-llama-96``: the same config with 96 layers (5,721 nodes).

HF families (``--hf-family``): MistralForCausalLM, Qwen2ForCausalLM, Phi3ForCausalLM,
GPTNeoXForCausalLM and GemmaForCausalLM, each with the 24-layer Llama's tiny config (GPT-NeoX
without key-value heads of its own, Gemma with head size 16), captured through export after capture
began erasing the metadata checks, profiled once and bundled gzip-compressed. What sets them apart
for the planner: Phi3 projects query, key and value in one weight and gate and up in another, GPT-NeoX
runs attention and MLP side by side from one residual (and rotates a quarter of each head), Gemma
ties its head to the embedding and scales the embedding's output, Qwen2 adds biases to the
projections, Mistral is Llama's graph but for its sliding-window mask (7 more nodes).

The bundled HF GPT-2 and 24-layer Llama profiles were captured before fxpipe's capture began
erasing export's ``_assert_tensor_metadata`` checks (``passes/capture.py``), so they hold those
nodes: leaves that read the residual stream before each norm, 1.1 % of the Llama's time, which a
model captured now does not run. They are kept so that the rows stay comparable across releases;
``--drop-guards`` plans these graphs without them (``without_guards``), as a profile made now would
have them, every other node's cost as measured.

Wall times are CPU-bound: other processes on the machine inflate them.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from passes.costgraph import CostGraph, CostNode
from passes.partition import CostOptions, evaluate, partition
from passes.partition.costmodel import COST_MODELS, DEFAULT_SCHEDULE, REPLICATION, SCHEDULES
from passes.partition.result import InfeasibleError

ROOT = Path(__file__).resolve().parents[2]
BUNDLED = Path(__file__).resolve().parent / "data"  # the profiles the README's tables were measured on
FRESH = ROOT / "fxpipe-out"  # ``--reprofile``: profiles made on this machine
PROFILES = BUNDLED  # where ``profiled_gpt`` and ``hf_gpt2`` read (``main`` switches it)
DEVICE = "cpu"  # where ``--reprofile`` measures (``--device``)
DROP_GUARDS = False  # ``--drop-guards``: the HF graphs without export's metadata checks (``without_guards``)
GUARD = "aten._assert_tensor_metadata.default"  # the target of those checks in a profile


def _profiled(cache: Path, build) -> CostGraph:
    """The profile cached at ``cache``, else ``build()``'s (model, example input) captured, profiled
    (2 repeats) on ``DEVICE`` and cached."""
    if cache.exists():
        return CostGraph.load(cache)
    import torch

    from passes.capture import capture
    from passes.profile import profile, to_cost_graph

    torch.manual_seed(0)
    model, x = build()
    gm = capture(model, (x,))
    profile(gm, (x,), device=DEVICE, repeats=2, warmup=1)
    graph = to_cost_graph(gm)
    cache.parent.mkdir(parents=True, exist_ok=True)
    graph.save(cache)
    return graph


def profiled_gpt() -> CostGraph:
    """The 2-block GPT profile (bundled; with ``--reprofile`` made once here, then read from ``fxpipe-out/``)."""
    def build():
        import torch

        sys.path.insert(0, str(ROOT))
        import examples.gpt as gpt
        return gpt.GPT(dim=128, layers=2, context=64), torch.randint(0, gpt.VOCAB, (gpt.BATCH, 64))

    return _profiled(PROFILES / "gpt-2block-profile.json", build)


def hf_gpt2(tied: bool) -> Optional[CostGraph]:
    """The 12-layer HF GPT-2 profile (see the module docstring); None without transformers."""
    cache = PROFILES / f"hf-gpt2-{'tied' if tied else 'untied'}-profile.json"

    def build():
        import torch
        import transformers

        cfg = transformers.GPT2Config(vocab_size=512, n_positions=64, n_embd=64, n_layer=12, n_head=2,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                                      tie_word_embeddings=tied)
        return transformers.GPT2LMHeadModel(cfg), torch.randint(0, 512, (4, 64))

    try:
        return _profiled(cache, build)
    except ImportError:
        return None


HF = {"hf-gpt2": True, "hf-gpt2-untied": False}  # row label -> tied head
LLAMA, LLAMA96 = "hf-llama", "hf-llama-96"  # row labels of ``hf_llama`` at 24 and 96 layers
LLAMAS = {LLAMA: 24, LLAMA96: 96}  # row label -> layers


def without_guards(graph: CostGraph) -> CostGraph:
    """``graph`` without export's ``_assert_tensor_metadata`` nodes that nothing reads, as fxpipe's capture
    now erases them (``passes.capture._drop_metadata_asserts``); the other nodes and their costs unchanged."""
    succ = graph.successors()
    drop = {n for n, node in graph.nodes.items() if node.target == GUARD and not succ[n]}
    if not drop:
        return graph
    return CostGraph(nodes={n: node for n, node in graph.nodes.items() if n not in drop},
                     edges=[(u, v) for u, v in graph.edges if u not in drop and v not in drop],
                     info=dict(graph.info), param_sizes=dict(graph.param_sizes))


def hf_llama(layers: int = 24) -> Optional[CostGraph]:
    """The HF Llama profile with ``layers`` layers, 24 or 96 (see the module docstring); None without
    transformers where it is not bundled."""
    def build():
        import torch
        import transformers

        cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=176, num_hidden_layers=layers,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                       use_cache=False)
        return transformers.LlamaForCausalLM(cfg), torch.randint(0, 512, (4, 64))

    try:
        return _profiled(PROFILES / f"hf-llama-{layers}-profile.json", build)
    except ImportError:
        return None


# row label -> (transformers model type, its class, config keywords besides ``hf_llama``'s): the Llama-like
# families people train, 24 layers each at the same tiny width (``--hf-family``)
FAMILY: Dict[str, Tuple[str, str, Dict[str, object]]] = {
    "hf-mistral": ("mistral", "MistralForCausalLM", {}),
    "hf-qwen2": ("qwen2", "Qwen2ForCausalLM", {}),
    "hf-phi3": ("phi3", "Phi3ForCausalLM", {"pad_token_id": 0, "bos_token_id": 0, "eos_token_id": 0}),
    "hf-gpt-neox": ("gpt_neox", "GPTNeoXForCausalLM", {"num_key_value_heads": None}),  # None: not an option there
    "hf-gemma": ("gemma", "GemmaForCausalLM", {"head_dim": 16}),
}


def hf_family(label: str) -> Optional[CostGraph]:
    """The 24-layer profile of ``FAMILY[label]`` (bundled gzip-compressed; see the module docstring);
    None without transformers where it is not bundled."""
    model_type, cls, extra = FAMILY[label]

    def build():
        import torch
        import transformers

        options = dict(vocab_size=512, hidden_size=64, intermediate_size=176, num_hidden_layers=24,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, use_cache=False)
        options.update(extra)
        options = {k: v for k, v in options.items() if v is not None}
        config = transformers.AutoConfig.for_model(model_type, **options)
        return getattr(transformers, cls)(config), torch.randint(0, 512, (4, 64))

    try:
        return _profiled(PROFILES / f"{label}-24-profile.json.gz", build)
    except ImportError:
        return None


def _block_of(node: CostNode) -> Optional[int]:
    m = re.match(r"(?:blocks|transformer\.h|model\.layers|gpt_neox\.layers)\.(\d+)(\.|$)", node.module_path)
    return int(m.group(1)) if m else None


def deep_gpt(depth: int, base: Optional[CostGraph] = None) -> CostGraph:
    """``depth`` >= 2 blocks: the profiled block 0, then copies of the profiled last block.

    Edges inside the template are copied into every copy; edges entering it
    from block 0 enter the first copy, and copy k-1's node that leaves the
    template (the residual stream) feeds copy k the same way; edges leaving
    the template leave the last copy.
    """
    if depth < 2:
        raise ValueError("depth must be >= 2")
    base = base or profiled_gpt()
    block = {n: _block_of(nd) for n, nd in base.nodes.items()}
    last = max(b for b in block.values() if b is not None)
    tmpl = [n for n in base.nodes if block[n] == last]
    copies = [{n: n for n in tmpl}] + [{n: f"{n}__b{i}" for n in tmpl} for i in range(2, depth)]
    tag = f"blocks.{last}"
    nodes: Dict[str, CostNode] = {}
    sizes = {p: s for p, s in base.param_sizes.items() if not p.startswith(tag + ".")}
    for n, nd in base.nodes.items():
        if block[n] != last:
            nodes[n] = nd
        elif n == tmpl[0]:  # all copies here, one block after the other
            for i, names in enumerate(copies, start=1):
                for m in tmpl:
                    md = base.nodes[m]
                    params = tuple(p.replace(tag, f"blocks.{i}", 1) for p in md.params)
                    sizes.update({q: base.param_sizes[p] for p, q in zip(md.params, params)})
                    nodes[names[m]] = CostNode(**{**md.__dict__, "name": names[m], "params": params,
                                                 "module_path": md.module_path.replace(tag, f"blocks.{i}", 1)})
    exits = [u for u, v in base.edges if block[u] == last and block[v] != last]
    edges: List[Tuple[str, str]] = []
    for u, v in base.edges:
        if block[u] == last and block[v] == last:
            edges += [(c[u], c[v]) for c in copies]
        elif block[v] == last:
            edges.append((u, v))
            edges += [(copies[k - 1][exits[0]], copies[k][v]) for k in range(1, len(copies))]
        elif block[u] == last:
            edges.append((copies[-1][u], v))
        else:
            edges.append((u, v))
    graph = CostGraph(nodes=nodes, edges=list(dict.fromkeys(edges)), info={"source": f"gpt, {depth} blocks"}, param_sizes=sizes)
    graph.check()
    return graph


def megatron_layout(graph: CostGraph, opts: CostOptions) -> Tuple[float, str]:
    """Best uniform PP x DP layout (equal blocks per stage, embedding first, head last) within ``opts.memory``
    if set: (bottleneck, 'PPxDP'), or (inf, 'none') where no layout fits."""
    block = {n: _block_of(nd) for n, nd in graph.nodes.items()}
    depth = max(b for b in block.values() if b is not None) + 1
    names = list(graph.nodes)
    first_block = min(i for i, n in enumerate(names) if block[n] is not None)
    best = (float("inf"), "")
    for pp in range(1, min(depth, opts.devices) + 1):
        if depth % pp or opts.devices % pp:
            continue
        dp = opts.devices // pp
        if opts.replication == "pow2" and dp & (dp - 1):
            continue
        per = depth // pp
        stage = {}
        for i, n in enumerate(names):
            b = block[n]
            stage[n] = (b // per) if b is not None else (0 if i < first_block else pp - 1)
        ev = evaluate(graph, stage, [dp] * pp, opts)
        if opts.memory is None or ev.peak_memory_bytes <= opts.memory:
            best = min(best, (ev.bottleneck_s, f"{pp}x{dp}"))
    return best if best[1] else (float("inf"), "none")


def run_row(depth, devices: int, time_limit: float, machine: Dict[str, float]) -> Dict[str, object]:
    """One row, in this process (``main`` runs it in a subprocess so RSS is the row's own).

    ``machine``: the partitioner's options (``bandwidth``, for a two-level machine ``gpus_per_node``
    and ``intra_bandwidth``, ``cost_model``, ``replication``); the uniform layout is scored under the
    same ones.
    """
    graph = hf_gpt2(HF[depth]) if depth in HF else hf_llama(LLAMAS[depth]) if depth in LLAMAS \
        else hf_family(depth) if depth in FAMILY else deep_gpt(int(depth))
    graph = without_guards(graph) if DROP_GUARDS else graph
    extra = {k: v for k, v in machine.items() if v is not None}
    start = time.monotonic()
    try:
        res = partition(graph, devices, time_limit=time_limit, **extra)
    except InfeasibleError as err:  # under --memory: a row of its own, with the least memory a plan was found in
        uniform, layout = megatron_layout(graph, CostOptions(devices=devices, **extra))
        return {"depth": depth, "nodes": len(graph.nodes), "K": devices, "wall_s": time.monotonic() - start,
                "status": "no plan", "method": "", "gap": math.nan, "plan_s": math.nan, "stages": 0,
                "uniform_s": uniform, "uniform": layout, "peak_mib": getattr(err, "fits_in", math.nan) / 2**20,
                "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    wall = time.monotonic() - start
    uniform, layout = megatron_layout(graph, res.options)
    return {"depth": depth, "nodes": len(graph.nodes), "K": devices, "wall_s": wall, "status": res.status,
            "method": res.method, "gap": res.gap, "plan_s": res.bottleneck_s, "stages": len(res.replicas),
            "uniform_s": uniform, "uniform": layout, "peak_mib": max(st.memory_bytes for st in res.stages) / 2**20,
            "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def _shown(folder: Path) -> str:
    """``folder`` relative to the repository where it is inside it (the table names no path of this machine)."""
    try:
        return str(folder.resolve().relative_to(ROOT)) + "/"
    except ValueError:
        return str(folder)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depths", default="8,32,96")
    ap.add_argument("--devices", default="8,16,32,64,128,256,512,1024")
    ap.add_argument("--time-limit", type=float, default=10.0)
    ap.add_argument("--bandwidth", type=float, default=1.25e9, help="bytes/s between nodes (default 10 Gbit/s)")
    ap.add_argument("--gpus-per-node", type=int, default=None, help="a two-level machine: G devices per node")
    ap.add_argument("--intra-bandwidth", type=float, default=None, help="bytes/s inside a node (with G)")
    ap.add_argument("--cost-model", choices=COST_MODELS, default="fxpipe")
    ap.add_argument("--replication", choices=REPLICATION, default="any")
    ap.add_argument("--schedule", choices=SCHEDULES, default=DEFAULT_SCHEDULE,
                    help="the schedule planned for (1f1b-stash: the stages sharing a tied weight at one replica count)")
    ap.add_argument("--hf-gpt2", action="store_true", help="also HF GPT-2 (12 layers), tied and untied head")
    ap.add_argument("--hf-llama", action="store_true", help="also HF Llama (24 layers, rotary, grouped-query attention)")
    ap.add_argument("--hf-llama-96", action="store_true", help="also the same HF Llama with 96 layers")
    ap.add_argument("--hf-family", action="store_true",
                    help="also HF Mistral, Qwen2, Phi3, GPT-NeoX and Gemma (24 layers, --hf-llama's tiny width)")
    ap.add_argument("--reprofile", action="store_true",
                    help="profile the models on this machine (cached in fxpipe-out/), not the bundled profiles")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where --reprofile measures")
    ap.add_argument("--profiles", default=None,
                    help="read the profiles in this folder (with --reprofile: made there when missing)")
    ap.add_argument("--drop-guards", action="store_true",
                    help="plan the HF graphs without export's _assert_tensor_metadata nodes, as capture now "
                         "erases them (the bundled HF GPT-2 and 24-layer Llama profiles predate that)")
    ap.add_argument("--memory", type=float, default=None,
                    help="bytes per device the plans (and the uniform layouts) must fit; default unchecked")
    ap.add_argument("--row", default=None, help=argparse.SUPPRESS)  # depth,K: run one row, print JSON
    args = ap.parse_args(argv)
    global PROFILES, DEVICE, DROP_GUARDS
    PROFILES = Path(args.profiles).resolve() if args.profiles else FRESH if args.reprofile else BUNDLED
    DEVICE = args.device
    DROP_GUARDS = args.drop_guards
    if args.device == "cuda" and not args.reprofile:
        ap.error("--device cuda measures new profiles: add --reprofile")
    machine = {"bandwidth": args.bandwidth, "gpus_per_node": args.gpus_per_node,
               "intra_bandwidth": args.intra_bandwidth, "cost_model": args.cost_model,
               "replication": args.replication, "schedule": args.schedule,
               "memory": None if args.memory is None else int(args.memory)}
    if args.row:
        from fxpipe.runtime.heap import keep_freed_memory

        keep_freed_memory()  # as `fxpipe plan` and `fxpipe split` do before planning
        depth, k = args.row.split(",")
        print(json.dumps(run_row(depth, int(k), args.time_limit, machine)))
        return 0
    from tabulate import tabulate

    profiled_gpt()  # profile once before the rows
    depths = [d for d in args.depths.split(",") if d]
    if args.hf_gpt2:
        found = [label for label, tied in HF.items() if hf_gpt2(tied) is not None]
        if not found:
            print("HF GPT-2 rows skipped: transformers is not installed", file=sys.stderr)
        depths += found
    for label, wanted in ((LLAMA, args.hf_llama), (LLAMA96, args.hf_llama_96)):
        if wanted and hf_llama(LLAMAS[label]) is None:
            print(f"{label} rows skipped: transformers is not installed", file=sys.stderr)
        elif wanted:
            depths.append(label)
    if args.hf_family:
        found = [label for label in FAMILY if hf_family(label) is not None]
        if not found:
            print("HF family rows skipped: transformers is not installed", file=sys.stderr)
        depths += found
    rows = []
    for depth in depths:
        for k in (int(x) for x in args.devices.split(",")):
            cmd = [sys.executable, "-m", "tools.bench.partition_scale", "--row", f"{depth},{k}",
                   "--time-limit", str(args.time_limit)]
            cmd += [f"--{name.replace('_', '-')}={value}" for name, value in machine.items() if value is not None]
            cmd += ["--reprofile", f"--device={args.device}"] if args.reprofile else []
            cmd += [f"--profiles={PROFILES}"] + (["--drop-guards"] if args.drop_guards else [])
            out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
            if out.returncode:
                print(out.stderr, file=sys.stderr)
                continue
            r = json.loads(out.stdout.strip().splitlines()[-1])
            fits, planned = math.isfinite(r["uniform_s"]), math.isfinite(r["plan_s"])
            rows.append([r["depth"], r["nodes"], r["K"], f"{r['wall_s']:.2f}", f"{r['rss_mb']:.0f}", r["status"],
                         f"{100 * r['gap']:.3f}%" if planned else "-", r["stages"],
                         f"{r['plan_s'] * 1e3:.3f}" if planned else "-", r["uniform"],
                         f"{r['uniform_s'] * 1e3:.3f}" if fits else "-",
                         f"{r['uniform_s'] / r['plan_s']:.2f}" if fits and planned else "-"]
                        + ([f"{r['peak_mib']:.0f}" if planned else f"(a plan fits {r['peak_mib']:.0f})"]
                           if args.memory else []))
            print(" | ".join(map(str, rows[-1])), file=sys.stderr, flush=True)
    where = (f"{args.gpus_per_node} devices per node, {args.intra_bandwidth or args.bandwidth:g} B/s inside, "
             if args.gpus_per_node else "flat, ") + f"{args.bandwidth:g} B/s between stages" \
        + f"; {args.cost_model} cost model, replication {args.replication}, schedule {args.schedule}" \
        + (f"; memory {args.memory:g} B per device (plans and uniform layouts within it)" if args.memory else "")
    made = f"made on this machine ({args.device})" if args.reprofile else "read"
    guards = "; export's metadata checks dropped from the HF graphs" if args.drop_guards else ""
    print(f"machine: {where}; time limit {args.time_limit:g} s; profiles: {made}, {_shown(PROFILES)}{guards}")
    print(tabulate(rows, headers=["blocks", "nodes", "K", "wall s", "RSS MB", "status", "gap", "stages",
                                  "plan ms", "uniform PPxDP", "uniform ms", "plan speedup"]
                   + (["plan peak MiB"] if args.memory else []), tablefmt="github"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
