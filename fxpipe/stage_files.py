"""Save a ``SplitModel`` as readable Python files, and load it back.

A split folder holds, per stage ``j``: ``stage_j.py`` (an ``nn.Module`` whose
``forward`` is the stage graph's generated code, with its imports, including
``passes.comm``'s ``send``/``recv``) and ``stage_j.pt`` (its parameters and
buffers, under the stage's own names, plus any module that has no readable
constructor); and one ``split.json`` manifest (stage inputs, comm edges, the map
from stage names to the original model's names, tied parameters, the plan).

Loading imports each file, loads its weights, and re-traces the module into a
``GraphModule`` (modules kept as leaves, the comm calls kept as calls), the way
torch itself restores a pickled GraphModule. Tied parameters are re-tied: the
loaded stages share one ``Parameter`` as the split ones did, so ``run_local``
on a loaded model gives the same gradients. Inside one stage a tensor the model
registers under several names (GPT's ``lm_head.weight`` is ``tok.weight``) is
saved once, under its first name, and the generated ``__init__`` ties the
other names to it (``_tie`` lines): modules built from their constructors
would otherwise each get their own copy, and the gradient of all but one user
would be lost at the first optimizer step.
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

import torch
import torch.fx
import torch.nn as nn
from torch.fx.graph_module import _format_import_block
from torch.package import sys_importer
from torch.utils import _pytree as pytree

from passes import comm, meta
from passes.errors import FxpipeError
from passes.split import CommEdge

if TYPE_CHECKING:
    from fxpipe.split_model import SplitModel

FORMAT = "fxpipe-split/1"
# Modules whose repr is also a constructor call (checked again on save).
_READABLE = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d,
             nn.LayerNorm, nn.Embedding, nn.ReLU, nn.GELU, nn.Tanh, nn.Sigmoid, nn.Dropout, nn.Identity,
             nn.MaxPool2d, nn.AvgPool2d, nn.AdaptiveAvgPool2d, nn.Flatten, nn.SiLU, nn.Softmax)


class StageFileError(FxpipeError):
    """A split folder is incomplete, or a stage cannot be written as Python."""


def _readable_ctor(module: nn.Module) -> Optional[str]:
    if type(module) not in _READABLE:
        return None
    text = f"torch.nn.{type(module).__name__}({module.extra_repr()})"
    try:
        again = eval(text, {"torch": torch})  # noqa: S307 - our own repr of a torch.nn module
    except Exception:  # noqa: BLE001 - not a constructor after all: pickle it instead
        return None
    same = repr(again) == repr(module) and {k: v.shape for k, v in again.state_dict().items()} == {
        k: v.shape for k, v in module.state_dict().items()}
    return text if same else None


def _leaf_attrs(stage: torch.fx.GraphModule) -> List[Tuple[str, Any]]:
    """(dotted path, object) of every module called and attribute read by the graph."""
    out: Dict[str, Any] = {}
    for n in stage.graph.nodes:
        if n.op in ("call_module", "get_attr"):
            obj = stage
            for part in n.target.split("."):
                obj = getattr(obj, part)
            out[n.target] = obj
    return sorted(out.items())


def _init_lines(stage: torch.fx.GraphModule) -> Tuple[List[str], Dict[str, Any], Dict[str, Any]]:
    """``__init__`` body lines; modules to pickle; plain tensor constants."""
    lines, pickled, constants, made = [], {}, {}, {""}
    for path, obj in _leaf_attrs(stage):
        parts = path.split(".")
        for i in range(1, len(parts)):
            prefix = ".".join(parts[:i])
            if prefix not in made:
                lines.append(f"_setpath(self, {prefix!r}, torch.nn.Module())")
                made.add(prefix)
        parent = _owner(stage, parts[:-1])
        if isinstance(obj, nn.Module):
            ctor = _readable_ctor(obj)
            if ctor is None:
                pickled[path] = obj
                ctor = f"_modules[{path!r}]"
            lines.append(f"_setpath(self, {path!r}, {ctor})")
        elif isinstance(obj, nn.Parameter):
            lines.append(f"_setpath(self, {path!r}, torch.nn.Parameter(torch.empty({tuple(obj.shape)}, "
                         f"dtype={obj.dtype}), requires_grad={obj.requires_grad}))")
        elif isinstance(obj, torch.Tensor) and parts[-1] in parent._buffers:
            lines.append(f"_owner(self, {path!r}).register_buffer({parts[-1]!r}, "
                         f"torch.empty({tuple(obj.shape)}, dtype={obj.dtype}))")
        else:
            constants[path] = obj
            lines.append(f"_setpath(self, {path!r}, _constants[{path!r}])")
        made.add(path)
    return lines, pickled, constants


def _ties(stage: nn.Module) -> List[Tuple[str, str]]:
    """(alias, first name) of every tensor the stage holds under more than one name.

    The first name is the one ``named_parameters()`` / ``named_buffers()`` keep,
    the name the weights file stores the tensor under.
    """
    first: Dict[int, str] = {}
    out = []
    for name, t in _named_tensors(stage, remove_duplicate=False):
        owner = first.setdefault(id(t), name)
        if owner != name:
            out.append((name, owner))
    return out


def _named_tensors(stage: nn.Module, remove_duplicate: bool) -> List[Tuple[str, torch.Tensor]]:
    return (list(stage.named_parameters(remove_duplicate=remove_duplicate))
            + list(stage.named_buffers(remove_duplicate=remove_duplicate)))


def _owner(root: nn.Module, parts: List[str]) -> nn.Module:
    for p in parts:
        root = getattr(root, p)
    return root


_HELPERS = '''

def _owner(root, path):
    for part in path.split(".")[:-1]:
        root = getattr(root, part)
    return root


def _setpath(root, path, value):
    setattr(_owner(root, path), path.split(".")[-1], value)


def _tie(root, alias, name):
    """Make ``alias`` the very tensor ``name`` is (weights shared in the model stay one tensor)."""
    _setpath(root, alias, getattr(_owner(root, name), name.split(".")[-1]))
'''


def _imports(names: Dict[str, Any]) -> str:
    """Import lines for the globals of generated code (annotations kept as strings)."""
    text = {k: v for k, v in names.items() if isinstance(v, str)}
    block = _format_import_block({k: v for k, v in names.items() if k not in text}, sys_importer)
    return block + "".join(f"\n{k} = {v!r}" for k, v in sorted(text.items()))


def stage_source(split: "SplitModel", j: int, weights_name: str) -> Tuple[str, Dict[str, Any], Dict[str, Any]]:
    """The Python text of stage ``j``; the modules and constants it loads from the weights file."""
    stage = split.stages[j]
    code = stage.graph.python_code(root_module="self")
    lines, pickled, constants = _init_lines(stage)
    lines += [f"_tie(self, {alias!r}, {name!r})  # one tensor, shared in the model" for alias, name in _ties(stage)]
    recvs = sorted({f"{e.tag}" for e in split.comm if e.dst_stage == j})
    sends = sorted({f"{e.tag}" for e in split.comm if e.src_stage == j})
    inputs = ", ".join(split.input_names[i] for i in split.stage_inputs[j]) or "none"
    doc = (f'"""fxpipe pipeline stage {j} of {split.num_stages} (generated by fxpipe split; readable, loadable).\n\n'
           f"Model inputs: {inputs}.\nReceives: {', '.join(recvs) or 'nothing'}.\n"
           f"Sends: {', '.join(sends) or 'nothing'}.\n"
           "Returns (outputs, tokens): the model outputs on the last stage (None elsewhere) and what the sends\n"
           "returned. Run it with fxpipe.run_local / the fxpipe runtime (they bind passes.comm's transport);\n"
           'load the whole split with fxpipe.SplitModel.load(folder).\n"""\n')
    body = "\n".join(f"        {line}" for line in lines) or "        pass"
    at = code.src.index("def forward")
    prologue = code.src[:at].strip()  # fx's module-level lines, e.g. wrap("math_sqrt")
    forward = "\n".join("    " + line if line.strip() else "" for line in code.src[at:].strip("\n").splitlines())
    src = (f"{doc}{_imports(code.globals)}\n{prologue}\n{_HELPERS}\n\n"
           f"class Stage{j}(torch.nn.Module):\n"
           f"    def __init__(self, _modules=None, _constants=None):\n        super().__init__()\n{body}\n\n"
           f"{forward}\n\n\n"
           f"def build(weights_path={weights_name!r}):\n"
           f'    """Stage {j} with its saved weights (a path relative to this file\'s folder)."""\n'
           "    import os\n"
           "    blob = torch.load(os.path.join(os.path.dirname(os.path.abspath(__file__)), weights_path),\n"
           "                      weights_only=False)\n"
           f"    stage = Stage{j}(blob['modules'], blob['constants'])\n"
           "    with torch.no_grad():\n"
           "        for name, value in blob['state'].items():\n"
           "            target = getattr(_owner(stage, name), name.split('.')[-1])\n"
           "            if target.dtype != value.dtype:  # constructors build float32; keep the saved dtype\n"
           "                target.data = target.data.to(value.dtype)\n"
           "            target.copy_(value)\n"
           "    return stage\n")
    return src, pickled, constants


