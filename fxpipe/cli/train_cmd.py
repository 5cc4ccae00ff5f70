"""``fxpipe train MODEL --devices N``: plan, split and train with N local workers.

A thin layer over the Python API: the options become the arguments of
``fxpipe.train`` (``fxpipe.trainer``), so a script gets the same run.

The model file's ``batches()`` feeds the data (``(inputs, targets)`` per
microbatch, or per step of M microbatches); without it the example minibatch
is every microbatch. The last stage prints each step's loss and samples/s.

Schedules: ``1f1b-flush`` (default; equals single-device training with
gradient accumulation over the step's microbatches: the gradient of the mean
microbatch loss), ``gpipe`` (same result, all forwards then all backwards),
``1f1b-stash`` (PipeDream: an update after every minibatch, each backward on
the weights its forward used; a "step" is M minibatches), ``2bw``
(PipeDream-2BW: one update per M microbatches with no flush, each step's
gradient computed on the weights before the previous update; two weight
versions).

Mistakes the parent can see (counts below 1, a first batch unlike
example_inputs, a --split of another model, a missing or damaged checkpoint)
stop it before any worker starts; a worker's failure (a NaN loss, an error in
the model or loss) ends the run with that rank's one line. Either way the exit
code is 2; ``fxpipe --debug train ...`` shows the tracebacks.

Multi-node: ``--launcher none --run-dir RUN`` writes RUN (the split,
``run.json``, a copy of the model file) and prints the command; copy RUN to
every node and start ``torchrun --nnodes ... -m fxpipe.runtime.worker RUN``
there. Rank 0 writes ``--save``.
"""
from __future__ import annotations

import argparse

from fxpipe.cli.plan_cmd import PRECISIONS
from fxpipe.runtime.devices import DEVICES
from fxpipe.runtime.lr_schedule import LR_SCHEDULES
from passes.partition.costmodel import DEFAULT_SCHEDULE, SCHEDULES
from fxpipe.units import at_least, parse_bandwidth, parse_memory, positive_float


