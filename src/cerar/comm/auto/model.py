"""The cost model of ``method="auto"`` and its decision for one bucket.

The model, per process group (it extends ``cerar bench``'s alpha-beta fit to every method at
once)::

    t(candidate, values) = rounds x alpha[transport] + bytes_sent x beta + values x gamma[candidate]

* ``alpha``: latency per round, one per transport (torch's ``all_reduce``, cerar's ring with its
  handshake hops counted as rounds);
* ``beta``: time per byte a rank sends, shared (the link is the same whoever drives it);
* ``gamma``: time per value beyond moving the bytes (casts for the 16-bit rings, CERAR's encode
  and decode, cerar's transport's own work), one per candidate; torch's exact float32
  all-reduce has none (its reduction is per byte: it measures ``beta``).

:func:`fit_cost_model` fits it to timed calls (each a median of the slowest rank's times) by
non-negative least squares with relative weights (times span decades; every size counts alike).
Measured under real traffic the ``gamma`` terms carry what coding costs while backward competes
for the cores. :func:`decide_slot` then picks a size's method by the tournament's rule: the
smallest predicted time, CERAR only when it beats the best ring by ``margin``. ``cerar plan`` and
the bench's prediction column use it; ``method="auto"`` decides by its tournament
(:mod:`cerar.comm.auto.tournament`), not by the model.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import numpy as np

from cerar.comm.auto.candidates import Candidate, rank

__all__ = ["Choice", "CostModel", "decide_slot", "fit_cost_model"]


class Choice(NamedTuple):
    """One size's method: the candidate's index and why: ``"fastest"`` (the smallest predicted
    time), ``"budget"`` (the only candidate within the error budget) or ``"margin"`` (CERAR was
    predicted faster, but not by the margin: the best ring)."""

    candidate: int
    reason: str


@dataclass(frozen=True)
class CostModel:
    """The fitted constants (see the module doc); ``predict`` gives a call's seconds.

    Attributes:
        alpha_s: seconds per round, per transport fitted.
        beta_s_per_byte: seconds per byte sent per rank (``1 / beta``: the effective bandwidth).
        gamma_s_per_value: seconds per value coded, per candidate label fitted.
        points: timed sizes fitted; max_rel_residual: the worst relative misfit.
    """

    alpha_s: Mapping[str, float]
    beta_s_per_byte: float
    gamma_s_per_value: Mapping[str, float] = field(default_factory=dict)
    points: int = 0
    max_rel_residual: float = 0.0

    def knows(self, candidate: Candidate) -> bool:
        """Whether every term of ``candidate`` was fitted."""
        return candidate.route.transport in self.alpha_s and (
            not candidate.coding or candidate.label in self.gamma_s_per_value
        )

    def predict(self, candidate: Candidate, values: float) -> float:
        """Predicted seconds of one call of ``candidate`` on ``values`` values (inf if unknown)."""
        if not self.knows(candidate):
            return math.inf
        gamma = self.gamma_s_per_value.get(candidate.label, 0.0) if candidate.coding else 0.0
        return (
            candidate.rounds * self.alpha_s[candidate.route.transport]
            + candidate.bytes_per_value * values * self.beta_s_per_byte
            + values * gamma
        )

    def with_cluster(
        self,
        beta_s_per_byte: float | None = None,
        gamma_s_per_value: Mapping[str, float] | None = None,
        alpha_s: float | None = None,
    ) -> CostModel:
        """This model with a described link (``beta``), coding speeds (``gamma``) and latency
        (``alpha``, every transport) put in: a prediction for another machine."""
        return replace(
            self,
            alpha_s=dict(self.alpha_s) if alpha_s is None else dict.fromkeys(self.alpha_s, alpha_s),
            beta_s_per_byte=self.beta_s_per_byte if beta_s_per_byte is None else beta_s_per_byte,
            gamma_s_per_value=dict(self.gamma_s_per_value if gamma_s_per_value is None else gamma_s_per_value),
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "formula": "t = rounds x alpha[transport] + bytes sent per rank x beta + values x gamma[method]",
            "alpha_s_per_round": dict(self.alpha_s),
            "beta_s_per_byte": self.beta_s_per_byte,
            "bandwidth_bytes_per_s": 1.0 / self.beta_s_per_byte if self.beta_s_per_byte > 0 else None,
            "gamma_s_per_value": dict(self.gamma_s_per_value),
            "points": self.points,
            "max_rel_residual": self.max_rel_residual,
        }


def fit_cost_model(observations: Iterable[tuple[Candidate, float, float]]) -> CostModel | None:
    """Fit ``(candidate, values, seconds)`` observations (non-finite or non-positive times are
    left out) by non-negative least squares on relative errors; ``None`` without any."""
    from scipy.optimize import nnls

    rows = [(c, float(v), float(t)) for c, v, t in observations if math.isfinite(t) and t > 0 and v > 0]
    if not rows:
        return None
    transports = sorted({c.route.transport for c, _, _ in rows})
    coded = sorted({c.label for c, _, _ in rows if c.coding})
    columns = [("alpha", t) for t in transports] + [("beta", "")] + [("gamma", label) for label in coded]
    design = np.zeros((len(rows), len(columns)))
    for i, (candidate, values, _) in enumerate(rows):
        design[i, columns.index(("alpha", candidate.route.transport))] = candidate.rounds
        design[i, columns.index(("beta", ""))] = candidate.bytes_per_value * values
        if candidate.coding:
            design[i, columns.index(("gamma", candidate.label))] = values
    times = np.array([t for _, _, t in rows])
    weighted = design / times[:, None]
    scale = np.linalg.norm(weighted, axis=0)
    scale[scale == 0] = 1.0  # a column no row uses stays 0
    solution, _ = nnls(weighted / scale, np.ones(len(rows)))
    solution = solution / scale
    fitted = design @ solution
    values_of = dict(zip(columns, (float(x) for x in solution), strict=True))
    return CostModel(
        alpha_s={t: values_of[("alpha", t)] for t in transports},
        beta_s_per_byte=values_of[("beta", "")],
        gamma_s_per_value={label: values_of[("gamma", label)] for label in coded},
        points=len(rows),
        max_rel_residual=float(np.max(np.abs(fitted - times) / times)),
    )


def decide_slot(candidates: Sequence[Candidate], predicted: Sequence[float], *, margin: float) -> Choice:
    """One size's choice from each candidate's predicted seconds (``inf``: unknown): the first by
    :func:`cerar.comm.auto.candidates.rank`, the tournament's rule (CERAR only by ``margin``, a
    fraction, over the best ring)."""
    everyone = range(len(candidates))
    winner = rank(candidates, predicted, everyone, margin)[0]
    fastest = min(everyone, key=lambda i: (predicted[i], i))
    return Choice(winner, "budget" if len(candidates) == 1 else "fastest" if winner == fastest else "margin")
