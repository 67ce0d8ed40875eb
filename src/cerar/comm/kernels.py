"""One-pass forms of three of CERAR's memory-bound coding ops, for :class:`cerar.comm.algorithms.CerarRun`.

Each returns, bitwise, what the separate passes it replaces return; each saves a pass over a
piece (``benchmarks/fused_kernels.py`` measures them against today's ops and ``torch.compile``):

* :func:`add_rounded`: a 16-bit packet as one ``torch.add``: type promotion computes
  ``received + increment`` in float32 and rounds it once on the store, so the float32 buffer that
  the sum was written to and read back from is not needed.
* :func:`own_part_target`: the own part ``D X`` computed straight into the accumulator where
  their dtypes agree (16-bit packets), instead of into a scratch buffer copied into it.
* :func:`write_transposed`: the decoded ``(c, w)`` sum written into the input's ``(w, c)`` rows
  through the rows' transposed view: ``out.copy_(total.t())`` with both float32 takes the CPU's
  element-by-element transpose copy, ``out.t().copy_(total)`` the vectorized strided loops.

Compiled kernels (``torch.compile``, inductor's C++ on a CPU) were measured too and not kept:
each call pays dynamo's guard checks and wrappers, more than a piece's fused pass saves, and
the folds compiled slower than MKL's ``addmm`` (inductor streams the slots once per output row).
"""

from __future__ import annotations

import torch


def add_rounded(increment: torch.Tensor, received: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out = received + increment``, computed in the wider of the two dtypes and rounded once
    to ``out``'s: with 16-bit packets (``received`` and ``out`` float16 or bfloat16,
    ``increment`` float32) bitwise ``torch.add(increment, received, out=f32); out.copy_(f32)``,
    in one pass and without ``f32``. Returns ``out``."""
    return torch.add(increment, received, out=out)


def own_part_target(total: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
    """Where to compute a piece's own part ``D X`` (``own``: the ``(c, w)`` scratch, in the data's
    dtype): straight into the accumulator ``total`` when it has that dtype (a float32 sum with
    16-bit packets), so that :func:`cerar.comm.algorithms.fold_slots`'s ``total.copy_(start)``
    copies nothing (``copy_`` of a tensor onto itself returns at once) and a pass is saved; else
    ``own``, which that copy widens (a float64 sum with float32 packets)."""
    return total if total.dtype == own.dtype else own


def write_transposed(total: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out = total^T`` (``total`` a piece's ``(c, w)`` sum, ``out`` its ``(w, c)`` rows, in the
    data's dtype): bitwise ``out.copy_(total.t())``, written through ``out``'s transposed view.
    Returns ``out``."""
    out.t().copy_(total)
    return out
