"""Argument checks shared by every public entry point.

Each check raises with a message that names the argument and the offending value, in the
style "Argument 'components' must be at least 1, not 0.".
"""

from __future__ import annotations

import math
import numbers
import re
import warnings
from collections.abc import Iterable
from typing import Any


def renamed(old: str, old_value: Any, new: str, new_value: Any) -> Any:
    """The value of a setting whose argument was renamed from ``old`` to ``new`` (None: not
    given): the new one, or the old one with a ``DeprecationWarning`` naming the new; both
    given is refused."""
    if old_value is None:
        return new_value
    if new_value is not None:
        raise TypeError(f"Arguments {old!r} and {new!r} name the same setting: pass {new!r} only, not both.")
    message = f"Argument {old!r} is deprecated: pass {new}={old_value!r} instead."
    warnings.warn(message, DeprecationWarning, stacklevel=3)
    return old_value


def check_bool(name: str, value: Any) -> bool:
    """Return ``value`` after checking it is a ``bool`` (not 0, 1 or None)."""
    if not isinstance(value, bool):
        raise TypeError(f"Argument '{name}' must be a bool, not {value!r}.")
    return value


def check_int(name: str, value: Any, *, minimum: int | None = None, optional: bool = False) -> int | None:
    """Return ``value`` as an ``int`` after checking it is a true integer (not a bool).

    ``optional=True`` lets ``None`` through (a setting that is off).
    """
    if optional and value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"Argument '{name}' must be an integer, not {value!r}.")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"Argument '{name}' must be at least {minimum}, not {value}.")
    return value


def check_float(
    name: str,
    value: Any,
    *,
    positive: bool = False,
    nonnegative: bool = False,
    maximum: float | None = None,
    optional: bool = False,
) -> float | None:
    """Return ``value`` as a finite ``float``; reject bools, NaN and infinities.

    ``optional=True`` lets ``None`` through (a setting that is off).
    """
    if optional and value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"Argument '{name}' must be a real number, not {value!r}.")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"Argument '{name}' must be finite, not {value}.")
    if positive and value <= 0:
        raise ValueError(f"Argument '{name}' must be positive, not {value}.")
    if nonnegative and value < 0:
        raise ValueError(f"Argument '{name}' must be non-negative, not {value}.")
    if maximum is not None and value > maximum:
        raise ValueError(f"Argument '{name}' must be at most {maximum}, not {value}.")
    return value


def check_choice(name: str, value: Any, choices: Iterable[str]) -> str:
    """Return ``value`` after checking it is one of ``choices``."""
    choices = tuple(choices)
    if not isinstance(value, str) or value not in choices:
        listed = ", ".join(repr(c) for c in choices)
        raise ValueError(f"Argument '{name}' must be one of {listed}, not {value!r}.")
    return value


_SIZE_PATTERN = re.compile(r"^(\d+(?:\.\d+)?)\s*([kmg]?)(i?b?)$", re.I)


def parse_size(text: str, name: str = "sizes") -> int:
    """``"4M"``, ``"64K"``, ``"1MiB"``, ``"1048576"`` -> bytes (K, M, G are powers of 1024)."""
    match = _SIZE_PATTERN.match(text.strip()) if isinstance(text, str) else None
    if match is None:
        raise ValueError(f"Argument '{name}' must be sizes such as 64K, 1M, 16M or 1048576, not {text!r}.")
    scale = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[match.group(2).lower()]
    value = float(match.group(1)) * scale
    if value != int(value):
        raise ValueError(f"Argument '{name}' must be a whole number of bytes, not {text!r}.")
    return int(value)


def format_size(size_bytes: float) -> str:
    """``1048576`` -> ``"1M"``; ``65536`` -> ``"64K"`` (powers of 1024, as parsed)."""
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if size_bytes >= scale:
            value = size_bytes / scale
            return f"{value:g}{unit}" if value == int(value) else f"{value:.3g}{unit}"
    return f"{int(size_bytes)}B"
