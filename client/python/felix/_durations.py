"""Durations as the API takes them (seconds or a ``timedelta``) and as the
wire carries them (milliseconds). Shared by :mod:`felix.client` and
:mod:`felix.sharded`."""

import math
from datetime import timedelta
from typing import Union

from .errors import InvalidArgument

#: A duration in seconds (``float``/``int``) or a :class:`datetime.timedelta`.
Seconds = Union[float, int, timedelta]

MAX_U32 = (1 << 32) - 1
MAX_U64 = (1 << 64) - 1


def seconds(what: str, value: Seconds) -> float:
    """A duration in seconds: finite and not negative, else
    :class:`~felix.errors.InvalidArgument`."""
    if isinstance(value, timedelta):
        value = value.total_seconds()
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise InvalidArgument(f"{what} must be seconds (a number or a timedelta), not {value!r}")
    if isinstance(value, int) and value > MAX_U64:
        value = MAX_U64  # Saturate (an int this large does not fit a float).
    result = float(value)
    if math.isnan(result) or math.isinf(result):
        raise InvalidArgument(f"{what} must be a finite number of seconds, not {value!r}")
    if result < 0:
        raise InvalidArgument(f"{what} must not be negative, not {value}")
    return result


def ms_u64(what: str, value: Seconds) -> int:
    """Milliseconds for a ``u64`` wire field, saturating at its maximum; a
    non-zero sub-millisecond value rounds up to 1 (``ms_u64`` in Rust)."""
    secs = seconds(what, value)
    ms = min(int(secs * 1000), MAX_U64)
    return 1 if ms == 0 and secs > 0 else ms


def ms_u32(what: str, value: Seconds) -> int:
    """:func:`ms_u64`, saturating at the ``u32`` maximum."""
    return min(ms_u64(what, value), MAX_U32)
