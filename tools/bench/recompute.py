"""Benchmark: peak memory per rank with and without activation recomputation, measured and predicted.

    python -m tools.bench.recompute [--layers 16] [--dim 128] [--batch 32] [--microbatches 4] [--steps 3]
        [--schedules 1f1b-flush,zb-h1]

examples/gpt.py's GPT made deeper (``--layers``) and wider, split by fxpipe
into 2 stages, trained for ``--steps`` steps on 2 CPU ranks over gloo with
``--recompute none`` and ``--recompute all`` under each of ``--schedules``
(default 1f1b-flush; zb-h1's recomputing stages hand W the recomputed layer
inputs, ``fxpipe.runtime.deferred``).

Measured: per rank, the growth of the resident set during training (Linux
``VmHWM`` reset when training starts, minus the resident size then; see
``tools.bench.procmem``): gradients, optimizer state, activations and
communication buffers; the stage's weights were loaded before the mark.
Predicted: the cost model's memory per device
(``passes.partition.costmodel.memory_bytes``; with recomputation
``recompute_cost``) minus one copy of the weights, so both columns count the
same things. Not a test: the machine may be shared, and torch's CPU
allocator may keep freed blocks, so measured growth is an upper bound.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile
from typing import Any, Dict, List, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tools.bench.procmem import free_port, growth_mib, mark_baseline

HERE = os.path.dirname(os.path.abspath(__file__))
GPT_FILE = os.path.join(HERE, "..", "..", "examples", "gpt.py")


def _gpt_module() -> Any:
    spec = importlib.util.spec_from_file_location("fxpipe_bench_gpt", GPT_FILE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


def _data(batch: int) -> Any:
    gpt = _gpt_module()
    return lambda g: gpt._sample(torch.Generator().manual_seed(g), batch)


def _split(args: argparse.Namespace, folder: str) -> Any:
    from fxpipe.api import split

    gpt = _gpt_module()
    torch.manual_seed(0)
    model = gpt.GPT(dim=args.dim, layers=args.layers)
    result = split(model, _data(args.batch)(0)[0], 2, microbatches=args.microbatches, schedule="1f1b-flush",
                   replication="none", progress=False, time_limit=10.0)
    result.save(folder)
    return result


def _predicted(result: Any, recompute: bool, schedule: str) -> List[float]:
    """MiB per stage the cost model predicts, minus one copy of the weights (loaded before the mark)."""
    from passes.partition.costmodel import evaluate, recompute_cost, stage_input_bytes

    plan, graph = result.plan, result.profile
    opts = plan.cost_options(schedule=schedule)
    assignment, replicas = plan.assignment(), [s.replicas for s in plan.stages]
    out = []
    for j, s in enumerate(evaluate(graph, assignment, replicas, opts).stages):
        if recompute:
            s = recompute_cost(s, stage_input_bytes(graph, assignment, j), j, replicas, opts)
        out.append((s.memory_bytes - s.param_bytes) / 2**20)
    return out


def _entry(rank: int, port: int, folder: str, mode: str, schedule: str, batch: int, M: int, steps: int,
           out: str) -> None:
    import torch.nn as nn

    from fxpipe.layout import Layout
    from fxpipe.runtime.loop import TrainConfig, train
    from fxpipe.runtime.worker import init
    from fxpipe.split_model import SplitModel

    torch.set_num_threads(1)
    init(rank, 2, 300.0, init_method=f"tcp://127.0.0.1:{port}", device="cpu")
    lin = nn.Linear(2, 2)  # the first optimizer step imports torch._dynamo: keep that out of the growth
    lin(torch.ones(1, 2)).sum().backward()
    torch.optim.SGD(lin.parameters(), lr=0.1).step()
    gpt = _gpt_module()
    try:
        split = SplitModel.load(folder)
        mark_baseline()
        cfg = TrainConfig(schedule=schedule, microbatches=M, steps=steps, log=False, recompute=mode)
        res = train(rank=rank, layout=Layout.of((1, 1)), split=split, cfg=cfg, data=_data(batch), loss_fn=gpt.loss_fn)
        torch.save({"growth": growth_mib(), "sps": res.samples_per_s},
                   os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run(folder: str, mode: str, schedule: str, args: argparse.Namespace) -> List[Dict[str, Any]]:
    port = free_port()
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_entry, args=(port, folder, mode, schedule, args.batch, args.microbatches, args.steps, out),
                           nprocs=2, join=True, start_method="spawn")
        return [torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=False) for r in range(2)]


def main(argv: Sequence[str] = ()) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--schedules", default="1f1b-flush", help="comma-separated (default: 1f1b-flush)")
    args = p.parse_args(list(argv) or None)
    schedules = [s for s in args.schedules.split(",") if s]
    with tempfile.TemporaryDirectory() as folder:
        result = _split(args, folder)
        rows = []
        for schedule in schedules:
            for mode in ("none", "all"):
                measured = run(folder, mode, schedule, args)
                predicted = _predicted(result, mode == "all", schedule)
                for j in range(2):
                    sps = measured[1]["sps"]
                    rows.append((schedule, mode, j, predicted[j], measured[j]["growth"],
                                 sorted(sps)[len(sps) // 2] if sps else 0.0))
    print(f"GPT {args.layers} layers, dim {args.dim}, microbatch {args.batch}, {args.microbatches} microbatches, "
          f"2 stages; load average {os.getloadavg()[0]:.1f}")
    print(f"{'schedule':<11} {'recompute':<10} {'stage':>5} {'predicted MiB':>14} {'measured MiB':>13} {'samples/s':>10}")
    for schedule, mode, j, pred, meas, sps in rows:
        print(f"{schedule:<11} {mode:<10} {j:>5} {pred:>14.1f} {meas:>13.1f} {sps:>10.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
