"""Helpers shared by the split tests: capture, hand-made stage assignments, and
the equivalence check of a split model against the unsplit one."""
from __future__ import annotations

import copy
from typing import Any, Callable, Dict, List, Sequence, Tuple

import torch
import torch.fx

from passes import meta
from passes.split import split_stages

COMPUTE = ("call_function", "call_method", "call_module")


def capture(model: torch.nn.Module, inputs: Sequence[Any], method: str) -> torch.fx.GraphModule:
    if method == "fx":
        return torch.fx.symbolic_trace(model)
    return torch.export.export(model, tuple(inputs)).module()


def compute_nodes(gm: torch.fx.GraphModule) -> List[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op in COMPUTE and n.target != "_guards_fn"]


def assign_even(gm: torch.fx.GraphModule, k: int) -> None:
    """Cut the compute nodes, in graph order, into ``k`` runs of similar length."""
    nodes = compute_nodes(gm)
    for i, n in enumerate(nodes):
        meta.put(n, meta.StageAssign(min(k - 1, i * k // len(nodes))))


def assign_by_name(gm: torch.fx.GraphModule, stages: Dict[str, int], default: int = 0) -> None:
    for n in compute_nodes(gm):
        meta.put(n, meta.StageAssign(stages.get(n.name, default)))


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    scale = ref.detach().abs().max().clamp_min(1e-12)
    return float((got.detach() - ref.detach()).abs().max() / scale)


def _as_tuple(x: Any) -> Tuple[Any, ...]:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def _loss(outputs: Any) -> torch.Tensor:
    """A loss that weighs every output element differently (no cancellations)."""
    total = torch.zeros(())
    for i, out in enumerate(_as_tuple(outputs)):
        g = torch.Generator().manual_seed(100 + i)
        total = total + (out.float() * torch.randn(out.shape, generator=g)).sum()
    return total


def _run(fn: Callable[..., Any], inputs: Sequence[Any]) -> Tuple[Any, List[Any]]:
    leaves = [x.detach().clone().requires_grad_(x.is_floating_point()) if isinstance(x, torch.Tensor) else x
              for x in inputs]
    out = fn(*leaves)
    _loss(out).backward()
    return out, [x.grad for x in leaves if isinstance(x, torch.Tensor) and x.is_floating_point()]


def check_equivalent(model: torch.nn.Module, run_split: Callable[..., Any], named_grads: Callable[[], Dict[str, Any]],
                     inputs: Sequence[Any], tol: float = 1e-5) -> None:
    """Outputs, input gradients and every parameter gradient agree with ``model``.

    ``model`` must be a separate copy from the split one; ``named_grads``
    returns the split side's parameter gradients under the original names.
    """
    ref_out, ref_in = _run(model, inputs)
    out, got_in = _run(run_split, inputs)
    for a, b in zip(_as_tuple(out), _as_tuple(ref_out), strict=True):
        assert rel_err(a, b) <= tol
    for a, b in zip(got_in, ref_in, strict=True):
        assert rel_err(a, b) <= tol
    grads = named_grads()
    # A gradient that is zero in exact arithmetic (attention's key bias: softmax ignores a shift) is
    # float rounding noise whose relative error means nothing, so each gradient is measured against
    # its own size but never below 1e-3 of the model's largest gradient.
    floor = 1e-3 * max(float(p.grad.abs().max()) for p in model.parameters() if p.grad is not None)
    for name, p in model.named_parameters():
        assert name in grads, f"no stage holds parameter {name}"
        err = float((grads[name].detach() - p.grad.detach()).abs().max())
        assert err <= tol * max(float(p.grad.abs().max()), floor), (name, err)


def split_model_of(model: torch.nn.Module, inputs: Sequence[Any], method: str, k: int,
                   assign: Callable[[torch.fx.GraphModule, int], None] = assign_even):
    """A SplitModel of a private copy of ``model`` (so ``model`` stays the reference)."""
    from fxpipe.split_model import SplitModel

    gm = capture(copy.deepcopy(model), inputs, method)
    assign(gm, k)
    return SplitModel.from_result(split_stages(gm, inputs), gm), gm


def stage_grads(sm: Any) -> Dict[str, torch.Tensor]:
    """Gradients of every stage parameter under its original name (tied: one object)."""
    out: Dict[str, torch.Tensor] = {}
    for j in range(sm.num_stages):
        for name, p in sm.stage_parameters(j).items():
            out.setdefault(name, p.grad)
    return out
