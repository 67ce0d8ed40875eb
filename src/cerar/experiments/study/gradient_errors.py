"""The figures of the gradient study (:mod:`cerar.experiments.study.gradients`): how shared and
spread a data set is (:func:`data_statistics`) and one simulated call's errors, over the whole
bucket and per parameter (:func:`parameter_errors`), from the simulators' ``outputs`` and
``exact`` alone. Pure numpy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from cerar.experiments.study.capture_file import check_parameters
from cerar.protocol.simulate import SimulationResult

__all__ = ["call_errors", "data_statistics", "parameter_errors"]


def data_statistics(inputs: np.ndarray) -> dict[str, float]:
    """How shared and how spread the ``(N, d)`` inputs are (see the module docstring)."""
    rows = np.asarray(inputs, dtype=np.float64)
    mean_sq = float(np.mean(np.sum(rows**2, axis=1)))
    common = float(np.sum(rows.mean(axis=0) ** 2) / mean_sq) if mean_sq > 0 else float("nan")
    norms = np.linalg.norm(rows, axis=1)
    cosines = (rows @ rows.T) / np.outer(norms, norms)
    off = cosines[~np.eye(len(rows), dtype=bool)]
    rms = float(np.sqrt(np.mean(rows**2)))
    return {
        "common_fraction": common,
        "min_cosine": float(off.min()),
        "mean_cosine": float(off.mean()),
        "rank_norms": norms.tolist(),
        "sum_norm": float(np.linalg.norm(rows.sum(axis=0))),
        "max_abs_over_rms": float(np.max(np.abs(rows)) / rms) if rms > 0 else float("nan"),
        "zero_fraction": float(np.mean(rows == 0)),
    }


def parameter_errors(
    outputs: np.ndarray, exact: np.ndarray, parameters: Sequence[tuple[str, int]]
) -> dict[str, Any]:
    """Every rank's error on every parameter of the flat sum, relative to that parameter's own sum.

    Args:
        outputs: ``(N, d)`` each rank's decoded sum (:attr:`SimulationResult.outputs`).
        exact: ``(d,)`` the true sum (:attr:`SimulationResult.exact`).
        parameters: ``(name, size)`` per parameter, in the order of the flat vector, sizes
            summing to ``d``.

    Returns:
        A JSON-ready dict. Over the parameters ``p`` with ``||S[p]|| > 0``: ``worst``, the largest
        ``||S_hat_j[p] - S[p]|| / ||S[p]||`` over ``j`` and ``p`` (None if there is no such
        parameter), its ``worst_parameter`` and ``worst_rank``, ``per_rank`` (each rank's largest
        over ``p``), ``median`` (over ``p`` of the worst rank's error) and ``count``. Under
        ``zero_sum``, the parameters whose true sum is exactly zero: their ``count``, ``size``
        (values), ``worst_abs`` (the largest ``||S_hat_j[p]||`` over ``j`` and those ``p``, None
        if there are none) and its ``parameter``. Empty parameters count in neither. Under
        ``zero_values``, the single values whose true sum is exactly zero, wherever they lie:
        their ``count`` and ``worst_abs``, the largest ``||S_hat_j[z]||`` over ranks (None if none).
    """
    out = np.asarray(outputs, dtype=np.float64)
    true = np.asarray(exact, dtype=np.float64)
    if out.ndim != 2 or true.shape != (out.shape[1],):
        raise ValueError(
            f"Arguments 'outputs' and 'exact' must have shapes (N, d) and (d,), not {out.shape} and {true.shape}."
        )
    layout = check_parameters(parameters, out.shape[1])
    names = [name for name, count in layout if count > 0]
    sizes = np.array([count for _, count in layout if count > 0], dtype=np.int64)
    empty: dict[str, Any] = {"count": 0, "size": 0, "worst_abs": None, "parameter": None}
    zero_values = true == 0
    zeros = {
        "count": int(np.sum(zero_values)),
        "worst_abs": float(np.linalg.norm(out[:, zero_values], axis=1).max()) if np.any(zero_values) else None,
    }
    if sizes.size == 0:
        return {"worst": None, "worst_parameter": None, "worst_rank": None, "per_rank": [None] * len(out),
                "median": None, "count": 0, "zero_sum": empty, "zero_values": zeros}  # fmt: skip
    starts = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    # Sums of squares per parameter: reduceat over the non-empty slices (each start < d).
    true_norm = np.sqrt(np.add.reduceat(true**2, starts))
    error_norm = np.sqrt(np.add.reduceat((out - true) ** 2, starts, axis=1))  # (N, K)
    nonzero = true_norm > 0
    result: dict[str, Any] = {"count": int(np.sum(nonzero))}
    if np.any(nonzero):
        relative = error_norm[:, nonzero] / true_norm[nonzero]
        rank, column = np.unravel_index(int(np.argmax(relative)), relative.shape)
        result.update(
            worst=float(relative[rank, column]),
            worst_parameter=[n for n, keep in zip(names, nonzero, strict=True) if keep][column],
            worst_rank=int(rank),
            per_rank=relative.max(axis=1).tolist(),
            median=float(np.median(relative.max(axis=0))),
        )
    else:
        result.update(worst=None, worst_parameter=None, worst_rank=None, per_rank=[None] * len(out), median=None)
    zero = ~nonzero
    if np.any(zero):
        absolute = error_norm[:, zero]  # S[p] = 0: the error is the output itself
        column = int(np.argmax(absolute.max(axis=0)))
        result["zero_sum"] = {
            "count": int(np.sum(zero)),
            "size": int(np.sum(sizes[zero])),
            "worst_abs": float(absolute.max()),
            "parameter": [n for n, z in zip(names, zero, strict=True) if z][column],
        }
    else:
        result["zero_sum"] = empty
    result["zero_values"] = zeros
    return result


def call_errors(result: SimulationResult, parameters: Sequence[tuple[str, int]] | None) -> dict[str, Any]:
    """One simulated call's figures: the worst-rank, mean-rank and per-rank relative errors over
    the whole bucket, and with ``parameters`` the per-parameter ones (:func:`parameter_errors`)."""
    per_rank = result.relative_errors
    errors: dict[str, Any] = {
        "worst": float(per_rank.max()),
        "mean": float(per_rank.mean()),
        "per_rank": per_rank.tolist(),
    }
    if parameters is not None:
        errors["per_parameter"] = parameter_errors(result.outputs, result.exact, parameters)
    return errors
