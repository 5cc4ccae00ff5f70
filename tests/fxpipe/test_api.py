"""fxpipe.split: capture -> profile -> partition -> split, equal to the model it came from."""
import copy

import pytest

import fxpipe
from tests.models import example
from tests.splitting import check_equivalent, stage_grads


@pytest.mark.parametrize("name", ["TinyGPT", "SkipCNN"])
def test_split_runs_like_the_model(name):
    model, inputs = example(name)
    ref = copy.deepcopy(model)
    sm = fxpipe.split(model, inputs, devices=3, replication="none", time_limit=5, progress=False)
    assert sm.num_stages == 3 and sm.plan.num_stages == 3
    assert [s.nodes for s in sm.plan.stages]  # the plan's node lists are what was split
    assert all(p.grad is None for p in model.parameters())  # profiling left no gradients behind
    check_equivalent(ref, lambda *x: fxpipe.run_local(sm, *x), lambda: stage_grads(sm), inputs)
    if name == "TinyGPT":
        assert sm.tied == {"tok.weight": [0, 2]}


def test_replicated_stage_is_still_one_stage_module():
    model, inputs = example("MLP")
    ref = copy.deepcopy(model)
    sm = fxpipe.split(model, inputs[0], devices=3, time_limit=5, progress=False, fewer_devices=False)
    assert len(sm.stages) == sm.plan.num_stages == len(sm.plan.stages)
    assert sum(s.replicas for s in sm.plan.stages) == 3
    check_equivalent(ref, lambda *x: fxpipe.run_local(sm, *x), lambda: stage_grads(sm), inputs)


def test_public_names_load_lazily():
    """Checked in a fresh interpreter: popping fxpipe from this process's
    sys.modules would leave later tests with two copies of every class."""
    import subprocess
    import sys

    code = (
        "import sys, importlib\n"
        "fx = importlib.import_module('fxpipe')\n"
        "assert 'fxpipe.api' not in sys.modules, 'fxpipe.api imported eagerly'\n"
        "assert fx.split.__module__ == 'fxpipe.api' and fx.SplitModel.__name__ == 'SplitModel'\n"
        "assert callable(fx.run_local)\n"
        "try:\n"
        "    fx.no_such_name\n"
        "except AttributeError:\n"
        "    print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_every_planner_option_split_documents_is_one_partition_takes():
    import dataclasses
    import inspect
    import re

    from fxpipe.api import split
    from passes.partition import CostOptions, partition

    listed = split.__doc__.split("``plan_options`` are the partitioner's (")[1].split(")")[0]
    names = set(re.findall(r"``(\w+)``", listed))
    taken = set(inspect.signature(partition).parameters) | {f.name for f in dataclasses.fields(CostOptions)}
    assert len(names) >= 10 and names <= taken, names - taken
