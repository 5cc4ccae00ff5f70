"""``SplitModel``: the stages of a model, how they connect, and where weights came from.

It is what ``fxpipe.split`` returns and what the runtime executes: stage ``j``
is a ``torch.fx.GraphModule`` called as
``stage(*[inputs[i] for i in stage_inputs[j]])`` that returns
``(outputs, tokens)`` (see ``passes.comm``). In-process, the stages share
parameter objects with the model they were split from (a tied parameter is one
object held by several stages), so gradients of ``run_local`` land on the
original model's parameters too.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.fx
from torch.fx import _pytree as fx_pytree
from torch.utils import _pytree as pytree

from fxpipe.stage_files import load_split_args, save_split
from passes import meta
from passes.errors import FxpipeError
from passes.split import CommEdge, SplitResult

__all__ = ["CommEdge", "SplitModel"]


class SplitModel:
    """One GraphModule per pipeline stage plus the wiring between them."""

    def __init__(self, stages: List[torch.fx.GraphModule], stage_inputs: List[List[int]],
                 comm: List[CommEdge], param_names: List[Dict[str, str]], tied: Dict[str, List[int]],
                 *, plan: Any = None, aliases: Optional[Dict[str, str]] = None,
                 input_names: Sequence[str] = (), input_defaults: Optional[Dict[str, Any]] = None,
                 in_spec: Any = None, out_spec: Any = None, profile: Any = None,
                 state_keys: Optional[Sequence[str]] = None) -> None:
        self.plan = plan
        self.profile = profile  # the profiled CostGraph when fxpipe.split made it (not saved: profile.json)
        self.stages = stages
        self.stage_inputs = stage_inputs
        self.comm = comm
        self.param_names = param_names
        self.tied = tied
        self.aliases = dict(aliases or {})
        self.state_keys = list(state_keys) if state_keys else None  # the original model's state_dict keys
        self.input_names = list(input_names)
        self.input_defaults = dict(input_defaults or {})
        self.in_spec = in_spec
        self.out_spec = out_spec

    @classmethod
    def from_result(cls, result: SplitResult, gm: torch.fx.GraphModule, plan: Any = None) -> "SplitModel":
        """Wrap ``passes.split.split_stages``'s result for the graph ``gm`` it split."""
        holders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        defaults = {p.name: p.args[0] for p in holders if p.args}
        captured = meta.get(gm, meta.CaptureInfo, None)
        return cls(result.stages, result.stage_inputs, result.comm, result.param_names, result.tied,
                   plan=plan, aliases=result.aliases, input_names=[p.name for p in holders],
                   input_defaults=defaults, in_spec=result.in_spec, out_spec=result.out_spec,
                   state_keys=captured.state_keys if captured is not None else None)

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def links(self) -> List[Tuple[int, int]]:
        """Sorted (src, dst) stage pairs that exchange at least one value."""
        return sorted({(e.src_stage, e.dst_stage) for e in self.comm})

    def flatten_inputs(self, inputs: Sequence[Any], kwargs: Optional[Dict[str, Any]] = None) -> List[Any]:
        """The original model's call arguments as the flat list the stages index."""
        kwargs = dict(kwargs or {})
        flat = list(inputs)
        if self.in_spec is not None:
            if kwargs and self.in_spec.child(1).num_leaves == 0:  # the capture took them by position
                flat += [kwargs.pop(name) for name in self.input_names[len(flat):] if name in kwargs]
            return list(fx_pytree.tree_flatten_spec((flat, kwargs), self.in_spec))
        for name in self.input_names[len(flat):]:
            if name in kwargs:
                flat.append(kwargs.pop(name))
            elif name in self.input_defaults:
                flat.append(self.input_defaults[name])
            else:
                raise FxpipeError(f"missing model input '{name}' (the model takes {self.input_names})")
        if kwargs or len(flat) > len(self.input_names) and self.input_names:
            raise FxpipeError(f"unexpected model inputs: the model takes {self.input_names}")
        return flat

    def unflatten_outputs(self, outputs: Any) -> Any:
        """The last stage's outputs in the original model's structure."""
        if self.out_spec is not None:
            return pytree.tree_unflatten(list(outputs), self.out_spec)
        return outputs

    def stage_parameters(self, j: int) -> Dict[str, torch.nn.Parameter]:
        """Stage ``j``'s parameters under their names in the original model."""
        return {self.param_names[j].get(n, n): p for n, p in self.stages[j].named_parameters()}

    def original_state_dict(self, stage_state_dicts: List[Dict[str, Any]]) -> Dict[str, Any]:
        """Merge per-stage state dicts back under the original model's names.

        A tied tensor is taken from the first stage holding it (copies agree
        once the runtime has synchronised them); every alias name gets it too,
        so ``model.load_state_dict`` accepts the result. When the capture
        recorded the model's own keys, the result holds exactly those, in the
        model's order: tensors the trace introduced (``_tensor_constant0``)
        are left out, and a key of the model that no stage holds is an error.
        """
        out: Dict[str, Any] = {}
        for names, sd in zip(self.param_names, stage_state_dicts):
            for local, value in sd.items():
                out.setdefault(names.get(local, local), value)
        for alias, canon in self.aliases.items():
            if canon in out:
                out[alias] = out[canon]
        if self.state_keys is None:
            return out
        missing = [k for k in self.state_keys if k not in out]
        if missing:
            raise FxpipeError(f"the stages hold no tensor for {len(missing)} of the model's state_dict keys "
                              f"({', '.join(missing[:5])}{', ...' if len(missing) > 5 else ''}); "
                              "was the split made from a different model?")
        return {k: out[k] for k in self.state_keys}

    def save(self, folder: Union[str, Path]) -> Path:
        """Write one Python file per stage, its weights, and ``split.json``."""
        return save_split(self, Path(folder))

    @classmethod
    def load(cls, folder: Union[str, Path]) -> "SplitModel":
        """A SplitModel from ``save``'s folder, running as the saved one did."""
        return cls(**load_split_args(Path(folder)))

    def __repr__(self) -> str:
        return f"SplitModel(stages={self.num_stages}, links={self.links}, tied={sorted(self.tied)})"
