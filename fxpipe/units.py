"""Human quantities on the command line: bandwidth in bytes/s, memory in bytes.

``1.25e9`` is taken as is. Suffixes: ``B`` bytes, ``bit`` or ``b`` bits (divided by 8),
decimal ``K M G T`` (10^3…) and binary ``Ki Mi Gi Ti`` (2^10…) prefixes, an
optional ``/s``. So ``10Gbit``, ``10Gbit/s`` and ``1.25GB/s`` all mean
1.25e9 bytes/s; ``16GiB`` is 17179869184 bytes and ``500MB`` 5e8.
"""
from __future__ import annotations

import argparse
import re

from passes.errors import FxpipeError


class UnitError(FxpipeError, argparse.ArgumentTypeError):
    """A quantity that cannot be read.

    Also an ``ArgumentTypeError``: used as an argparse ``type=`` the message
    becomes argparse's one-line error naming the option, instead of a traceback.
    """

_PREFIX = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12,
           "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}
_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([kKmMgGtT]i?)?(bits?|b|B|bytes?)?(/s|ps)?\s*$")


def parse_quantity(text: str, what: str = "quantity") -> float:
    """Bytes (or bytes per second) from a string like ``10Gbit/s`` or ``16GiB``."""
    m = _RE.match(str(text))
    if not m:
        raise UnitError(f"cannot read {what} {text!r}: write a number of bytes like 1.25e9, "
                          "or with a unit like 10Gbit/s, 1.25GB/s, 16GiB, 500MB")
    value = float(m.group(1)) * _PREFIX[(m.group(2) or "").lower()]
    if m.group(3) in ("bit", "bits", "b"):
        value /= 8
    return value


def parse_bandwidth(text: str) -> float:
    value = parse_quantity(text, "bandwidth")
    if value <= 0:
        raise UnitError(f"bandwidth must be positive, got {text!r}")
    return value


def parse_memory(text: str) -> int:
    value = parse_quantity(text, "memory")
    if value <= 0:
        raise UnitError(f"memory must be positive, got {text!r}")
    return int(round(value))


def at_least(minimum: int):
    """An argparse ``type=`` for a whole count of at least ``minimum`` (steps, microbatches, devices)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise UnitError(f"expected a whole number, got {text!r}") from None
        if value < minimum:
            raise UnitError(f"must be at least {minimum}, got {value}")
        return value
    parse.__name__ = f"count >= {minimum}"
    return parse


def positive_float(text: str) -> float:
    """An argparse ``type=`` for a positive number of seconds (timeouts, time limits)."""
    try:
        value = float(text)
    except ValueError:
        raise UnitError(f"expected a number, got {text!r}") from None
    if not value > 0:
        raise UnitError(f"must be positive, got {text}")
    return value
