"""Benchmark: a zero-bubble split backward (B, then W) against one whole backward, per stage.

    python -m tools.bench.split_backward [--models mlp,gpt] [--stages 2,4] [--repeats 100] [--rounds 3]

``zb-h1`` pays off only if splitting a stage's backward in an input half
(``B``) and a weight half (``W``) costs about what the whole backward costs.
One process, one thread, the runtime benchmark's models and splits; per stage
of each split, median milliseconds of a forward and its backward:

- ``whole``: fxpipe's stage (its ``GraphModule`` and mailbox, as the executor
  runs it under ``1f1b-flush``), one backward;
- ``deferred``: the same stage split as ``zb-h1`` now runs it where the
  stage qualifies (``fxpipe.runtime.deferred``: one backward with the Linear
  layers' weight products left for ``W``; a first stage, which receives
  nothing, runs its whole backward in ``W`` instead);
- ``engine``: the same stage split on its autograd graph
  (``fxpipe.runtime.wgrad``, what ``zb-h1`` ran before, and still runs for
  stages that do not qualify);
- ``torch whole`` / ``torch split``: the same layers as a bare
  ``nn.Sequential``, one backward, and split by torch.distributed.pipelining's
  ``stage_backward_input`` / ``stage_backward_weight`` (what its zero-bubble
  schedules run).

Each split is divided by its own side's whole backward. Rounds alternate the
variants and the best round of each is kept. Not a test: the machine may be
shared.
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
from typing import Callable, Dict, List, Sequence

import torch
import torch.nn as nn

from tools.bench.procmem import load_note
from tools.bench.stage_overhead import bare_forward, cut_model, median_ms, stage_forward

VARIANTS = ("whole", "deferred", "engine", "torch whole", "torch split")


def _stage_runs(model: str, stages: int) -> List[Dict[str, Callable[[], None]]]:
    """Per stage: each variant as a no-argument forward + backward (+ weight half)."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    from fxpipe.runtime.deferred import defer_weight_grads
    from fxpipe.runtime.wgrad import backward_input

    cut = cut_model(model, stages)
    runs = []
    for j in range(stages):
        bare = nn.Sequential(*[copy.deepcopy(p) for p in cut.pieces[cut.cuts[j]:cut.cuts[j + 1]]])
        gms = {v: copy.deepcopy(cut.split.stages[j]) for v in ("whole", "deferred", "engine")}
        deferral = defer_weight_grads(gms["deferred"])
        if deferral is None:
            raise SystemExit(f"{model} stage {j} does not qualify for deferred weight gradients")
        deferral.enabled = j > 0  # as the executor: a first stage (it receives nothing) defers nothing
        forward = stage_forward(cut, j)

        def whole(gm=gms["whole"], forward=forward) -> None:
            box, roots, grads = forward(gm)
            torch.autograd.backward(roots, grads)
            box.collect_grads()

        def deferred(gm=gms["deferred"], deferral=deferral, forward=forward) -> None:
            box, roots, grads = forward(gm)
            if not box.received:  # as the executor: no input half, the whole backward waits for W
                backward_input(roots, grads, [])[1].run()
                return
            deferral.collect()
            torch.autograd.backward(roots, grads)
            weights = deferral.done()
            box.collect_grads()
            weights.run()

        def engine(gm=gms["engine"], forward=forward) -> None:
            box, roots, grads = forward(gm)
            backward_input(roots, grads, list(box.received.values()))[1].run()

        def torch_whole(j=j, bare=bare) -> None:
            _, roots, grads = bare_forward(cut, j, bare)
            torch.autograd.backward(roots, grads)

        def torch_split(j=j, bare=bare) -> None:
            inp, roots, grads = bare_forward(cut, j, bare)
            if j == 0:  # no input half: the whole backward is the weight half (as fxpipe's first stages)
                torch.autograd.backward(roots, grads)
                return
            _, groups = stage_backward_input(roots, grads, [inp], bare.parameters())
            stage_backward_weight(bare.parameters(), groups)

        runs.append({"whole": whole, "deferred": deferred, "engine": engine, "torch whole": torch_whole,
                     "torch split": torch_split})
    return runs


def main(argv: Sequence[str] = ()) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="mlp,gpt")
    p.add_argument("--stages", default="2,4", help="splits measured (every stage of each)")
    p.add_argument("--repeats", type=int, default=100, help="microbatches timed per variant and round")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(list(argv) or None)
    from tabulate import tabulate

    torch.set_num_threads(1)
    load0 = os.getloadavg()
    rows = []
    for model in args.models.split(","):
        for stages in (int(s) for s in args.stages.split(",")):
            for j, fns in enumerate(_stage_runs(model, stages)):
                best: Dict[str, float] = {}
                for _ in range(args.rounds):
                    for v in VARIANTS:
                        best[v] = min(best.get(v, float("inf")), median_ms(fns[v], args.repeats, warmup=5))
                rows.append([model, stages, j] + [f"{best[v]:.3f}" for v in VARIANTS] +
                            [f"{best['deferred'] / best['whole']:.3f}", f"{best['engine'] / best['whole']:.3f}",
                             f"{best['torch split'] / best['torch whole']:.3f}"])
                print(f"  {model} {stages} stages, stage {j}: deferred {rows[-1][-3]}, engine {rows[-1][-2]}, "
                      f"torch {rows[-1][-1]} x whole", file=sys.stderr, flush=True)
    print(tabulate(rows, headers=["model", "stages", "stage"] + [f"{v} ms" for v in VARIANTS] +
                   ["deferred ÷ whole", "engine ÷ whole", "torch split ÷ torch whole"]))
    print(f"1 thread, {os.cpu_count()} cores; {load_note(load0)}; forward + backward per microbatch, "
          f"best of {args.rounds} interleaved rounds of {args.repeats}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
