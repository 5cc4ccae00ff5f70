"""Schedules as tables of expected actions, and the validator on good and broken lists."""
import pytest

from fxpipe.actions import Action, Kind
from fxpipe.layout import Layout
from fxpipe.schedule import SCHEDULES, Schedule, ScheduleError, build_schedule, in_flight, validate


def table(schedule):
    return {rank: " ".join(map(str, acts)) for rank, acts in schedule.items()}


def parse(text):
    return [Action.parse(t) for t in text.split()]


def test_flush_two_stages_three_microbatches():
    s = build_schedule("1f1b-flush", Layout.of([1, 1]), 3, [(0, 1)])
    assert table(s) == {
        0: "F0 SEND_F0>r1 RECV_B0<r1 F1 SEND_F1>r1 B0 RECV_B1<r1 F2 SEND_F2>r1 RECV_B2<r1 B1 B2 STEP",
        1: "RECV_F0<r0 F0 RECV_F1<r0 B0 SEND_B0>r0 F1 RECV_F2<r0 B1 SEND_B1>r0 F2 B2 SEND_B2>r0 STEP",
    }


def test_gpipe_all_forwards_then_all_backwards():
    s = build_schedule("gpipe", Layout.of([1, 1]), 2, [(0, 1)])
    assert table(s) == {
        0: "F0 SEND_F0>r1 RECV_B0<r1 F1 SEND_F1>r1 RECV_B1<r1 B0 B1 STEP",
        1: "RECV_F0<r0 RECV_F1<r0 F0 F1 B0 SEND_B0>r0 B1 SEND_B1>r0 STEP",
    }


def test_stash_steps_after_every_backward():
    s = build_schedule("1f1b-stash", Layout.of([1, 1]), 3, [(0, 1)])
    assert table(s)[0] == ("F0 SEND_F0>r1 RECV_B0<r1 F1 SEND_F1>r1 B0 STEP0 RECV_B1<r1 F2 SEND_F2>r1 "
                           "RECV_B2<r1 B1 STEP1 B2 STEP2")
    assert table(s)[1] == ("RECV_F0<r0 F0 RECV_F1<r0 B0 SEND_B0>r0 STEP0 F1 RECV_F2<r0 B1 SEND_B1>r0 STEP1 "
                           "F2 B2 SEND_B2>r0 STEP2")


def test_compute_order_four_stages_is_megatron_warmup():
    s = build_schedule("1f1b-flush", Layout.of([1, 1, 1, 1]), 6, [(0, 1), (1, 2), (2, 3)])
    compute = {r: " ".join(str(a) for a in acts if a.kind in (Kind.F, Kind.B)) for r, acts in s.items()}
    assert compute == {
        0: "F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5",
        1: "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 B4 B5",
        2: "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 B5",
        3: "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5",
    }


def test_replicated_input_stage_round_robin_and_allreduce():
    lay = Layout.of([2, 1])
    assert in_flight(lay, 0) == 2 and in_flight(lay, 1) == 1  # ceil(3/2), PipeDream's NOAM
    s = build_schedule("1f1b-flush", lay, 4, [(0, 1)])
    assert table(s) == {
        0: "F0 SEND_F0>r2 RECV_B0<r2 F2 SEND_F2>r2 RECV_B2<r2 B0 B2 ALLREDUCE STEP",
        1: "F1 SEND_F1>r2 RECV_B1<r2 F3 SEND_F3>r2 RECV_B3<r2 B1 B3 ALLREDUCE STEP",
        2: ("RECV_F0<r0 F0 RECV_F1<r1 B0 SEND_B0>r0 F1 RECV_F2<r0 B1 SEND_B1>r1 "
            "F2 RECV_F3<r1 B2 SEND_B2>r0 F3 B3 SEND_B3>r1 STEP"),
    }


def test_stash_replicated_stage_allreduces_every_backward():
    s = build_schedule("1f1b-stash", Layout.of([1, 2]), 2, [(0, 1)])
    assert table(s)[1] == "RECV_F0<r0 F0 B0 SEND_B0>r0 ALLREDUCE STEP0"
    assert table(s)[2] == "RECV_F1<r0 F1 B1 SEND_B1>r0 ALLREDUCE STEP1"
    assert table(s)[0] == "F0 SEND_F0>r1 RECV_B0<r1 F1 SEND_F1>r2 RECV_B1<r2 B0 STEP0 B1 STEP1"


