import pytest

from passes.errors import FxpipeError
from fxpipe.units import parse_bandwidth, parse_memory


@pytest.mark.parametrize("text,value", [
    ("1.25e9", 1.25e9), ("10Gbit", 1.25e9), ("10Gbit/s", 1.25e9), ("1.25GB/s", 1.25e9),
    ("100Mbps", 1.25e7), ("400", 400.0),
])
def test_bandwidth(text, value):
    assert parse_bandwidth(text) == pytest.approx(value)


@pytest.mark.parametrize("text,value", [("16GiB", 16 * 2**30), ("500MB", 5 * 10**8), ("1.6e10", 16 * 10**9), ("2KiB", 2048)])
def test_memory(text, value):
    assert parse_memory(text) == value


@pytest.mark.parametrize("text", ["fast", "10 parsecs", "-3GB", "0"])
def test_bad_values_name_the_quantity(text):
    with pytest.raises(FxpipeError, match="memory"):
        parse_memory(text)
