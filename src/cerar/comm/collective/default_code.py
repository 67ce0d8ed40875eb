"""The code a call uses when none is given: the one place that decides it (the collective, the
hierarchical path and the DDP states all ask here)."""

from __future__ import annotations

import functools

import torch

from cerar.coding import codes
from cerar.coding.linear_code import Code

__all__ = ["check_usable", "code_within", "default_code", "working_dtype"]


@functools.cache
def default_code(world_size: int, precision: str = "fp32") -> Code:
    """The code used when none is given, tuned for the packet precision.

    * float32 packets: :func:`cerar.coding.codes.choose` with its default error budget (1e-3):
      the fewest bytes that meet it (``c = 2N``: ``(3N-2)/(2N)`` values per value, 0.83x ring at
      ``N = 4``, worst-rank error near 2e-4).
    * float64 packets: the fewest bytes whose predicted error is no larger than the float32
      default's, so that wider data never gets a less accurate sum by default (``c = 4N``, 1.125
      values per value at ``N = 4``, error 5e-5). With the 1e-3 budget itself ``choose`` reaches
      ``c = 5N``, whose decoder is far worse conditioned: 7x the error for 2% fewer bytes.
    * 16-bit packets: ``codes.optimized(N, 2N, precision)`` (predicted worst-rank error at
      ``N = 4``: 1.6e-2 in float16, 4.5e-2 in bfloat16); two ranks use the exact code.

    :func:`code_within` binds it by ``max_error``; :meth:`cerar.comm.collective.routes.Route.code_for`
    is the one rule every call, group and hook asks."""
    if precision in ("fp16", "bf16"):
        return codes.exact(2) if world_size == 2 else codes.optimized(world_size, 2 * world_size, precision)
    if precision == "fp64":
        float32_error = default_code(world_size, "fp32").predicted_worst_error("fp32")
        return codes.choose(world_size, "fp64", error_budget=max(float32_error, 1e-12))
    return codes.choose(world_size, precision)


def working_dtype(tensor_dtype: torch.dtype) -> torch.dtype:
    """The dtype the ring works in: float64 for float64 tensors, float32 for all others."""
    return torch.float64 if tensor_dtype == torch.float64 else torch.float32


@functools.lru_cache(maxsize=256)
def check_usable(code: Code, precision: str, max_error: float | None) -> None:
    """``code.check_error`` once per (code, precision, limit): the prediction costs milliseconds."""
    code.check_error(precision, max_error)


@functools.lru_cache(maxsize=256)
def code_within(world_size: int, precision: str, max_error: float | None) -> Code:
    """The default code, bound by ``max_error``: :func:`default_code` where its predicted
    worst-rank error at ``precision`` is within it, else the code with the most components that
    is (:func:`cerar.coding.codes.choose` with that budget, down to the exact code ``c = N``);
    where none is (the exact code's own rounding at a 16-bit precision exceeds it), a
    ValueError naming ``N``, the precision and the figures, as an explicit code is refused."""
    code = default_code(world_size, precision)
    if max_error is None or code.predicted_worst_error(precision) <= max_error:
        return code
    code = codes.choose(world_size, precision, error_budget=max_error)
    check_usable(code, precision, max_error)
    return code
