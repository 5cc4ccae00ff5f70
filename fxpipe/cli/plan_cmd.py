"""``fxpipe plan SOURCE --devices K``: partition a profiled model and print (or save) the plan.

SOURCE is a profile JSON (``fxpipe profile``), a PipeDream ``graph.txt``, or a
model (a ``.py`` file or ``package.module:factory``) which is then captured and
profiled on this machine first.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from typing import TYPE_CHECKING, Optional

from passes.errors import FxpipeError
from passes.partition.costmodel import DEFAULT_SCHEDULE, SCHEDULES

from fxpipe.units import at_least, parse_bandwidth, parse_memory, positive_float

if TYPE_CHECKING:
    from passes.costgraph import CostGraph

# ``fxpipe.runtime.precision``'s names (a test holds them equal), here without importing torch for --help
PRECISIONS = ("fp32", "bf16", "fp16")


def add_precision_option(p: argparse.ArgumentParser, default: Optional[str] = "fp32") -> None:
    said = ("default fp32" if default == "fp32" else
            "default: a profile file's own, fp32 for a model")
    p.add_argument("--precision", choices=PRECISIONS, default=default,
                   help=f"profile the model under this autocast, as training with --precision runs it "
                        f"(fp32: none; {said})")


def register(subparsers) -> None:
    p = subparsers.add_parser("plan", help="partition a model into pipeline stages (CP-SAT)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", help="profile JSON, PipeDream graph.txt, model .py file or package.module:factory")
    add_plan_options(p)
    add_precision_option(p, default=None)
    p.add_argument("--json", action="store_true", help="print the plan as JSON instead of a table")
    p.add_argument("-o", "--output", default=None, help="also write the plan JSON here")
    p.set_defaults(func=run)


def add_plan_options(p: argparse.ArgumentParser) -> None:
    """The partitioner's options (``--devices`` and the cost model's), shared with ``fxpipe split``."""
    p.add_argument("--devices", "-k", type=at_least(1), required=True, help="number of devices K")
    p.add_argument("--bandwidth", type=parse_bandwidth, default=1.25e9,
                   help="bytes/s between stages, or between nodes with --gpus-per-node "
                        "(1.25e9, 10Gbit/s, 1.25GB/s; default 10 Gbit/s)")
    p.add_argument("--allreduce-bandwidth", type=parse_bandwidth, default=None,
                   help="bytes/s inside a replica group (default: --bandwidth); not with --gpus-per-node")
    p.add_argument("--gpus-per-node", type=at_least(1), default=None, metavar="G",
                   help="devices per node (K must be a multiple): links and all-reduce inside a node run at "
                        "--intra-bandwidth, across nodes at --bandwidth")
    p.add_argument("--intra-bandwidth", type=parse_bandwidth, default=None,
                   help="bytes/s between two devices of one node (with --gpus-per-node; default --bandwidth)")
    p.add_argument("--memory", type=parse_memory, default=None, help="bytes per device (16GiB, 1.6e10); default unchecked")
    p.add_argument("--microbatches", type=at_least(1), default=None, help="microbatches per step (default 4 x K; gpipe with --memory: K)")
    p.add_argument("--schedule", choices=SCHEDULES, default=DEFAULT_SCHEDULE,
                   help=f"schedule the plan is for (memory, in-flight counts); default {DEFAULT_SCHEDULE}, as fxpipe train")
    p.add_argument("--cost-model", choices=("fxpipe", "pipedream"), default="fxpipe")
    p.add_argument("--replication", choices=("any", "pow2", "none"), default="any",
                   help="replicas per stage: any count, powers of two, or none (straight pipeline)")
    p.add_argument("--fewer-devices", action="store_true", help="allow plans that leave devices idle")
    p.add_argument("--optimizer-state", type=float, default=1.0, help="optimizer bytes per weight byte (Adam: 2)")
    p.add_argument("--time-limit", type=positive_float, default=60.0, help="solver time limit in seconds (default 60)")
    p.add_argument("--solver", choices=("auto", "cpsat"), default="auto",
                   help="auto: exact downset DP when the graph has few downsets, else CP-SAT; cpsat: always CP-SAT")
    p.add_argument("--workers", type=at_least(1), default=2, help="CP-SAT worker threads (default 2)")
    p.add_argument("--batch-size", type=at_least(1), default=None, help="samples per microbatch (default: from the profile)")


def partition_kwargs(args: argparse.Namespace) -> dict:
    """``partition(graph, args.devices, **partition_kwargs(args))`` from the options above.

    A topology that cannot hold K devices fails here, before any profiling.
    """
    if args.gpus_per_node is not None or args.intra_bandwidth is not None:
        from passes.partition.costmodel import CostOptions

        CostOptions(devices=args.devices, bandwidth=args.bandwidth, allreduce_bandwidth=args.allreduce_bandwidth,
                    gpus_per_node=args.gpus_per_node, intra_bandwidth=args.intra_bandwidth)
    return dict(bandwidth=args.bandwidth, allreduce_bandwidth=args.allreduce_bandwidth, memory=args.memory,
                microbatches=args.microbatches, schedule=args.schedule, cost_model=args.cost_model,
                replication=args.replication, fewer_devices=args.fewer_devices,
                optimizer_state=args.optimizer_state, time_limit=args.time_limit, workers=args.workers,
                solver=args.solver, gpus_per_node=args.gpus_per_node, intra_bandwidth=args.intra_bandwidth)


def load_source(source: str, precision: Optional[str] = None) -> "CostGraph":
    """A CostGraph from a profile file, or by capturing and profiling a model as ``fxpipe split`` does
    (under ``precision``'s autocast; fp32 when None).

    A profile file loads without torch: only a model source imports it. It was
    profiled in one precision; asking for another is an error naming both.
    """
    path = Path(source)
    if path.suffix != ".py" and (path.exists() or ":" not in source):
        from passes.costgraph import CostGraph

        graph = CostGraph.load(path)
        taken = graph.info.get("precision", "fp32")
        if precision is not None and precision != taken:
            raise FxpipeError(f"plan: {source} was profiled in {taken}, not {precision}; profile the model "
                              f"with `fxpipe profile MODEL --precision {precision} -o PROFILE` (or plan the "
                              "model file itself) to plan for it")
        return graph
    try:
        from fxpipe.loader import load_model
    except ImportError as exc:
        raise FxpipeError(f"plan: cannot load model {source!r} ({exc}); profile it with `fxpipe profile` "
                          "and pass the profile JSON") from exc
    from fxpipe.profiling import profile_model
    from passes.profile import to_cost_graph

    return to_cost_graph(profile_model(load_model(source), precision=precision or "fp32"))  # as `fxpipe split` times it


def run(args: argparse.Namespace) -> int:
    from passes.partition import partition, stderr_progress
    from fxpipe.plan import plan_from_result

    from fxpipe.runtime.heap import keep_freed_memory

    keep_freed_memory()  # the DP passes allocate and free the same large arrays again (fxpipe.runtime.heap)
    graph = load_source(args.source, args.precision)
    result = partition(graph, args.devices, progress=stderr_progress, **partition_kwargs(args))
    plan = plan_from_result(result, graph, batch_size=args.batch_size)
    if args.output:
        plan.save(args.output)
    if args.json:
        print(json.dumps(plan.to_json(), indent=1))
    else:
        print(plan.table())
    return 0
