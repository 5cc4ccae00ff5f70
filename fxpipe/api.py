"""``fxpipe.split``: a model in, its pipeline stages out, in one call.

The passes in order: capture (symbolic trace, else torch.export) -> profile
(every node timed on the example microbatch) -> cost graph -> partition
(CP-SAT; may give a stage several replicas: the split is per stage all the
same, replicas run the same stage module) -> stage assignment on the graph ->
split (send/recv nodes). Each step is also a function of its own in
``passes``; this is the path a user takes when they just want the stages.
"""
from __future__ import annotations

import sys
from typing import Any, Iterable, Optional

import torch.nn as nn

from fxpipe.split_model import SplitModel


def split(model: nn.Module, example_inputs: Any, devices: int = 2, *, capture_method: str = "auto",
          leaf_modules: Iterable[Any] = (), concrete_args: Optional[dict] = None, device: str = "cpu",
          repeats: int = 3, threads: Optional[int] = 1, batch_size: Optional[int] = None,
          time_limit: float = 30.0, progress: bool = True, precision: str = "fp32",
          **plan_options: Any) -> SplitModel:
    """Split ``model`` into pipeline stages for ``devices`` devices.

    ``example_inputs``: one microbatch (a tuple of positional inputs, or one
    tensor). ``capture_method``: ``"auto"`` (symbolic trace, else torch.export),
    ``"fx"`` or ``"export"``. ``plan_options`` are the partitioner's (``bandwidth``,
    ``allreduce_bandwidth``, ``memory``, ``microbatches``, ``schedule``,
    ``cost_model``, ``replication``, ``fewer_devices``, ``optimizer_state``,
    ``gpus_per_node``, ``intra_bandwidth``, ``workers``, ``solver``), as on ``fxpipe plan``.
    The result's ``.plan`` is the plan,
    ``.profile`` the profiled cost graph. Stages share parameter objects with
    ``model`` (this process only). ``precision`` (fp32, bf16, fp16): profile
    under that autocast, so times, cut bytes and the dtypes sent between
    stages are the mixed-precision ones. An HF transformers model is captured
    with ``config.use_cache = False`` (set back afterwards): the generation
    cache is an object no stage can send.
    """
    from fxpipe.loader import ModelSpec, no_generation_cache
    from fxpipe.plan import plan_from_result
    from fxpipe.profiling import profile_model
    from passes.partition import apply_assignment, partition, stderr_progress
    from passes.profile import to_cost_graph
    from passes.split import split_stages

    inputs = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    untouched = [p for p in model.parameters() if p.grad is None]
    spec = ModelSpec(model=model, example_inputs=inputs, leaf_modules=tuple(leaf_modules),
                     concrete_args=concrete_args)
    cached = no_generation_cache(model, "fxpipe.split", " while capturing")
    try:
        gm = profile_model(spec, device=device, repeats=repeats, method=capture_method, threads=threads,
                           show_progress=progress, precision=precision)
    finally:
        for config in cached:
            config.use_cache = True
    graph = to_cost_graph(gm)
    result = partition(graph, devices, time_limit=time_limit, progress=stderr_progress if progress else None,
                       **plan_options)
    plan = plan_from_result(result, graph, batch_size=batch_size)
    apply_assignment(gm, result.assignment)
    if progress:
        print(f"split: {plan.num_stages} stages, replicas {[s.replicas for s in plan.stages]}", file=sys.stderr)
    split_model = SplitModel.from_result(split_stages(gm, inputs), gm, plan=plan)
    split_model.profile = graph
    for p in untouched:  # capture checks and profiling ran backward on the model's parameters
        p.grad = None
    return split_model

