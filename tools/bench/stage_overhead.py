"""Benchmark: what fxpipe's runtime adds to a stage's own compute, with no communication at all.

    python -m tools.bench.stage_overhead [--models mlp,gpt] [--repeats 400] [--rounds 5] [--steps 80]

The runtime benchmark (``tools.bench.runtime``) measures whole pipelines, where
fxpipe's forward and backward per microbatch ran ~10 % above torch's
``PipelineStage`` on the same layers. This one takes the communication out to
see where that comes from. One process, one thread, the runtime benchmark's
models and split:

- ``stage j``: stage j of the 2-stage split run forward and backward the way
  the executor runs it (its ``GraphModule``; the executor's
  ``passes.comm.MailboxTransport`` holding the received activation in its
  inbox and the sent value's gradient in ``grad_in``; backward from the loss or
  the sent value) against the same
  layers as a bare ``nn.Sequential`` (backward from the loss or from the
  output); median milliseconds per microbatch.
- ``loop``: the whole model as one stage on one rank: ``fxpipe.runtime.loop.train``
  (``1f1b-flush``, 8 microbatches, gloo group of one) against a plain loop with
  the same optimizer (``make_optimizer``) and allocator setting; median
  samples/s of the steps after the first 10.

Rounds alternate the two sides and the best round of each is kept (load only
ever slows a side down). A ratio near 1 says the stage graph and the training
loop cost nothing measurable; what the pipeline loses then lies in the
communication path. Not a test: the machine may be shared.
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, NamedTuple, Sequence, Tuple

import torch
import torch.nn as nn

from tools.bench.procmem import free_port, load_note
from tools.bench.runtime import MODELS, Stack, _fxpipe_split, bounds

M = 8  # microbatches per step in the loop measurement


class Cut(NamedTuple):
    """A runtime-benchmark model cut into stages: its pieces, data, cuts, fxpipe's split, and the
    activation at each stage boundary (``acts[j]`` enters stage j; ``acts[0]`` is the input)."""

    pieces: List[nn.Module]
    x: torch.Tensor
    y: torch.Tensor
    loss_fn: Callable
    cuts: List[int]
    split: Any
    acts: List[torch.Tensor]


def cut_model(model: str, stages: int) -> Cut:
    """``model`` (``tools.bench.runtime.MODELS``) split evenly into ``stages``, with its boundary activations."""
    pieces, x, y, loss_fn = MODELS[model]()
    cuts = bounds(len(pieces), stages)
    split = _fxpipe_split(pieces, x, cuts)
    acts = [x]
    with torch.no_grad():  # the activation at each stage boundary, from the bare model
        h = x
        for j in range(stages):
            for p in pieces[cuts[j]:cuts[j + 1]]:
                h = p(h)
            acts.append(h)
    return Cut(pieces, x, y, loss_fn, cuts, split, acts)


def wire_tags(gm: nn.Module) -> Tuple[List[str], List[str]]:
    """The tags a stage graph receives and sends (``passes.comm`` calls)."""
    from passes import comm

    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    return [n.args[0] for n in nodes if n.target is comm.recv], [n.args[1] for n in nodes if n.target is comm.send]


def stage_forward(cut: Cut, j: int) -> Callable[[nn.Module], Tuple[Any, List[torch.Tensor], List[torch.Tensor]]]:
    """A function running stage j's graph (or a copy of it) forward the way the executor runs it: its
    mailbox holding the received activation (and the sent value's gradient), under grad. It returns
    the mailbox and the backward's roots with their gradients (the loss on the last stage, else the
    sent values). The stage's wires are read once, here, not in the timed call."""
    from passes import comm

    recv, sent = wire_tags(cut.split.stages[j])
    args = [cut.x] if cut.split.stage_inputs[j] else []
    last = j == len(cut.cuts) - 2

    def run(gm: nn.Module) -> Tuple[Any, List[torch.Tensor], List[torch.Tensor]]:
        box = comm.MailboxTransport(owns_inbox=True, sent_as_roots=True)  # the executor's mailbox
        for tag in recv:
            box.inbox[tag] = cut.acts[j].clone()
        for tag in sent:
            box.grad_in[tag] = torch.ones_like(cut.acts[j + 1])
        with comm.bind(box), torch.enable_grad():
            outputs, _ = gm(*args)
        if last:
            loss = cut.loss_fn(cut.split.unflatten_outputs(outputs), cut.y)
            return box, [loss], [torch.ones_like(loss)]
        roots, grads = box.backward_roots()
        return box, list(roots), list(grads)

    return run


def bare_forward(cut: Cut, j: int, layers: nn.Module) -> Tuple[torch.Tensor, List[torch.Tensor], List[torch.Tensor]]:
    """Stage j's layers as plain torch code (``layers``: a copy of its pieces) run forward on its boundary
    activation; returns the input and the backward's roots with their gradients (the loss, or the output)."""
    inp = cut.acts[j].clone().requires_grad_() if j > 0 else cut.acts[0]
    out = layers(inp)
    if j == len(cut.cuts) - 2:
        loss = cut.loss_fn(out, cut.y)
        return inp, [loss], [torch.ones_like(loss)]
    return inp, [out], [torch.ones_like(out)]


