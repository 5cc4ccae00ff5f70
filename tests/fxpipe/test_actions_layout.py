import pytest

from fxpipe.actions import Action, Kind
from fxpipe.layout import Layout


@pytest.mark.parametrize("text", ["F3", "B0", "SEND_F2>r1", "RECV_B12<r3", "STEP", "STEP4", "ALLREDUCE"])
def test_action_prints_and_parses_back(text):
    assert str(Action.parse(text)) == text


def test_parse_rejects_garbage():
    with pytest.raises(ValueError, match="not an action"):
        Action.parse("forward 3")


def test_layout_round_robin_over_replicas():
    lay = Layout.of([2, 1, 3])
    assert lay.world_size == 6
    assert lay.ranks(0) == [0, 1] and lay.ranks(1) == [2] and lay.ranks(2) == [3, 4, 5]
    assert [lay.rank_for(0, m) for m in range(4)] == [0, 1, 0, 1]
    assert [lay.rank_for(2, m) for m in range(4)] == [3, 4, 5, 3]
    assert lay.stage_of(4) == 2 and lay.replica_of(4) == 1
    with pytest.raises(ValueError, match="rank 6"):
        lay.stage_of(6)
    assert Action(Kind.SEND_F, 1, 3).is_send
