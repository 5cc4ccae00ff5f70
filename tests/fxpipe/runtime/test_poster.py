"""The poster thread: posts run in order, errors come out of the handle, and it stops before teardown."""
import threading
from datetime import timedelta

import pytest

from fxpipe.runtime.poster import poster, stop_poster


class _Done:
    def __init__(self, value):
        self.value = value

    def wait(self, timeout):
        return self.value


def test_posts_run_in_order_and_errors_reach_the_waiter():
    order = []
    p = poster()
    handles = [p.post(lambda i: (order.append(i), _Done(i))[1], i) for i in range(5)]
    assert [h.wait(timedelta(seconds=5)) for h in handles] == list(range(5))
    assert order == list(range(5))

    def fail():
        raise ValueError("peer gone")
    with pytest.raises(ValueError, match="peer gone"):
        p.post(fail).wait(timedelta(seconds=5))


def test_stop_poster_joins_the_thread_and_a_later_use_starts_a_new_one():
    first = poster()
    first.post(lambda: _Done(None)).wait(timedelta(seconds=5))
    stop_poster()
    assert not any(t.name == "fxpipe-poster" and t.is_alive() for t in threading.enumerate())
    second = poster()
    assert second is not first
    assert second.post(lambda: _Done(7)).wait(timedelta(seconds=5)) == 7
    stop_poster()
