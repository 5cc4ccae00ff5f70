"""The measured CPU of one gloo message through the runtime's poster threads."""
import math

from fxpipe.runtime.postcost import SIZES, message_cost_s


def test_a_message_costs_some_cpu_and_a_sane_amount():
    fixed, per_byte = message_cost_s(0.02)
    assert math.isfinite(fixed) and math.isfinite(per_byte)
    assert fixed >= 0 and per_byte >= 0
    one_side = fixed + per_byte * SIZES[0]
    # posting through a thread and gloo's I/O thread is real CPU work, and far below a millisecond-scale stall
    assert 1e-6 < one_side < 0.05