def test_skip_link_goes_straight_to_the_far_stage():
    s = build_schedule("gpipe", Layout.of([1, 1, 1]), 1, [(0, 1), (1, 2), (0, 2)])
    assert table(s) == {
        0: "RECV_B0<r1 RECV_B0<r2 F0 SEND_F0>r1 SEND_F0>r2 B0 STEP",
        1: "RECV_F0<r0 RECV_B0<r2 F0 SEND_F0>r2 B0 SEND_B0>r0 STEP",
        2: "RECV_F0<r0 RECV_F0<r1 F0 B0 SEND_B0>r0 SEND_B0>r1 STEP",
    }


def test_tied_stages_allreduce_even_without_replicas():
    s = build_schedule("1f1b-flush", Layout.of([1, 1, 1]), 2, [(0, 1), (1, 2)], tied_stages=(0, 2))
    assert [str(a) for a in s[0][-2:]] == ["ALLREDUCE", "STEP"]
    assert [str(a) for a in s[1][-1:]] == ["STEP"] and Kind.ALLREDUCE not in {a.kind for a in s[1]}
    assert [str(a) for a in s[2][-2:]] == ["ALLREDUCE", "STEP"]


LAYOUTS = [(1,), (1, 1), (1, 1, 1, 1), (2, 1), (1, 2, 1), (3, 1), (2, 2), (1, 3), (2, 1, 2), (4, 2, 1), (1, 1, 1, 1, 1)]


def link_sets(S):
    chain = [(i, i + 1) for i in range(S - 1)]
    every = [(a, b) for a in range(S) for b in range(a + 1, S)]
    skip = chain + ([(0, S - 1)] if S > 2 else [])
    return [chain, skip, every]


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("replicas", LAYOUTS)
def test_every_builtin_schedule_validates(schedule, replicas):
    lay = Layout.of(replicas)
    checked = 0
    for M in (1, 2, 3, 4, 5, 8, 12):
        for links in link_sets(len(replicas)):
            for tied in ((), (0, len(replicas) - 1)):
                try:
                    s = build_schedule(schedule, lay, M, links, tied)
                except ScheduleError as exc:  # asked for something impossible: the message says why
                    assert any(w in str(exc) for w in ("microbatches", "minibatches", "tied weight"))
                    continue
                validate(s)
                n_f = sum(a.kind is Kind.F for acts in s.values() for a in acts)
                assert n_f == M * len(replicas)
                checked += 1
    assert checked > 0


def test_stash_with_unequal_replica_work_is_refused():
    with pytest.raises(ScheduleError, match="multiple of 2"):
        build_schedule("1f1b-stash", Layout.of([2, 1]), 3, [(0, 1)])


def test_stash_with_tied_stages_of_unequal_replicas_is_refused_naming_the_way_out():
    """No count of minibatches gives the ranks of a tied weight's stages equal all-reduces (HF GPT-2 on 4
    devices planned replicas [2, 1, 1] with its embedding tied to the head: the old message asked for
    a multiple of 2 minibatches, which 48 already was)."""
    links = [(0, 1), (1, 2)]
    with pytest.raises(ScheduleError, match=r"tied weight \(0, 2\) have \[2, 1\] replicas.*1f1b-flush"):
        build_schedule("1f1b-stash", Layout.of((2, 1, 1)), 48, links, tied_stages=[0, 2])
    build_schedule("1f1b-flush", Layout.of((2, 1, 1)), 48, links, tied_stages=[0, 2])
    build_schedule("1f1b-stash", Layout.of((2, 1, 2)), 48, links, tied_stages=[0, 2])


def test_bad_requests_are_refused():
    with pytest.raises(ScheduleError, match="unknown schedule"):
        build_schedule("zigzag", Layout.of([1, 1]), 2, [(0, 1)])
    with pytest.raises(ScheduleError, match="link"):
        build_schedule("gpipe", Layout.of([1, 1]), 2, [(1, 0)])
    with pytest.raises(ScheduleError, match="replicas"):
        build_schedule("gpipe", Layout.of([3, 1]), 2, [(0, 1)])


