"""Model spec -> profiled GraphModule: the capture and profile passes, as the CLI runs them.

``fxpipe profile``, ``fxpipe plan`` and ``fxpipe split`` all start the same
way; this is that start, with a progress bar on stderr.
"""
from __future__ import annotations

import sys
from typing import Optional

import torch
import torch.fx

from fxpipe.loader import ModelSpec
from fxpipe.runtime.precision import precision_dtype
from passes import meta
from passes.capture import capture
from passes.profile import profile
from passes.progress import Progress
from passes.values import COMPUTE_OPS


def profile_model(
    spec: ModelSpec,
    device: str = "cpu",
    repeats: int = 3,
    warmup: int = 2,
    method: str = "auto",
    threads: Optional[int] = 1,
    show_progress: bool = True,
    precision: str = "fp32",
) -> torch.fx.GraphModule:
    """Capture ``spec.model`` at the example microbatch and profile every node.

    ``threads`` sets torch's intra-op threads for the measurement (restored
    after; None keeps torch's): on a machine shared with other work, 1 gives
    the steadiest times (each node timed in its thread's CPU time). The
    defaults are ``fxpipe.split``'s, so ``fxpipe plan MODEL`` and ``fxpipe split``
    time nodes alike.
    ``precision`` (fp32, bf16, fp16): profile under the autocast training will
    use (``fxpipe.runtime.precision``), so the plan sees those times and bytes.
    """
    dtype = precision_dtype(precision)
    if show_progress:
        print(f"capture: {spec.source} ({method}) ...", file=sys.stderr, flush=True)
    gm = capture(spec.model, spec.example_inputs, method=method,
                 leaf_modules=spec.leaf_modules, concrete_args=spec.concrete_args)
    if show_progress:
        info = meta.get(gm, meta.CaptureInfo)
        why = f" (symbolic tracing failed: {info.fx_error})" if info.fx_error else ""
        print(f"capture: {info.method}, {len(gm.graph.nodes)} graph nodes, checked against the model{why}", file=sys.stderr)
    total = sum(1 for n in gm.graph.nodes if n.op in COMPUTE_OPS)
    bar = Progress(total, "profile") if show_progress else None
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        profile(gm, spec.example_inputs, device=device, repeats=repeats, warmup=warmup, progress=bar,
                autocast_dtype=None if dtype == torch.float32 else dtype)
    finally:
        torch.set_num_threads(before)
        if bar is not None:
            bar.close()
    return gm