def _stage_runs(model: str, stages: int = 2) -> List[Dict[str, Callable[[], None]]]:
    """Per stage: the fxpipe stage and the bare layers, each a no-argument forward + backward."""
    cut = cut_model(model, stages)
    runs = []
    for j in range(stages):
        sub = nn.Sequential(*[copy.deepcopy(p) for p in cut.pieces[cut.cuts[j]:cut.cuts[j + 1]]])

        def bare(j=j, sub=sub) -> None:
            _, roots, grads = bare_forward(cut, j, sub)
            torch.autograd.backward(roots, grads)

        def fxpipe(gm=cut.split.stages[j], forward=stage_forward(cut, j)) -> None:
            box, roots, grads = forward(gm)
            torch.autograd.backward(roots, grads)  # from the loss or the sent value, as the executor does
            box.collect_grads()  # the received value's gradient, as the executor collects it

        runs.append({"fxpipe": fxpipe, "bare": bare})
    return runs


def median_ms(fn: Callable[[], None], repeats: int, warmup: int = 10) -> float:
    """Median milliseconds of ``fn()`` over ``repeats`` calls after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def _loop_runs(model: str, steps: int) -> Dict[str, Callable[[], float]]:
    """The whole model as one stage: fxpipe's train loop and a plain loop, each returning samples/s."""
    from fxpipe.layout import Layout
    from fxpipe.runtime.heap import keep_freed_memory
    from fxpipe.runtime.loop import TrainConfig, make_optimizer, train

    pieces, x, y, loss_fn = MODELS[model]()
    split = _fxpipe_split(pieces, x, [0, len(pieces)])

    def fxpipe() -> float:
        cfg = TrainConfig(schedule="1f1b-flush", microbatches=M, steps=steps, lr=1e-3, log=False)
        res = train(rank=0, layout=Layout.of([1]), split=copy.deepcopy(split), cfg=cfg,
                    data=lambda g: ((x,), y), loss_fn=loss_fn)
        return statistics.median(res.samples_per_s[10:])

    def bare() -> float:
        keep_freed_memory()
        module = copy.deepcopy(Stack(pieces))
        opt = make_optimizer(TrainConfig(lr=1e-3), module)
        rates, t0 = [], time.perf_counter()
        for _ in range(steps):
            for _ in range(M):
                (loss_fn(module(x), y) / M).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            t = time.perf_counter()
            rates.append(M * x.shape[0] / (t - t0))
            t0 = t
        return statistics.median(rates[10:])

    return {"fxpipe": fxpipe, "bare": bare}


def main(argv: Sequence[str] = ()) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="mlp,gpt")
    p.add_argument("--repeats", type=int, default=400, help="microbatches timed per stage and round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=80, help="steps per loop run (the first 10 are warm-up)")
    args = p.parse_args(list(argv) or None)
    if args.steps <= 10:
        p.error("--steps must exceed the 10 warm-up steps")
    from tabulate import tabulate

    import torch.distributed as dist
    from fxpipe.runtime.worker import init

    torch.set_num_threads(1)
    load0 = os.getloadavg()
    # the train loop needs a group (of one); gloo on the CPU, as the runtime benchmark measures
    init(0, 1, 120.0, init_method=f"tcp://127.0.0.1:{free_port()}", device="cpu")
    rows = []
    try:
        for model in args.models.split(","):
            measured = [(f"stage {j} (ms / microbatch)", fns, "ms") for j, fns in enumerate(_stage_runs(model))]
            measured.append((f"loop, {M} microbatches (samples/s)", _loop_runs(model, args.steps), "rate"))
            for what, fns, unit in measured:
                best: Dict[str, float] = {}
                for _ in range(args.rounds):
                    for side, fn in fns.items():
                        value = median_ms(fn, args.repeats) if unit == "ms" else fn()
                        keep = min if unit == "ms" else max
                        best[side] = keep(best.get(side, value), value)
                # fxpipe's cost over the bare side's: time ratio, or rate ratio inverted
                cost = best["fxpipe"] / best["bare"] if unit == "ms" else best["bare"] / best["fxpipe"]
                rows.append([model, what, f"{best['fxpipe']:.3f}" if unit == "ms" else f"{best['fxpipe']:.0f}",
                             f"{best['bare']:.3f}" if unit == "ms" else f"{best['bare']:.0f}", f"{cost:.3f}"])
                print(f"  {model} {what}: fxpipe costs {cost:.3f} x bare", file=sys.stderr, flush=True)
    finally:
        dist.destroy_process_group()
    print(tabulate(rows, headers=["model", "measured", "fxpipe", "bare", "fxpipe's time / bare's"]))
    print(f"1 thread, {os.cpu_count()} cores; {load_note(load0)}; best of {args.rounds} interleaved rounds")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