def _spec_to_json(spec: Any) -> Any:
    if isinstance(spec, meta.TensorMeta):
        return {"tensor": list(spec.shape), "dtype": spec.dtype, "requires_grad": spec.requires_grad}
    if isinstance(spec, torch.Size):
        return {"size": list(spec)}
    if isinstance(spec, (int, float, bool, str)) or spec is None:
        return spec
    return repr(spec)


def _spec_from_json(d: Any) -> Any:
    if isinstance(d, dict) and "tensor" in d:
        return meta.TensorMeta(tuple(d["tensor"]), d["dtype"], bool(d["requires_grad"]))
    if isinstance(d, dict) and "size" in d:
        return torch.Size(d["size"])
    return d


def _jsonable(x: Any) -> bool:
    try:
        json.dumps(x)
        return True
    except TypeError:
        return False


def _state(stage: torch.fx.GraphModule) -> Dict[str, torch.Tensor]:
    """Each tensor once, under its first name: the stage file's ``_tie`` lines give it the others."""
    return {name: t.detach() for name, t in _named_tensors(stage, remove_duplicate=True)}


def save_split(split: "SplitModel", folder: Path) -> Path:
    """Write ``split`` to ``folder`` (created); return the manifest's path."""
    folder.mkdir(parents=True, exist_ok=True)
    entries = []
    for j, stage in enumerate(split.stages):
        file, weights = f"stage_{j}.py", f"stage_{j}.pt"
        src, pickled, constants = stage_source(split, j, weights)
        (folder / file).write_text(src)
        torch.save({"state": _state(stage), "modules": pickled, "constants": constants}, folder / weights)
        entries.append({"file": file, "class": f"Stage{j}", "weights": weights, "inputs": split.stage_inputs[j]})
    manifest = {
        "format": FORMAT,
        "num_stages": split.num_stages,
        "stages": entries,
        "input_names": split.input_names,
        "input_defaults": {k: v for k, v in split.input_defaults.items() if _jsonable(v)},
        "comm": [{"tag": e.tag, "src": e.src_stage, "dst": e.dst_stage, "value": _spec_to_json(e.value.spec)}
                 for e in split.comm],
        "param_names": split.param_names,
        "tied": split.tied,
        "aliases": split.aliases,
        "state_keys": split.state_keys,
        "in_spec": pytree.treespec_dumps(split.in_spec) if split.in_spec is not None else None,
        "out_spec": pytree.treespec_dumps(split.out_spec) if split.out_spec is not None else None,
        "plan": split.plan.to_json() if hasattr(split.plan, "to_json") else None,
    }
    path = folder / "split.json"
    path.write_text(json.dumps(manifest, indent=1))
    return path


