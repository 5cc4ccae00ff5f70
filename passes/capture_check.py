"""Check a capture against the model it came from: forward output and every gradient.

Captures can be silently wrong (symbolic tracing freezes ``self.training``
branches and Python-level values; export specialises shapes), so every
capture is run once next to the original on the example inputs, from the same
RNG state (dropout draws the same masks), and compared:

- every output leaf (tensors, and plain Python values by equality);
- the gradient of a fixed weighted sum of the floating outputs with respect to
  every parameter of the captured module (same tensors as the model's);
- every buffer the two share by name, after the forward: an update the
  forward makes (BatchNorm's statistics, a counter ``self.n += 1``) must be in
  the graph (symbolic tracing runs a Python-level update once, while tracing,
  and leaves it out).

Tolerance, per tensor: ``max |captured - original| <= 1e-4 * max(1, max |original|)``;
bit-identical kernels usually agree exactly, ATen decompositions may differ in
the last float32 bits. Buffers (BatchNorm running stats) are restored after
the check, so checking does not change the model.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Sequence, Tuple

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from passes.errors import FxpipeError

RTOL = 1e-4
SEED = 1234


class CaptureMismatchError(FxpipeError):
    """The captured graph computes something else than the model."""


def check_capture(model: nn.Module, gm: torch.nn.Module, inputs: Sequence[Any], method: str = "") -> None:
    """Raise ``CaptureMismatchError`` unless ``gm`` matches ``model`` (see module doc)."""
    params = [(name, p) for name, p in gm.named_parameters() if p.requires_grad]
    saved = save_buffers(model, gm)
    try:
        ref_out, ref_grads = _run(model, inputs, [p for _, p in params])
        ref_bufs = {name: b.detach().clone() for name, b in model.named_buffers()}
        restore_buffers(saved)  # the graph starts from the same buffers (fx shares the model's)
        got_out, got_grads = _run(gm, inputs, [p for _, p in params])
        got_bufs = {name: b.detach().clone() for name, b in gm.named_buffers()}
    finally:
        restore_buffers(saved)
    label = f"capture ({method})" if method else "capture"
    ref_leaves, _ = pytree.tree_flatten(ref_out)
    got_leaves, _ = pytree.tree_flatten(got_out)
    if len(ref_leaves) != len(got_leaves):
        raise CaptureMismatchError(
            f"{label}: the captured graph returns {len(got_leaves)} values, the model {len(ref_leaves)}"
        )
    for i, (a, b) in enumerate(zip(got_leaves, ref_leaves)):
        _compare(a, b, f"{label}: output {i}")
    for (name, _), a, b in zip(params, got_grads, ref_grads):
        _compare(a, b, f"{label}: gradient of parameter '{name}'")
    for name in ref_bufs.keys() & got_bufs.keys():
        _compare(got_bufs[name], ref_bufs[name], f"{label}: buffer '{name}' after the forward")


def _run(module: Callable, inputs: Sequence[Any], params: List[torch.Tensor]) -> Tuple[Any, List[Any]]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        out = module(*inputs)
        loss = _probe_loss(out)
        if loss is None or not params or not loss.requires_grad:
            return _detach(out), [None] * len(params)
        grads = torch.autograd.grad(loss, params, allow_unused=True)
    return _detach(out), list(grads)


def _probe_loss(out: Any) -> Any:
    """A fixed, position-dependent weighting of every floating output (catches permutations)."""
    total = None
    for leaf in pytree.tree_leaves(out):
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point() and leaf.requires_grad:
            w = torch.linspace(-1.0, 1.0, leaf.numel(), dtype=leaf.dtype, device=leaf.device).reshape(leaf.shape)
            term = (leaf * w).sum() + leaf.sum()
            total = term if total is None else total + term
    return total


def _detach(out: Any) -> Any:
    return pytree.tree_map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, out)


def _compare(got: Any, ref: Any, what: str) -> None:
    if not isinstance(ref, torch.Tensor) and not isinstance(got, torch.Tensor):
        if got != ref:
            raise CaptureMismatchError(f"{what}: captured gives {got!r}, the model {ref!r}")
        return
    if ref is None or got is None:
        ref = torch.zeros_like(got) if ref is None else ref
        got = torch.zeros_like(ref) if got is None else got
    if not isinstance(ref, torch.Tensor) or not isinstance(got, torch.Tensor) or got.shape != ref.shape:
        raise CaptureMismatchError(f"{what}: captured gives {_describe(got)}, the model {_describe(ref)}")
    if ref.numel() == 0:
        return
    a, b = got.detach().double(), ref.detach().double()
    finite = torch.isfinite(b)
    if not torch.equal(finite, torch.isfinite(a)):
        raise CaptureMismatchError(f"{what}: infinities/NaNs differ between the capture and the model")
    diff = (a[finite] - b[finite]).abs().max().item() if finite.any() else 0.0
    scale = max(1.0, b[finite].abs().max().item() if finite.any() else 0.0)
    if diff > RTOL * scale:
        raise CaptureMismatchError(
            f"{what} differs from the model by {diff:.3g} (allowed {RTOL * scale:.3g}). "
            "The capture is not faithful: try method='export', or declare the module "
            "computing this value a leaf (leaf_modules)"
        )


def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {tuple(x.shape)}"
    return repr(x)


def save_buffers(*modules: nn.Module) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    seen: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}
    for m in modules:
        for b in m.buffers():
            seen.setdefault(id(b), (b, b.detach().clone()))
    return list(seen.values())


def restore_buffers(saved: List[Tuple[torch.Tensor, torch.Tensor]]) -> None:
    with torch.no_grad():
        for buf, copy in saved:
            buf.copy_(copy)
