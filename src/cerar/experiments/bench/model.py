"""``method="auto"``'s cost model, fitted to a bench run: ``cerar plan`` and the bench's
prediction column use it; ``method="auto"`` decides by its tournament
(:mod:`cerar.comm.auto.tournament`), not by the model.

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
smallest predicted time, CERAR only when it beats the best ring by ``margin``. Each flat bench
method is one :class:`cerar.comm.auto.candidates.Candidate`, every regime one fit
(:func:`fit_regime`), and every record gets its prediction beside its measurement
(:func:`add_predictions`: the validation of the model).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import numpy as np

from cerar.comm.auto.candidates import Candidate, rank
from cerar.comm.collective.routes import ROUTES, get_route
from cerar.comm.runtime.handshake import dissemination_distances

__all__ = [
    "AUTO_LABELS",
    "Choice",
    "CostModel",
    "add_predictions",
    "candidate_of",
    "decide_slot",
    "fit_cost_model",
    "fit_regime",
    "has_gamma",
    "rounds",
]


def rounds(candidate: Candidate) -> int:
    """Sequential message rounds per call of ``candidate`` (cerar's transport adds its handshake
    hops): what ``alpha`` multiplies."""
    n = candidate.world_size
    data = 2 * (n - 1) if candidate.components is None else candidate.components + n - 2
    return data + (len(dissemination_distances(n)) if candidate.route.transport == "cerar" else 0)


def has_gamma(candidate: Candidate) -> bool:
    """Whether ``candidate`` takes time per value beyond moving its bytes (casts, CERAR's coding,
    cerar's transport's own work): the ``gamma`` term. Torch's exact float32 all-reduce, which
    the link's ``beta`` is measured by, has none."""
    return not (candidate.route.exact_sum and candidate.route.transport == "torch")


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
            not has_gamma(candidate) or candidate.label in self.gamma_s_per_value
        )

    def predict(self, candidate: Candidate, values: float) -> float:
        """Predicted seconds of one call of ``candidate`` on ``values`` values (inf if unknown)."""
        if not self.knows(candidate):
            return math.inf
        gamma = self.gamma_s_per_value.get(candidate.label, 0.0) if has_gamma(candidate) else 0.0
        return (
            rounds(candidate) * self.alpha_s[candidate.route.transport]
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
    coded = sorted({c.label for c, _, _ in rows if has_gamma(c)})
    columns = [("alpha", t) for t in transports] + [("beta", "")] + [("gamma", label) for label in coded]
    design = np.zeros((len(rows), len(columns)))
    for i, (candidate, values, _) in enumerate(rows):
        design[i, columns.index(("alpha", candidate.route.transport))] = rounds(candidate)
        design[i, columns.index(("beta", ""))] = candidate.bytes_per_value * values
        if has_gamma(candidate):
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


#: The bench method each auto candidate is (the collective's candidates: exact is Gloo's all-reduce,
#: the 16-bit rings cerar's ring with a 16-bit wire).
AUTO_LABELS = {"exact": "builtin", "fp16": "ring-fp16", "bf16": "ring-bf16", "int8": "ring-int8", "fp8": "ring-fp8"}
#: The flat bench methods the model covers, and the row of the route table each runs.
_FLAT = tuple(
    name for name, route in ROUTES.items() if route.transport == "cerar" and not route.hierarchical and name != "auto"
)
_ROWS = {"builtin": "exact", **{m: m for m in _FLAT}}


def candidate_of(method: str, components: int | None, world_size: int) -> Candidate | None:
    """The bench method ``method`` (with ``c``) as a candidate of the model; None for the ones it
    does not cover (hierarchical, auto, CERAR without ``c``)."""
    route = get_route(_ROWS[method]) if method in _ROWS else None
    if route is None or (route.coded and components is None):
        return None
    return Candidate(method, route, world_size, components if route.coded else None)


def fit_regime(records: Iterable[dict[str, Any]], world_size: int) -> CostModel | None:
    """The model fitted to one regime's records (each its median time at its size)."""
    observations = []
    for record in records:
        candidate = candidate_of(record["method"], record["components"], world_size)
        if candidate is not None and record.get("ranks_per_node", 1) == 1:
            observations.append((candidate, record["size_bytes"] / 4.0, record["time_median_s"]))
    return fit_cost_model(observations)


def add_predictions(records: Sequence[dict[str, Any]], world_size: int) -> list[dict[str, Any]]:
    """Fill each record's ``predicted_s`` from its regime's fit (auto's: the method it chose);
    return the fits as ``[{"regime": ..., **model}]``."""
    fits = []
    for regime in sorted({r["regime"] for r in records}):
        rows = [r for r in records if r["regime"] == regime]
        model = fit_regime(rows, world_size)
        if model is None:
            continue
        fits.append({"regime": regime, **model.as_dict()})
        for record in rows:
            method, components = record["method"], record["components"]
            if record.get("auto"):
                name, _, c = record["auto"]["method"].partition(" c=")
                method, components = AUTO_LABELS.get(name, name), int(c) if c else None
            candidate = candidate_of(method, components, world_size)
            if candidate is not None and model.knows(candidate) and record.get("ranks_per_node", 1) == 1:
                record["predicted_s"] = model.predict(candidate, record["size_bytes"] / 4.0)
    return fits
