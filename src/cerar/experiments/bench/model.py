"""``method="auto"``'s cost model (:mod:`cerar.comm.auto.model`) fitted to a bench run: each flat
method is one :class:`cerar.comm.auto.candidates.Candidate`, every regime one fit, and every
record gets its prediction beside its measurement (the validation of the model)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from cerar.comm.auto.candidates import Candidate
from cerar.comm.auto.model import CostModel, fit_cost_model
from cerar.comm.collective.routes import get_route

__all__ = ["AUTO_LABELS", "add_predictions", "candidate_of", "fit_regime"]

#: The bench method each auto candidate is (the collective's candidates: exact is Gloo's all-reduce,
#: the 16-bit rings cerar's ring with a 16-bit wire).
AUTO_LABELS = {"exact": "builtin", "fp16": "ring-fp16", "bf16": "ring-bf16"}
#: The flat bench methods the model covers, and the row of the route table each runs.
_ROWS = {"builtin": "exact", **{m: m for m in ("ring", "ring-fp16", "ring-bf16", "cerar", "cerar-fp16", "cerar-bf16")}}


def candidate_of(method: str, components: int | None, world_size: int) -> Candidate | None:
    """The bench method ``method`` (with ``c``) as a candidate of the model; None for the ones it
    does not cover (hierarchical, auto, the 8-bit rings, CERAR without ``c``)."""
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
