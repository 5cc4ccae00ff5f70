"""Tied and shared weights train exactly, through saved stage files, on every layout.

Models (``tests.models``): ``TiedLM``, one embedding table under three module
names (two lookups and the tied output head), and ``Reused``, one ``Linear``
called three times. Each layout cuts them so that the shared weight has all
its users in one stage, users in one stage plus another in a different stage,
one user per stage, or users on both sides of a replicated middle stage.

Every run goes the way ``fxpipe train`` goes: capture, split, save the stage
files, and every rank loads them (``SplitModel.load``). One process launch per
layout runs every model, schedule and optimizer in turn.

Checked, in float64, after 3 steps of 4 microbatches (``1f1b-stash``: 8
minibatches, each its own update): every parameter within 1e-9 of its change
(``|got - want| <= 1e-9 * |want - start|``, Frobenius norms) of

- ``1f1b-flush`` and ``gpipe``, SGD and AdamW, and ``zb-h1``, SGD (its split
  backward where one weight has several users in a stage): single-process
  training of the unsplit model on the mean microbatch loss of each step;
- ``1f1b-stash``, SGD: ``cases.pipedream_split``, the PipeDream reference
  (weight stashing, replicas averaging, tied copies summing their stages);
- ``2bw``, SGD with momentum and AdamW: ``cases.two_bw_model``, PipeDream-2BW
  on the unsplit model (each step's gradient computed on the weights before
  the previous update). The stash runs copy-free (out-of-place optimizer);
  ``1f1b-stash`` also runs once with ``weight_stash="copy"``.

Before ties survived the stage files, the weight tied inside one stage was
0.2 to 0.75 of its change away (one user's gradient was lost).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Sequence, Tuple

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fxpipe.layout import Layout
from fxpipe.runtime.loop import TrainConfig, train
from fxpipe.schedule import build_schedule
from tests.fxpipe.runtime import cases
from tests.fxpipe.runtime.harness import spawn
from tests.models import Reused, TiedLM

TOL = 1e-9  # of each parameter's change over the run
M, STEPS, LR = 4, 3, {"sgd": 0.1, "adamw": 0.01}
VOCAB, CTX = 16, 6


def _lm_data(g: int) -> Any:
    gen = torch.Generator().manual_seed(700 + g)
    idx = torch.randint(0, VOCAB, (2, CTX + 1), generator=gen)
    return (idx[:, :-1],), idx[:, 1:]


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def _reg_data(g: int) -> Any:
    gen = torch.Generator().manual_seed(900 + g)
    return (torch.randn(4, 6, generator=gen, dtype=torch.float64),), torch.randn(4, 4, generator=gen,
                                                                                 dtype=torch.float64)


@dataclass(frozen=True)
class Case:
    make: Callable[[], nn.Module]
    data: Callable[[int], Any]
    loss: Callable[..., torch.Tensor]
    cuts: Dict[Tuple[int, ...], Tuple[int, ...]]  # layout -> index of the first compute node of stages 1..
    shared: str  # the shared parameter's name
    holders: Dict[Tuple[int, ...], List[List[str]]]  # layout -> per stage, its local names of ``shared``


# compute nodes, in order: TiedLM  tok l1 tanh roll prev add l2 tanh_1 head
#                          Reused  inp tanh shared tanh_1 shared_1 tanh_2 mid tanh_3 shared_2 tanh_4 out
CASES = {
    "tiedlm": Case(lambda: TiedLM(VOCAB), _lm_data, _lm_loss,
                   {(1,): (), (2,): (), (1, 1): (5,), (1, 1, 1): (3, 8), (1, 2, 1): (5, 8)}, "tok.weight",
                   {(1,): [["tok.weight", "prev.weight", "head.weight"]],
                    (2,): [["tok.weight", "prev.weight", "head.weight"]],
                    (1, 1): [["tok.weight", "prev.weight"], ["head.weight"]],
                    (1, 1, 1): [["tok.weight"], ["prev.weight"], ["head.weight"]],
                    (1, 2, 1): [["tok.weight", "prev.weight"], [], ["head.weight"]]}),
    "reused": Case(Reused, _reg_data, F.mse_loss,
                   {(1,): (), (2,): (), (1, 1): (6,), (1, 1, 1): (4, 8), (1, 2, 1): (6, 8)}, "shared.weight",
                   {(1,): [["shared.weight"]], (2,): [["shared.weight"]],
                    (1, 1): [["shared.weight"], ["shared.weight"]],
                    (1, 1, 1): [["shared.weight"], ["shared.weight"], ["shared.weight"]],
                    (1, 2, 1): [["shared.weight"], [], ["shared.weight"]]}),
}
LAYOUTS = [(1,), (2,), (1, 1), (1, 1, 1), (1, 2, 1)]
RUNS = [(name, schedule, opt) for name in CASES for schedule, opts in
        (("1f1b-flush", ("sgd", "adamw")), ("gpipe", ("sgd", "adamw")), ("1f1b-stash", ("sgd", "sgd-copy")),
         ("zb-h1", ("sgd",)), ("2bw", ("sgd", "adamw"))) for opt in opts]
MOMENTUM = {"1f1b-stash": 0.0, "2bw": 0.9}  # momentum's state must survive the out-of-place update too


def _model(name: str) -> nn.Module:
    torch.manual_seed(0)
    return CASES[name].make().double()


def _save_split(name: str, layout: Tuple[int, ...], folder: str) -> Any:
    """Cut the model at the layout's cuts, save the stage files; return the in-memory split."""
    from fxpipe.split_model import SplitModel
    from passes.capture import capture
    from passes.partition import apply_assignment
    from passes.split import split_stages

    model, inputs = _model(name), CASES[name].data(0)[0]
    gm = capture(model, inputs)
    compute = [n.name for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")]
    cuts = CASES[name].cuts[layout]
    apply_assignment(gm, {n: sum(i >= c for c in cuts) for i, n in enumerate(compute)})
    split = SplitModel.from_result(split_stages(gm, inputs), gm)
    split.save(folder)
    return split


def _cfg(schedule: str, opt: str) -> Dict[str, Any]:
    name = opt.split("-")[0]
    return TrainConfig(log=False, schedule=schedule, microbatches=M, steps=STEPS if schedule != "1f1b-stash" else 2,
                       optimizer=name, lr=LR[name], momentum=MOMENTUM.get(schedule, 0.0),
                       weight_stash="copy" if opt.endswith("-copy") else "copy-free").to_json()


def _rank(rank: int, layout: Tuple[int, ...], folders: Dict[str, str], runs: Sequence[Tuple[str, str, str]]
          ) -> List[Dict[str, Any]]:
    """Every run of one launch, in turn, each from freshly loaded stage files."""
    from fxpipe.split_model import SplitModel

    out = []
    for name, schedule, opt in runs:
        split = SplitModel.load(folders[name])
        res = train(rank=rank, layout=Layout.of(layout), split=split, cfg=TrainConfig.from_json(_cfg(schedule, opt)),
                    data=CASES[name].data, loss_fn=CASES[name].loss)
        out.append({"stage": res.stage, "state": res.state})
    return out


def _reference(name: str, split: Any, layout: Tuple[int, ...], schedule: str, opt: str) -> Dict[str, torch.Tensor]:
    opt = opt.split("-")[0]
    if schedule == "1f1b-stash":
        lay = Layout.of(layout)
        tied_stages = sorted({s for st in split.tied.values() for s in st})
        acts = build_schedule(schedule, lay, 2 * M, split.links, tied_stages)
        return cases.pipedream_split(split, layout, cases.orders_of(acts, lay), LR[opt], CASES[name].data,
                                     CASES[name].loss)
    model = _model(name)
    if schedule == "2bw":
        cases.two_bw_model(model, CASES[name].data, CASES[name].loss, STEPS, M, opt, LR[opt], MOMENTUM["2bw"])
        return {k: p.detach() for k, p in model.named_parameters()}
    cases.accumulate_model(model, CASES[name].data, CASES[name].loss, STEPS, M, opt, LR[opt])
    return {k: p.detach() for k, p in model.named_parameters()}


def _check_ties(name: str, layout: Tuple[int, ...], folder: str) -> Any:
    """The loaded split holds the shared weight where the layout says, as ONE parameter per stage."""
    from fxpipe.split_model import SplitModel

    loaded = SplitModel.load(folder)
    want = CASES[name].holders[layout]
    for j, stage in enumerate(loaded.stages):
        names = sorted(n for n, o in loaded.param_names[j].items() if o == CASES[name].shared)
        assert names == sorted(want[j]), (j, names)
        assert len({id(stage.get_parameter(n)) for n in names}) <= 1, f"stage {j}: {names} are separate tensors"
        assert all(p.dtype == torch.float64 for p in stage.parameters())
        saved = torch.load(f"{folder}/stage_{j}.pt", weights_only=False)["state"]
        assert sum(n in saved for n in names) == min(1, len(names)), sorted(saved)  # stored once
    holders = [j for j, names in enumerate(want) if names]
    assert loaded.tied.get(CASES[name].shared, []) == (holders if len(holders) > 1 else [])
    return loaded


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: "-".join(map(str, l)))
def test_shared_weights_exact_through_stage_files(layout: Tuple[int, ...], tmp_path) -> None:
    splits, folders = {}, {}
    for name in CASES:
        folders[name] = str(tmp_path / name)
        splits[name] = _save_split(name, layout, folders[name])
        _check_ties(name, layout, folders[name])
    world = Layout.of(layout).world_size
    results = spawn(_rank, world, (layout, folders, RUNS), deadline=120.0).ok()
    for i, (name, schedule, opt) in enumerate(RUNS):
        got = cases.merge_states(splits[name].param_names, [r[i] for r in results])
        want = _reference(name, splits[name], layout, schedule, opt)
        start = dict(_model(name).named_parameters())
        assert set(got) == set(want), (sorted(got), sorted(want))
        for k in want:
            moved = (want[k] - start[k]).norm().item()
            assert moved > 1e-6, (name, schedule, opt, k, moved)
            err = (got[k] - want[k]).norm().item()
            assert err <= TOL * moved, (name, schedule, opt, k, err / moved)
