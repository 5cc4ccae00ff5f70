"""Runtime pieces without processes: weight stash, data cutting, trace merging, wiring checks."""
from __future__ import annotations

import json
import os
import time

import pytest
import torch
import torch.nn as nn

from fxpipe.runtime.data import DataError, FromBatches
from fxpipe.runtime.stash import WeightStash
from fxpipe.runtime.trace import Tracer, merge, rank_path
from fxpipe.runtime.transport import TransportError, wires_of
from passes.meta import TensorMeta, ValueMeta
from tests.fxpipe.runtime.fakes import Edge


class _Lin(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor([[2.0]]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w


def test_stash_backward_uses_the_weights_its_forward_saw() -> None:
    m = _Lin()
    stash = WeightStash(m, stash=True)
    x0 = torch.tensor([[1.0]], requires_grad=True)
    y0 = stash.forward(0, (x0,))
    with torch.no_grad():
        m.w.sub_(5.0)  # the optimizer moves the master: w = -3
    stash.stepped()
    x1 = torch.tensor([[1.0]], requires_grad=True)
    y1 = stash.forward(1, (x1,))
    assert stash.versions_kept == 2
    y0.sum().backward()
    stash.backward_done(0)
    assert x0.grad.item() == 2.0  # d(x w)/dx with the stashed w = 2, not the current -3
    assert m.w.grad.item() == 1.0
    assert stash.versions_kept == 1
    y1.sum().backward()
    stash.backward_done(1)
    assert m.w.grad.item() == 1.0  # version 1 is still needed: its gradient waits on it ...
    stash.gather_grads()  # ... until the update asks for them
    assert x1.grad.item() == -3.0 and m.w.grad.item() == 2.0  # gradients accumulate on the master
    assert m.w.item() == -3.0  # the master itself was never swapped


def test_microbatches_on_one_version_reach_the_master_as_one_sum() -> None:
    """2bw's batch: several backwards on one version sum in its ``.grad``; the master gets that sum
    at ``gather_grads``, added to what it already holds."""
    m = _Lin()
    stash = WeightStash(m, stash=True, copy_free=True)
    outs = [stash.forward(g, (torch.tensor([[float(g + 1)]]),)) for g in range(3)]  # all on version 0
    m.w.grad = torch.tensor([[10.0]])
    for g, y in enumerate(outs):
        y.sum().backward()
        stash.backward_done(g)
    assert m.w.grad.item() == 10.0  # still on the version
    stash.gather_grads()
    assert m.w.grad.item() == 16.0 and stash.versions_kept == 1  # 10 + (1 + 2 + 3); version 0 is current


def test_no_stash_runs_the_module_itself() -> None:
    m = _Lin()
    stash = WeightStash(m, stash=False)
    stash.forward(0, (torch.ones(1, 1),)).sum().backward()
    stash.backward_done(0)
    assert m.w.grad.item() == 1.0 and stash.versions_kept == 0


def _stream(n: int):
    def batches():
        for i in range(3):
            yield (torch.full((n, 2), float(i)),), torch.full((n,), float(i))
    return batches


def test_from_batches_cuts_steps_into_microbatches_and_restarts() -> None:
    src = FromBatches(_stream(8), micro_size=2, microbatches=4)
    assert [src(g)[1][0].item() for g in range(0, 14)] == [0] * 4 + [1] * 4 + [2] * 4 + [0] * 2
    assert src(1)[0][0].shape == (2, 2)  # going back (resume) replays the stream
    assert FromBatches(_stream(2), micro_size=2, microbatches=4)(5)[1][0].item() == 2.0
    with pytest.raises(DataError, match="one microbatch"):
        FromBatches(_stream(3), micro_size=2, microbatches=4)(0)


def test_trace_merge(tmp_path) -> None:
    out = str(tmp_path / "t.json")
    for r in range(2):
        t = Tracer(r)
        with t.span("F0", mb=0):
            pass
        with t.span("SEND_F0>r1", "comm"):
            pass
        t.save(rank_path(out, r))
    assert merge([rank_path(out, r) for r in range(2)], out) > 4
    events = [e for e in json.load(open(out))["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in events} == {0, 1} and min(e["ts"] for e in events) == 0
    assert {e["tid"] for e in events if e["name"].startswith("SEND")} == {1}


def test_trace_events_carry_the_threads_cpu_time() -> None:
    """Busy work shows CPU time close to its wall time; sleeping shows wall time and next to no CPU."""
    t = Tracer(0)
    with t.span("F0"):
        end = time.perf_counter() + 0.03
        while time.perf_counter() < end:
            pass
    with t.span("wait x", "wait"):
        time.sleep(0.03)
    busy, slept = t.events
    assert 0 < busy["args"]["cpu_us"] <= busy["dur"] * 1.05 + 50
    assert busy["args"]["cpu_us"] > 0.3 * busy["dur"]  # a spin loop: most of it on a core even on a loaded machine
    assert slept["dur"] >= 29000 and slept["args"]["cpu_us"] < 0.3 * slept["dur"]


def test_duplicate_tags_are_rejected() -> None:
    v = ValueMeta(TensorMeta((2,), "torch.float32", True))
    with pytest.raises(TransportError, match="used by two edges"):
        wires_of([Edge("a", 0, 1, v), Edge("a", 0, 2, v)])


def test_a_peer_gone_before_posting_is_a_transport_error_naming_it(monkeypatch) -> None:
    """gloo raises from isend/irecv itself when the peer's connection already closed."""
    import torch.distributed as dist

    from fxpipe.runtime.transport import P2P, peer_guard
    from passes.comm import MailboxTransport

    def closed(*args, **kwargs):
        raise RuntimeError("Connection closed by peer")

    monkeypatch.setattr(dist, "isend", closed)
    monkeypatch.setattr(dist, "irecv", closed)
    v = ValueMeta(TensorMeta((2,), "torch.float32", True))
    p2p = P2P(wires_of([Edge("a", 0, 1, v)]), torch.device("cpu"), timeout_s=1.0, threaded=False)
    box = MailboxTransport()
    box.outbox["a"] = torch.ones(2)
    with pytest.raises(TransportError, match=r"lost rank 1 .*Connection closed by peer"):
        p2p.send_forward(box, 0, 0, 1, peer=1)
    with pytest.raises(TransportError, match=r"lost rank 0 "):
        p2p.recv_forward(MailboxTransport(), 0, 1, 0, peer=0)
    # through the poster thread (the CPU default) the same error comes out of the wait, naming the peer too
    threaded = P2P(wires_of([Edge("a", 0, 1, v)]), torch.device("cpu"), timeout_s=1.0)
    box.outbox["a"] = torch.ones(2)
    threaded.send_forward(box, 0, 0, 1, peer=1)
    with pytest.raises(TransportError, match=r"a send of microbatch 0: lost rank 1 .*Connection closed by peer"):
        threaded.wait_sends()
    threaded.recv_forward(MailboxTransport(), 0, 1, 0, peer=0)
    with pytest.raises(TransportError, match=r"RECV_F0: lost rank 0 .*Connection closed by peer"):
        threaded.complete(0, "F")
    with pytest.raises(TransportError, match="all-reduce of gradients: lost a peer"):
        with peer_guard("all-reduce of gradients"):
            closed()


def test_recompute_is_checked_in_the_callers_process_and_combines_with_every_schedule() -> None:
    from fxpipe.runtime.loop import TrainConfig
    from passes.errors import FxpipeError

    for schedule in ("1f1b-flush", "1f1b-stash", "gpipe", "zb-h1", "2bw"):
        assert TrainConfig(schedule=schedule, recompute="all").recompute == "all"
    with pytest.raises(FxpipeError, match="--recompute 'some' is not one of"):
        TrainConfig(schedule="zb-h1", recompute="some")


def test_long_trace_is_written_as_it_grows_and_merged_line_by_line(tmp_path, monkeypatch) -> None:
    """A tracer given its file keeps at most ``SPILL_EVENTS`` events in memory; the saved file and the
    merge hold every event, in order, as JSON that Perfetto and ``fxpipe show --trace`` read."""
    from fxpipe.runtime import trace

    monkeypatch.setattr(trace, "SPILL_EVENTS", 3)
    out = str(tmp_path / "t.json")
    held = []
    for r in range(2):
        t = Tracer(r, spill=rank_path(out, r))
        for m in range(10):
            with t.span(f"F{m}", mb=m):
                pass
            held.append(len(t.events))
        t.save(rank_path(out, r))
        assert t.written == 10 and not t.events
        part = json.load(open(rank_path(out, r)))["traceEvents"]
        assert [e["name"] for e in part if e["ph"] == "X"] == [f"F{m}" for m in range(10)]
    assert max(held) < 3
    assert merge([rank_path(out, r) for r in range(2)], out) == 2 * (10 + 4)  # and each rank's 4 names
    events = [e for e in json.load(open(out))["traceEvents"] if e["ph"] == "X"]
    assert len(events) == 20 and min(e["ts"] for e in events) == 0
    assert not any(os.path.exists(rank_path(out, r)) for r in range(2))


def test_trace_of_a_failed_run_merges_a_file_cut_mid_event(tmp_path, monkeypatch) -> None:
    """A rank killed while writing leaves its file without an end and maybe half an event: after a failure
    the merge keeps every whole event; a finished run's merge still refuses a broken file."""
    from fxpipe.runtime import trace

    monkeypatch.setattr(trace, "SPILL_EVENTS", 2)
    out = str(tmp_path / "t.json")
    for r in range(2):
        t = Tracer(r, spill=rank_path(out, r))
        for m in range(5):
            with t.span(f"F{m}", mb=m):
                pass
        if r == 0:
            t.save(rank_path(out, r))
            t.save(rank_path(out, r))  # a second save (a failure after the first) leaves the file whole
        else:
            t._out.flush()  # rank 1 "killed" after writing 4 events: no end, the 4th cut in half
            text = open(rank_path(out, 1)).read()
            open(rank_path(out, 1), "w").write(text[:-20])
    with pytest.raises(json.JSONDecodeError):
        merge([rank_path(out, r) for r in range(2)], out, remove=False)
    merge([rank_path(out, r) for r in range(2)], out, partial=True)
    events = [e for e in json.load(open(out))["traceEvents"] if e["ph"] == "X"]
    assert [e["name"] for e in events if e["pid"] == 0] == [f"F{m}" for m in range(5)]
    assert [e["name"] for e in events if e["pid"] == 1] == ["F0", "F1", "F2"]