class _StageTracer(torch.fx.Tracer):
    """Re-traces a saved stage: every module stays a call, comm calls stay calls.

    Buffers read by attribute become graph values (``proxy_buffer_attributes``):
    an exported graph updates them in place (BatchNorm's ``num_batches_tracked
    += 1``, with no proxy among its arguments), which a plain trace would run
    once while tracing and leave out of the graph, with the buffer itself.
    """

    proxy_buffer_attributes = True

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return True


class _TracingTransport:
    """Bound while re-tracing: each comm call becomes a graph node again."""

    def __init__(self, tracer: torch.fx.Tracer) -> None:
        self.tracer = tracer

    def send(self, tag: str, value: Any, dst: int) -> Any:
        return self.tracer.create_proxy("call_function", comm.send, (value, tag, dst), {}, name=f"send_{_stem(tag)}")

    def recv(self, tag: str, src: int, shape: Any, dtype: Any, requires_grad: bool) -> Any:
        kwargs = {} if shape is None and dtype is None else {"shape": shape, "dtype": dtype,
                                                             "requires_grad": requires_grad}
        return self.tracer.create_proxy("call_function", comm.recv, (tag, src), kwargs, name=_stem(tag))


def _stem(tag: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in tag.split(":")[0]).strip("_")


def _import_file(path: Path, name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise StageFileError(f"cannot import stage file {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_stage(path: Path, j: int) -> torch.fx.GraphModule:
    """Stage ``j``'s file (and weights beside it) as a GraphModule."""
    module = _import_file(path, f"fxpipe_stage_{j}_{abs(hash(str(path.resolve())))}").build()
    tracer = _StageTracer()
    with comm.bind(_TracingTransport(tracer)):
        graph = tracer.trace(module)
    return torch.fx.GraphModule(module, graph, class_name=f"Stage{j}")


def _annotate(stages: List[torch.fx.GraphModule], edges: List[CommEdge]) -> None:
    by_tag = {e.tag: e for e in edges}
    for stage in stages:
        for n in stage.graph.nodes:
            direction = "recv" if n.target is comm.recv else "send" if n.target is comm.send else None
            tag = (n.args[0] if direction == "recv" else n.args[1]) if direction else None
            if tag in by_tag:
                e = by_tag[tag]
                meta.put(n, meta.CommInfo(direction, e.tag, e.src_stage, e.dst_stage, e.value))


def _retie(stages: List[torch.fx.GraphModule], names: List[Dict[str, str]], tied: Dict[str, List[int]]) -> None:
    """One object per original tensor again, as in the split that was saved.

    Inside a stage every name of one original tensor gets the same object
    (the stage file ties them already; folders written before it did load
    right too); across stages, every holder of a tied parameter shares it.
    """
    where: Dict[str, List[Tuple[int, str]]] = {}
    for j, local_names in enumerate(names):
        for local, canon in local_names.items():
            where.setdefault(canon, []).append((j, local))
    for canon, places in where.items():
        shared: Dict[int, Any] = {}
        for j, local in places:
            key = -1 if canon in tied else j  # -1: one object for all the stages holding it
            *parents, leaf = local.split(".")
            owner = _owner(stages[j], parents)
            if key not in shared:
                shared[key] = getattr(owner, leaf)
            elif getattr(owner, leaf) is not shared[key]:
                setattr(owner, leaf, shared[key])


def load_split_args(folder: Path) -> Dict[str, Any]:
    """``SplitModel``'s constructor arguments for the split saved in ``folder`` by ``save_split``.

    ``SplitModel.load`` builds the model from them, so this module (serialisation) does not
    import the class it serialises.
    """
    path = folder / "split.json"
    if not path.exists():
        raise StageFileError(f"{path} not found: is {folder} a folder written by `fxpipe split` / SplitModel.save?")
    m = json.loads(path.read_text())
    if m.get("format") != FORMAT:
        raise StageFileError(f"{path}: format {m.get('format')!r}, this fxpipe reads {FORMAT!r}")
    stages = [load_stage(folder / e["file"], j) for j, e in enumerate(m["stages"])]
    edges = [CommEdge(c["tag"], c["src"], c["dst"], meta.ValueMeta(_spec_from_json(c["value"]))) for c in m["comm"]]
    _annotate(stages, edges)
    _retie(stages, m["param_names"], m["tied"])
    plan = None
    if m.get("plan") is not None:
        from fxpipe.plan import Plan

        plan = Plan.from_json(m["plan"])
    specs = [pytree.treespec_loads(s) if s else None for s in (m["in_spec"], m["out_spec"])]
    return dict(stages=stages, stage_inputs=[e["inputs"] for e in m["stages"]], comm=edges,
                param_names=m["param_names"], tied={k: list(v) for k, v in m["tied"].items()}, plan=plan,
                aliases=m["aliases"], input_names=m["input_names"], input_defaults=m["input_defaults"],
                in_spec=specs[0], out_spec=specs[1], state_keys=m.get("state_keys"))
