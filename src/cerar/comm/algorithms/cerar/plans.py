"""A rank's CERAR matrices as torch tensors, and how the rounds and slots are grouped for the
torch ops: what :class:`cerar.comm.algorithms.cerar.run.CerarRun` and its encode and decode objects
read, built once per code, rank and device (and per packet scale for the scaled forms).

* the encode computes ``B = max(4, c / 2)`` rounds' increments in one product
  (:func:`rounds_per_product`, :func:`round_batches`);
* the decode folds about three groups of observation slots (:func:`slot_groups`), in float64,
  or float32 for 16-bit packets (:func:`accumulator_dtype`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from cerar.coding.linear_code import Code
from cerar.protocol.schedule import Schedule

__all__ = [
    "RankMatrices",
    "ScaledMatrices",
    "accumulator_dtype",
    "rank_matrices",
    "round_batches",
    "rounds_per_product",
    "scaled_matrices",
    "slot_groups",
]


@dataclass(frozen=True)
class RankMatrices:
    """One rank's :class:`cerar.protocol.schedule.RankPlan` as float64 tensors."""

    increments: torch.Tensor  # (L, c): row t-1 is round t's increment
    decode_own: torch.Tensor  # (c, c): D, so that D @ (w, c) rows^T is the piece's D X
    decode_obs: torch.Tensor  # (c, c): W (column s weights observation slot s)
    first_observed_round: int


_RANK: dict[tuple[str, int, str], RankMatrices] = {}


def rank_matrices(code: Code, rank: int, device: torch.device) -> RankMatrices:
    """``rank``'s matrices of ``code`` on ``device``, built once."""
    key = (code.fingerprint, rank, str(device))
    if key not in _RANK:
        plan = Schedule.for_code(code).plan(code, rank)
        c = code.components
        decode = torch.from_numpy(plan.decode).to(device=device, dtype=torch.float64)
        _RANK[key] = RankMatrices(
            increments=torch.from_numpy(plan.increments).to(device=device, dtype=torch.float64),
            decode_own=decode[:, :c].contiguous(),
            decode_obs=decode[:, c:].contiguous(),
            first_observed_round=plan.first_observed_round,
        )
    return _RANK[key]


@dataclass(frozen=True)
class ScaledMatrices:
    """A rank's matrices as the torch ops of one call use them: divided or multiplied by the
    rows' scale ``2**r`` (exact), in their dtypes, grouped as the products take them."""

    per_product: int
    batch_rows: list[torch.Tensor]  # per batch, (B, c) in the data's dtype: increments / 2**r, zero padded
    batch_of: dict[int, tuple[int, int]]  # round -> (batch, row in it)
    group_weights: dict[int, torch.Tensor]  # first slot -> (c, k) columns of W * 2**r, accumulator dtype
    group_of_last_slot: dict[int, tuple[int, int]]  # last slot -> (first, stop)
    decode_own: torch.Tensor  # (c, c) D / 2**r in the data's dtype


_SCALED: dict[tuple[str, int, str, torch.dtype, torch.dtype, int], ScaledMatrices] = {}


def scaled_matrices(
    code: Code, rank: int, device: torch.device, dtype: torch.dtype, acc_dtype: torch.dtype, rows_exponent: int
) -> ScaledMatrices:
    """The call's matrices, built once per (code, rank, device, dtypes, ``r``): a call of a
    size already seen only looks them up (DDP repeats its buckets and their scales every step)."""
    key = (code.fingerprint, rank, str(device), dtype, acc_dtype, rows_exponent)
    if key not in _SCALED:
        plan = rank_matrices(code, rank, device)
        scale, c = math.ldexp(1.0, rows_exponent), code.components
        per_product = rounds_per_product(c)
        batches = round_batches(plan.increments.shape[0], per_product)
        batch_rows = []
        for first, stop in batches:
            padded = torch.zeros(per_product, c, dtype=torch.float64, device=device)
            padded[: stop - first] = plan.increments[first - 1 : stop - 1] / scale
            batch_rows.append(padded.to(dtype))
        weights = (plan.decode_obs * scale).to(acc_dtype)  # column s: slot s's weights, times 2**r
        groups = slot_groups(c)
        if len(_SCALED) >= 256:  # scales move rarely; bound the cache all the same
            _SCALED.clear()
        _SCALED[key] = ScaledMatrices(
            per_product=per_product,
            batch_rows=batch_rows,
            batch_of={t: (j, t - first) for j, (first, stop) in enumerate(batches) for t in range(first, stop)},
            group_weights={start: weights[:, start:stop].contiguous() for start, stop in groups},
            group_of_last_slot={stop - 1: (start, stop) for start, stop in groups},
            decode_own=(plan.decode_own / scale).to(dtype),  # exact: a power of two
        )
    return _SCALED[key]


def accumulator_dtype(packet: torch.dtype) -> torch.dtype:
    """The dtype CERAR's decode accumulates in: float32 for 16-bit packets, float64 otherwise."""
    return torch.float32 if packet in (torch.float16, torch.bfloat16) else torch.float64


def rounds_per_product(components: int) -> int:
    """Rounds whose increments one product computes: ``max(4, c // 2)``. MKL picks a much faster
    kernel for a ``(B, c) x (c, w)`` product from ``B = 4`` rows on (about four times faster per
    round than ``B = 1 .. 3``), so a batch of four costs what one round did; wider codes take
    ``c / 2`` rows (fewer passes over the input) for the same memory, half the input's size."""
    return max(4, components // 2)


def round_batches(rounds: int, per_product: int) -> list[tuple[int, int]]:
    """The rounds ``[first, stop)`` whose increments are computed together, ``per_product`` at
    a time (the last batch may be shorter; it is computed padded)."""
    return [(first, min(first + per_product, rounds + 1)) for first in range(1, rounds + 1, per_product)]


def slot_groups(components: int) -> list[tuple[int, int]]:
    """The observation slots folded together, ``[(first, stop), ...]``: about three groups, the
    last the smallest, so that the accumulator is streamed three times (a rank-1 update per
    slot streamed it ``c`` times, and the folds are memory-bound) and the work
    left after the last round lands is the last group's."""
    size = max(2, math.ceil(components / 3))
    return [(start, min(start + size, components)) for start in range(0, components, size)]
