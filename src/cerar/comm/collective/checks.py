"""The collective's argument checks, run on the caller's thread before anything is queued.

Each raises with a message that names the argument and the value. The tensor checks refuse
what the ring cannot work on in place (sparse, nested and meta tensors, views whose elements
share memory) up front, instead of failing on the communication thread or after the whole
collective ran.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from cerar._checks import check_bool
from cerar.comm.runtime.dtypes import DTYPES
from cerar.comm.runtime.stats import CommStats

# check_bool: from cerar._checks
__all__ = ["check_bool", "check_op", "check_stats", "check_tensor", "check_wire_dtype", "overlaps_itself"]


def check_tensor(tensor: Any) -> None:
    """Refuse, before anything is queued, the tensors the ring cannot work on in place.

    Without these checks they failed on the communication thread with torch's internal
    messages (meta, sparse), or only after the whole collective ran (a self-overlapping view,
    whose write-back needs a distinct location per element), while the peers had already
    taken part. ``requires_grad`` is fine: the call works on ``tensor.detach()``.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"Argument 'tensor' must be a torch.Tensor, not {type(tensor).__name__}.")
    if tensor.dtype not in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        raise TypeError(f"Argument 'tensor' must be float32, float64, float16 or bfloat16, not {tensor.dtype}.")
    if tensor.layout != torch.strided or tensor.is_nested:
        kind = "nested" if tensor.is_nested else str(tensor.layout)
        raise TypeError(f"Argument 'tensor' must be a dense (torch.strided) tensor, not {kind}.")
    if tensor.is_meta:
        raise ValueError("Argument 'tensor' must hold data, not be on the meta device.")
    if overlaps_itself(tensor):
        raise ValueError(
            f"Argument 'tensor' must not overlap itself (each element its own memory), not a view "
            f"with shape {tuple(tensor.shape)} and strides {tensor.stride()}; pass tensor.clone()."
        )


def overlaps_itself(tensor: torch.Tensor) -> bool:
    """Whether two elements of ``tensor`` share a memory location (``expand()``, ``as_strided``).

    Fast and exact for every view that slicing, transposing or permuting makes: sorted by
    stride, each dimension must step over everything the smaller ones reach. Only
    hand-made ``as_strided`` layouts that fail that test pay for listing their offsets.
    """
    dims = sorted((stride, size) for size, stride in zip(tensor.shape, tensor.stride(), strict=True) if size > 1)
    reach = 0  # the largest offset reached by the dimensions seen so far
    for stride, size in dims:
        if stride <= reach:
            break
        reach += stride * (size - 1)
    else:
        return False
    span = 1 + sum(stride * (size - 1) for stride, size in dims)
    if dims[0][0] == 0 or tensor.numel() > span:
        return True  # a broadcast dimension, or more elements than locations
    offsets = torch.zeros(1, dtype=torch.int64)
    for stride, size in dims:
        offsets = (offsets[:, None] + torch.arange(size, dtype=torch.int64) * stride).reshape(-1)
    return int(torch.unique(offsets).numel()) < tensor.numel()


def check_op(op: Any) -> str:
    """``"sum"``/``"avg"`` or ``dist.ReduceOp.SUM``/``AVG``, compared by type first: a
    ``RedOpType`` equals its int value (``ReduceOp.SUM == 0``), and ``False == 0`` too."""
    if isinstance(op, str) and op in ("sum", "avg"):
        return op
    if isinstance(op, (dist.ReduceOp, dist.ReduceOp.RedOpType)):
        # ReduceOp(RedOpType) == RedOpType holds, the reverse comparison does not: op on the left.
        if op == dist.ReduceOp.SUM:
            return "sum"
        if op == dist.ReduceOp.AVG:
            return "avg"
    raise ValueError(f"Argument 'op' must be 'sum' or 'avg' (or ReduceOp.SUM/AVG), not {op!r}.")


def check_stats(stats: Any) -> None:
    if stats is not None and not isinstance(stats, CommStats):
        raise TypeError(f"Argument 'stats' must be a cerar.CommStats or None, not {type(stats).__name__}.")


PACKET_DTYPES = (None, *(DTYPES[name] for name in ("fp32", "fp64", "fp16", "bf16")))
#: A ring's wires: CERAR's packets, and the 8-bit block-quantized ones (:mod:`cerar.coding.blocks`).
WIRE_DTYPES = (*PACKET_DTYPES, DTYPES["int8"], DTYPES["fp8"])


def _listed(dtypes: tuple[torch.dtype | None, ...]) -> str:
    """``None, torch.float32, ... or torch.bfloat16``."""
    names = [str(dtype) for dtype in dtypes]
    return f"{', '.join(names[:-1])} or {names[-1]}"


def check_wire_dtype(wire_dtype: Any, name: str = "wire_dtype") -> torch.dtype | None:
    """A ring's ``wire_dtype`` checked: None, float32, float64, float16, bfloat16, int8 or
    float8_e4m3fn."""
    if wire_dtype not in WIRE_DTYPES:
        raise ValueError(f"Argument {name!r} must be {_listed(WIRE_DTYPES)}, not {wire_dtype!r}.")
    return wire_dtype


def check_packet_dtype(packet_dtype: Any, name: str = "packet_dtype") -> torch.dtype | None:
    """``packet_dtype`` (or the argument ``name``, a ring's ``wire_dtype``) checked: None,
    float32, float64, float16 or bfloat16."""
    if packet_dtype not in PACKET_DTYPES:
        raise ValueError(f"Argument {name!r} must be {_listed(PACKET_DTYPES)}, not {packet_dtype!r}.")
    return packet_dtype