def register(subparsers) -> None:
    p = subparsers.add_parser("train", help="pipeline-parallel training on local workers (torchrun)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="model .py file or package.module:factory")
    p.add_argument("--devices", "-k", type=at_least(1), default=None, help="number of workers (ranks)")
    p.add_argument("--schedule", choices=SCHEDULES, default=DEFAULT_SCHEDULE)
    p.add_argument("--microbatches", "-m", type=at_least(1), default=None,
                   help="microbatches per step (default: 4 x devices, as `fxpipe plan`; with --split, the plan's)")
    p.add_argument("--steps", type=at_least(1), default=10)
    p.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd")
    p.add_argument("--lr", type=float, default=None, help="learning rate (default 0.01 sgd, 0.001 adamw)")
    p.add_argument("--momentum", type=float, default=0.0, help="SGD momentum")
    p.add_argument("--weight-decay", type=float, default=None, help="default: the optimizer's (sgd 0, adamw 0.01)")
    p.add_argument("--clip-grad-norm", type=positive_float, default=None, metavar="X",
                   help="scale the gradient down to 2-norm X when above it (as torch's clip_grad_norm_): over the "
                        "whole model (every stage, replicas and tied copies once) for 1f1b-flush and gpipe; "
                        "with 1f1b-stash each update is clipped by its own stage's norm (stages tied by shared "
                        "weights together), as stages update at different times")
    p.add_argument("--lr-schedule", choices=LR_SCHEDULES, default="constant",
                   help="learning rate per step after the warm-up: constant, or a cosine or linear decay from "
                        "--lr towards --min-lr over the remaining --steps (1f1b-stash: a step is M minibatches, "
                        "its updates share one rate)")
    p.add_argument("--warmup-steps", type=at_least(0), default=0, metavar="N",
                   help="ramp the learning rate linearly over the first N steps: step s (from 0) uses --lr * (s+1)/N")
    p.add_argument("--min-lr", type=float, default=0.0, help="where cosine and linear decay head (default 0)")
    p.add_argument("--trace", default=None, metavar="OUT.json", help="write a Chrome trace of every rank")
    p.add_argument("--checkpoint", default=None, metavar="DIR", help="checkpoint folder (written at the end too)")
    p.add_argument("--checkpoint-every", type=at_least(0), default=0, metavar="N", help="checkpoint every N steps")
    p.add_argument("--log-every", type=at_least(1), default=1, metavar="N",
                   help="print a step line every N steps and after the last (samples/s over those N; default 1)")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --checkpoint")
    p.add_argument("--save", default=None, metavar="FILE.pt",
                   help="write the trained weights as the original model's state_dict")
    p.add_argument("--split", default=None, metavar="DIR", help="reuse a split folder from `fxpipe split`")
    p.add_argument("--timeout", type=positive_float, default=300.0,
                   help="seconds a worker waits for a peer before the run fails (default 300)")
    p.add_argument("--threads", type=at_least(1), default=None, help="torch threads per worker (default cores / N)")
    p.add_argument("--run-dir", default=None, help="keep the split and run.json here (default: a temp folder)")
    p.add_argument("--launcher", choices=("torchrun", "none"), default="torchrun",
                   help="torchrun: start the workers here (default); none: only write --run-dir and print the "
                        "torchrun command to run on every node (multi-node)")
    p.add_argument("--device", choices=DEVICES, default="auto",
                   help="where the workers run: cuda (NCCL, one GPU per worker), cpu (gloo), or auto (default: "
                        "cuda when this machine has a GPU for every worker); profiling runs there too")
    p.add_argument("--precision", choices=PRECISIONS, default="fp32",
                   help="stage forwards under autocast to this dtype; weights and optimizer stay fp32; "
                        "fp16 adds dynamic loss scaling (1f1b-flush and gpipe only)")
    p.add_argument("--recompute", choices=("none", "all", "auto"), default="none",
                   help="drop each stage's activations and recompute them in backward: all stages, none, or "
                        "auto (the stages whose predicted memory exceeds --memory)")
    p.add_argument("--bandwidth", type=parse_bandwidth, default=None, help="for the planner, bytes/s between stages")
    p.add_argument("--memory", type=parse_memory, default=None, help="for the planner, bytes per device")
    p.add_argument("--gpus-per-node", type=at_least(1), default=None, metavar="G",
                   help="for the planner: a two-level machine of G devices per node (--bandwidth between nodes)")
    p.add_argument("--intra-bandwidth", type=parse_bandwidth, default=None,
                   help="for the planner, bytes/s inside a node (with --gpus-per-node)")
    p.add_argument("--time-limit", type=positive_float, default=20.0, help="planner time limit in seconds")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """The options as ``fxpipe.train``'s arguments: the CLI is a thin layer over the Python API."""
    from fxpipe.trainer import train  # torch: imported only when training

    plan_options = {k: v for k, v in (("bandwidth", args.bandwidth), ("memory", args.memory),
                                      ("gpus_per_node", args.gpus_per_node),
                                      ("intra_bandwidth", args.intra_bandwidth)) if v is not None}
    train(args.model, devices=args.devices, schedule=args.schedule, microbatches=args.microbatches,
          steps=args.steps, optimizer=args.optimizer, lr=args.lr, momentum=args.momentum,
          weight_decay=args.weight_decay, trace=args.trace, checkpoint=args.checkpoint,
          checkpoint_every=args.checkpoint_every, resume=args.resume, save=args.save, split=args.split,
          run_dir=args.run_dir, launcher=args.launcher, threads=args.threads, timeout=args.timeout,
          time_limit=args.time_limit, return_state=False, debug=bool(getattr(args, "debug", False)),
          device=args.device, precision=args.precision, recompute=args.recompute, clip_grad_norm=args.clip_grad_norm,
          lr_schedule=args.lr_schedule, warmup_steps=args.warmup_steps, min_lr=args.min_lr,
          log_every=args.log_every, **plan_options)
    return 0