def test_validator_rejects_missing_recv_naming_rank_and_action():
    s = build_schedule("1f1b-flush", Layout.of([1, 1]), 2, [(0, 1)])
    broken = {0: s[0], 1: [a for a in s[1] if str(a) != "RECV_F1<r0"]}
    with pytest.raises(ScheduleError, match=r"rank 0: SEND_F1>r1 has no matching RECV_F1<r0 on rank 1") as err:
        validate(broken)
    assert err.value.rank == 0 and str(err.value.action) == "SEND_F1>r1"


def test_validator_rejects_recv_of_unsent_message():
    broken = {0: parse("F0 STEP"), 1: parse("RECV_F0<r0 F0 B0 STEP")}
    with pytest.raises(ScheduleError, match=r"rank 1: RECV_F0<r0 has no matching SEND_F0>r1 on rank 0"):
        validate(broken)


def test_validator_reports_deadlock_with_every_blocked_rank():
    # rank 0 needs a gradient before it sends the activation rank 1 needs
    broken = {0: parse("F0 RECV_B0<r1 B0 SEND_F0>r1 STEP"), 1: parse("RECV_F0<r0 F0 B0 SEND_B0>r0 STEP")}
    with pytest.raises(ScheduleError, match="deadlock") as err:
        validate(broken)
    msg = str(err.value)
    assert "rank 0: blocked at action #2 B0 (waits for SEND_B0>r0 on rank 1)" in msg
    assert "rank 1: blocked at action #1 F0 (waits for SEND_F0>r1 on rank 0)" in msg
    assert err.value.rank == 0


def test_a_posted_receive_does_not_block():
    # the receive is only posted: rank 0 goes on to send what rank 1 needs before it uses the gradient
    validate({0: parse("F0 RECV_B0<r1 SEND_F0>r1 B0 STEP"), 1: parse("RECV_F0<r0 F0 B0 SEND_B0>r0 STEP")})


def test_validator_rejects_a_receive_after_its_use():
    with pytest.raises(ScheduleError, match=r"rank 1: RECV_F0<r0 comes after F0, which needs it"):
        validate({0: parse("F0 SEND_F0>r1 RECV_B0<r1 B0 STEP"), 1: parse("F0 RECV_F0<r0 B0 SEND_B0>r0 STEP")})


def test_early_receives_keep_non_tensor_links_in_place():
    s = build_schedule("gpipe", Layout.of([1, 1]), 2, [(0, 1)], blocking_links=[(0, 1)])
    assert table(s)[1] == "RECV_F0<r0 F0 RECV_F1<r0 F1 B0 SEND_B0>r0 B1 SEND_B1>r0 STEP"
    assert table(s)[0] == "F0 SEND_F0>r1 F1 SEND_F1>r1 RECV_B0<r1 B0 RECV_B1<r1 B1 STEP"


def test_zb_h1_defers_weight_gradients_by_the_stage_lag():
    s = build_schedule("zb-h1", Layout.of([1, 1]), 4, [(0, 1)])
    compute = {r: " ".join(str(a) for a in acts if a.kind in (Kind.F, Kind.B, Kind.W)) for r, acts in s.items()}
    assert compute == {0: "F0 F1 B0 W0 F2 B1 W1 F3 B2 W2 B3 W3",  # lag 0: W right after its B
                       1: "F0 B0 F1 B1 W0 F2 B2 W1 F3 B3 W2 W3"}  # lag 1: the last stage returns gradients first
    assert table(s)[1].startswith("RECV_F0<r0 F0 RECV_F1<r0 B0 SEND_B0>r0 F1 B1 SEND_B1>r0 RECV_F2<r0 W0 F2")
    four = build_schedule("zb-h1", Layout.of([1, 1, 1, 1]), 6, [(0, 1), (1, 2), (2, 3)])
    w_after = {r: [a.mb for a in acts if a.kind is Kind.B].index(3) for r, acts in four.items()}
    lag = {r: sum(1 for a in acts[:next(i for i, a in enumerate(acts) if str(a) == "W0")] if a.kind is Kind.B) - 1
           for r, acts in four.items()}
    assert lag == {0: 0, 1: 1, 2: 2, 3: 3} and w_after == {0: 3, 1: 3, 2: 3, 3: 3}


