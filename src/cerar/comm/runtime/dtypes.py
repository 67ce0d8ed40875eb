"""The one table of dtype names and torch dtypes: ``"fp32"`` is ``torch.float32``, and back.

The names are the route table's and the coding layer's: the float precisions of
:data:`cerar.coding.precision.PRECISIONS` (``fp64``, ``fp32``, ``fp16``, ``bf16``) and the 8-bit
block wires' codes (``int8``, ``fp8`` for float8 e4m3fn; :mod:`cerar.coding.blocks`). ``int4``,
``int3`` and ``int2`` have no torch dtype (their codes travel packed in uint8 bytes), so they are not
in the table. The coding layer
stays torch-free; this is the lowest layer that may import torch, and every name <-> dtype map
above it reads :data:`DTYPES` and :func:`dtype_name`.
"""

from __future__ import annotations

from typing import Any

import torch

from cerar.coding.precision import PRECISIONS, precision_name

__all__ = ["DTYPES", "dtype_name", "torch_dtype"]

#: Every dtype name's torch dtype.
DTYPES: dict[str, torch.dtype] = {
    "fp64": torch.float64,
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "int8": torch.int8,
    "fp8": torch.float8_e4m3fn,
}
_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}


def _listed() -> str:
    return ", ".join(str(dtype) for dtype in DTYPES.values())


def dtype_name(dtype: Any, name: str = "dtype") -> str:
    """The name of the torch dtype ``dtype``: ``torch.float16`` is ``"fp16"``, ``torch.int8``
    ``"int8"``. The float ones are :func:`cerar.coding.precision.precision_name`'s, so the two
    cannot disagree. A dtype not in :data:`DTYPES` raises ValueError naming the argument ``name``."""
    key = _NAMES.get(dtype) if isinstance(dtype, torch.dtype) else None
    if key is None:
        raise ValueError(f"Argument {name!r} must be one of {_listed()}, not {dtype!r}.")
    return precision_name(dtype, name) if key in PRECISIONS else key


def torch_dtype(value: Any, name: str = "dtype") -> torch.dtype:
    """The torch dtype of the name ``value`` (a key of :data:`DTYPES`): ``"bf16"`` is
    ``torch.bfloat16``. Another value raises ValueError naming the argument ``name``."""
    dtype = DTYPES.get(value) if isinstance(value, str) else None
    if dtype is None:
        listed = ", ".join(repr(key) for key in DTYPES)
        raise ValueError(f"Argument {name!r} must be one of {listed}, not {value!r}.")
    return dtype
