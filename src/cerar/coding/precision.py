"""Packet precisions: names, unit roundoffs and rounding in numpy.

Pure numpy (no torch). ``bf16`` has no numpy dtype, so it is emulated by rounding float32 values
to 8 mantissa bits with round-to-nearest-even, exactly what a cast to ``torch.bfloat16`` does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from cerar._checks import check_choice

PRECISIONS: tuple[str, ...] = ("fp64", "fp32", "fp16", "bf16")

#: Unit roundoff (half the machine epsilon) of each packet precision.
UNIT_ROUNDOFF: dict[str, float] = {
    "fp64": 2.0**-53,
    "fp32": 2.0**-24,
    "fp16": 2.0**-11,
    "bf16": 2.0**-8,
}

#: Bytes per value on the wire.
ITEMSIZE: dict[str, int] = {"fp64": 8, "fp32": 4, "fp16": 2, "bf16": 2}

_ALIASES: dict[str, str] = {
    "float64": "fp64",
    "double": "fp64",
    "float32": "fp32",
    "float": "fp32",
    "float16": "fp16",
    "half": "fp16",
    "bfloat16": "bf16",
}


def precision_name(value: Any, name: str = "precision") -> str:
    """Normalise a precision given as a name, a numpy dtype or a torch dtype to ``fp64`` etc."""
    if isinstance(value, str):
        key = _ALIASES.get(value, value)
        return check_choice(name, key, PRECISIONS)
    text = str(value)  # torch.float32 -> "torch.float32", torch.bfloat16 -> "torch.bfloat16"
    key: str | None = None
    if text.startswith("torch."):
        # Match the whole name: a suffix test would read torch.bfloat16 as "float16".
        key = text[len("torch.") :]
    elif value is not None:  # np.dtype(None) is float64: do not accept None silently
        try:
            key = np.dtype(value).name  # numpy dtypes and scalar types, Python's float (float64)
        except TypeError:
            key = None
    if key in _ALIASES:
        return _ALIASES[key]
    raise ValueError(
        f"Argument '{name}' must be one of {', '.join(repr(p) for p in PRECISIONS)}, "
        f"not {value!r}."
    )


def _round_bf16(x: np.ndarray) -> np.ndarray:
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    # Round to nearest, ties to even, on the 16 bits that bfloat16 drops.
    rounding = np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    finite = np.isfinite(x.astype(np.float32))
    out = np.where(finite, (bits + rounding) & np.uint32(0xFFFF0000), bits)
    return out.astype(np.uint32).view(np.float32)


def rounder(precision: str) -> Callable[[np.ndarray], np.ndarray]:
    """Return a function that rounds a float array to ``precision`` (returned as float32/64)."""
    precision = precision_name(precision)
    if precision == "fp64":
        return lambda x: np.asarray(x, dtype=np.float64)
    if precision == "fp32":
        return lambda x: np.asarray(x, dtype=np.float32)
    if precision == "fp16":
        # Through float32, as torch's cast from float64 does (numpy's direct cast rounds once and
        # differs from torch in about 1 value in 10^4).
        return lambda x: np.asarray(x, dtype=np.float32).astype(np.float16).astype(np.float32)
    return lambda x: _round_bf16(np.asarray(x, dtype=np.float32))