def test_validator_rules_for_weight_gradients():
    with pytest.raises(ScheduleError, match=r"rank 0: W0 without a B0"):
        validate({0: parse("F0 W0 B0 STEP")})
    with pytest.raises(ScheduleError, match=r"rank 0: STEP while the weight gradients of microbatches \[1\]"):
        validate({0: parse("F0 F1 B0 W0 B1 STEP W1")})
    with pytest.raises(ScheduleError, match=r"rank 0: B of microbatches \[1\] has no W"):
        validate({0: parse("F0 F1 B0 W0 B1")})
    validate({0: parse("F0 F1 B0 B1 W0 W1 STEP")})


def test_validator_catches_swapped_order_in_a_built_schedule():
    s = build_schedule("1f1b-flush", Layout.of([1, 1, 1]), 3, [(0, 1), (1, 2)])
    acts = list(s[1])
    send = acts.pop(acts.index(Action.parse("SEND_F0>r2")))
    acts.insert(acts.index(Action.parse("B0")) + 1, send)  # wait for B0's gradient before shipping F0
    broken = Schedule(dict(s), layout=s.layout)
    broken[1] = acts
    with pytest.raises(ScheduleError, match=r"rank 1: blocked at action #\d+ B0 \(waits for SEND_B0>r1 on rank 2\)"):
        validate(broken)


def test_validator_allreduce_is_a_barrier_of_the_replicas():
    lay = Layout.of([2, 1])
    s = build_schedule("1f1b-flush", lay, 2, [(0, 1)])
    broken = Schedule({r: list(a) for r, a in s.items()}, layout=lay)
    broken[1] = [a for a in broken[1] if a.kind is not Kind.ALLREDUCE]
    with pytest.raises(ScheduleError, match=r"rank 0: blocked at action #\d+ ALLREDUCE \(barrier waits for ranks \[1\]\)"):
        validate(broken)
    validate({r: list(a) for r, a in broken.items()})  # without a layout ALLREDUCE is not checked


def test_validator_rejects_backward_before_forward():
    with pytest.raises(ScheduleError, match="rank 0: B1 comes before F1"):
        validate({0: parse("F0 B1 F1 B0 STEP")})


def test_validator_tied_stages_share_one_barrier():
    s = build_schedule("1f1b-flush", Layout.of([1, 1, 1]), 2, [(0, 1), (1, 2)], tied_stages=(0, 2))
    broken = Schedule({r: list(a) for r, a in s.items()}, layout=s.layout, tied_stages=(0, 2))
    broken[2] = [a for a in broken[2] if a.kind is not Kind.ALLREDUCE]
    with pytest.raises(ScheduleError, match=r"rank 0: blocked at action #\d+ ALLREDUCE \(barrier waits for ranks \[2\]\)"):
        validate(broken)


@pytest.mark.parametrize("schedule,extra", [("1f1b-stash", {}), ("2bw", {"steps": 5}), ("zb-h1", {}),
                                            ("1f1b-flush", {})])
def test_one_rank_built_alone_equals_its_list_in_the_whole(schedule, extra):
    """A worker builds only its own list (a stash or 2bw run without checkpoints is one list of every
    step's microbatches: 400,000 actions a rank for 10,000 steps of 8 on 4 stages)."""
    layout, links = Layout.of((2, 1, 1)), [(0, 1), (1, 2)]
    whole = build_schedule(schedule, layout, 24, links, tied_stages=[0, 2] if schedule != "1f1b-stash" else (),
                           **extra)
    for rank in range(layout.world_size):
        alone = build_schedule(schedule, layout, 24, links, tied_stages=[0, 2] if schedule != "1f1b-stash" else (),
                               ranks=(rank,), **extra)
        assert list(alone) == [rank] and alone[rank] == whole[rank]


def test_building_no_rank_still_refuses_what_the_layout_cannot_run():
    """The parent asks for no list, only the refusal (``launch.prepare``)."""
    links = [(0, 1), (1, 2)]
    with pytest.raises(ScheduleError, match="tied weight"):
        build_schedule("1f1b-stash", Layout.of((2, 1, 1)), 48, links, tied_stages=[0, 2], ranks=())
    with pytest.raises(ScheduleError, match="multiple of 2"):
        build_schedule("1f1b-stash", Layout.of([2, 1]), 3, [(0, 1)], ranks=())
    assert dict(build_schedule("1f1b-stash", Layout.of((2, 1, 2)), 48, links, tied_stages=[0, 2], ranks=())) == {}
