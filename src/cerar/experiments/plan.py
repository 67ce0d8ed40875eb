"""``cerar plan``: ``method="auto"``'s cost model fitted here, and the method it picks per size.

The model (:mod:`cerar.experiments.bench.model`) comes from a bench JSON (``cerar bench --json``) or a
short probe (:func:`probe`: ``cerar bench`` of builtin, ring-fp16, cerar and cerar-fp16 at
256K-4M, 2 timed calls each). :func:`plan_table` gives each candidate's predicted time per size
and the decision's choice (the smallest, CERAR only by the margin over the best exact/16-bit
ring), and where the choice changes. With a described cluster (:func:`cluster_model`) the same
is predicted, not measured, for ``N`` ranks, a link rate and a coding speed (bytes per second of
memory traffic, as ``benchmarks/gpu_check.py`` measures a device copy)::

    t = rounds x alpha + bytes sent per rank / rate + values x coding bytes per value / coding rate

with ``alpha`` fitted here unless ``latency`` is given, and the coding bytes per value the
coding's own memory traffic: 12 for a 16-bit ring (the casts down and back), and for CERAR
``4 (1 + L/c) + s_p + 8`` (``cerar.experiments.bench.limit``: the encode's reads and writes,
``L = c + N - 2`` rounds, the decode's packets of ``s_p`` bytes and the input and the result).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from cerar._checks import format_size
from cerar.comm.auto.candidates import CANDIDATE_NAMES, Candidate, build_candidates
from cerar.experiments.bench.model import AUTO_LABELS, CostModel, candidate_of, decide_slot, fit_regime, has_gamma

__all__ = [
    "PROBE_SIZES",
    "Plan",
    "cluster_model",
    "coding_bytes_per_value",
    "format_plan",
    "parse_coding_rate",
    "parse_latency",
    "plan_from_doc",
    "plan_table",
    "probe",
]

MiB = 1 << 20
PROBE_METHODS = ("builtin", "ring-fp16", "cerar", "cerar-fp16")
PROBE_SIZES = (MiB // 4, MiB, 4 * MiB)
TABLE_SIZES = tuple(1 << k for k in range(16, 29, 2))  # 64K .. 256M
GRID = tuple(1 << k for k in range(12, 31))  # 4K .. 1G, for the crossovers
FORMULA = "t = rounds x alpha[transport] + bytes sent per rank x beta + values x gamma[method]"
CLUSTER_FORMULA = "t = rounds x alpha + bytes sent per rank / rate + values x coding bytes per value / coding rate"


@dataclass
class Plan:
    """A model and the candidates it judges: ``model`` predicts a ``Candidate`` of the list
    ``modelled`` (bench labels), shown by the names in ``candidates`` (auto's)."""

    world_size: int
    source: str
    regime: str
    model: CostModel
    candidates: list[Candidate]
    modelled: list[Candidate]
    refused: list[Candidate] = field(default_factory=list)
    unmeasured: list[Candidate] = field(default_factory=list)
    predicted: bool = False
    formula: str = FORMULA


def probe(world_size: int, regime: str, rate: str) -> dict[str, Any]:
    """A short bench run (four methods, 256K-4M, 2 timed calls) in ``regime``: the model's data."""
    from cerar.experiments.bench.config import BenchConfig
    from cerar.experiments.bench.run import run_bench

    config = BenchConfig(
        world_size=world_size, sizes_bytes=PROBE_SIZES, methods=PROBE_METHODS, regimes=(regime,), rate=rate,
        iters=2, warmup=1,
    )  # fmt: skip
    return run_bench(config, progress=False, log=lambda text: None)


def plan_from_doc(doc: dict[str, Any], regime: str | None, max_error: float | None, source: str) -> Plan:
    """The model of ``doc``'s regime (default: slow if it ran, else fast) and auto's candidates
    for its ``N`` within ``max_error``, each mapped to the bench method it is."""
    regimes = sorted({r["regime"] for r in doc["results"]})
    regime = regime or ("slow" if "slow" in regimes else regimes[0] if regimes else "fast")
    if regime not in regimes:
        raise ValueError(f"Argument 'regime' must be one the bench ran ({', '.join(regimes)}), not {regime!r}.")
    n = int(doc["world_size"])
    model = fit_regime((r for r in doc["results"] if r["regime"] == regime), n)
    if model is None:
        raise ValueError(f"Argument 'from' holds no timed flat method in the {regime} regime to fit.")
    admitted, refused = build_candidates(n, max_error, CANDIDATE_NAMES, "collective")
    plan = Plan(n, source, regime, model, [], [], refused)
    for candidate in admitted:
        modelled = candidate_of(AUTO_LABELS.get(candidate.name, candidate.name), candidate.components, n)
        if modelled is not None and model.knows(modelled):
            plan.candidates.append(candidate)
            plan.modelled.append(modelled)
        else:
            plan.unmeasured.append(candidate)
    if not plan.candidates:
        raise ValueError("Argument 'from' measured none of auto's candidates (builtin, ring-fp16, cerar...).")
    return plan


def coding_bytes_per_value(candidate: Candidate) -> float:
    """The memory traffic of a candidate's coding per value (see the module doc)."""
    if not has_gamma(candidate) or (candidate.route.transport == "torch" and candidate.wire == "fp32"):
        return 0.0
    if candidate.components is None:
        return 12.0
    rounds = candidate.components + candidate.world_size - 2
    return 4.0 * (1 + rounds / candidate.components) + (4.0 if candidate.wire == "fp32" else 2.0) + 8.0


def cluster_model(
    plan: Plan, world_size: int, rate_bytes_per_s: float, coding_bytes_per_s: float, latency_s: float | None,
    max_error: float | None,
) -> Plan:  # fmt: skip
    """What the model predicts on a described cluster: ``N`` ranks, this link rate per rank, this
    coding speed, ``latency_s`` per round (None: the fitted ``alpha``); the candidates' codes
    are ``perturbed(N, 2N)`` (quick to build for a large ``N``)."""
    admitted, refused = build_candidates(world_size, max_error, CANDIDATE_NAMES, "collective", fast_codes=True)
    gamma = {c.label: coding_bytes_per_value(c) / coding_bytes_per_s for c in admitted if has_gamma(c)}
    model = plan.model.with_cluster(1.0 / rate_bytes_per_s, gamma, latency_s)
    missing = [t for t in ("torch", "cerar") if t not in model.alpha_s]
    if missing:
        model = model.with_cluster(alpha_s=max(model.alpha_s.values(), default=0.0))  # every transport
    source = f"a described cluster, N = {world_size} (predicted, not measured)"
    return Plan(world_size, source, plan.regime, model, admitted, admitted, refused, predicted=True,
                formula=CLUSTER_FORMULA)  # fmt: skip


def plan_table(plan: Plan, margin: float, sizes: Sequence[int] = TABLE_SIZES) -> dict[str, Any]:
    """Per size each candidate's predicted seconds and the choice; the ranges of each choice."""

    def choose(size: int) -> tuple[list[float], int, str]:
        times = [plan.model.predict(m, size / 4.0) for m in plan.modelled]
        choice = decide_slot(plan.modelled, times, margin=margin)
        return times, choice.candidate, choice.reason

    rows = []
    for size in sizes:
        times, chosen, reason = choose(size)
        rows.append({"size_bytes": size, "predicted_s": dict(zip(_labels(plan), times, strict=True)),
                     "choice": _labels(plan)[chosen], "reason": reason})  # fmt: skip
    ranges: list[dict[str, Any]] = []
    for size in GRID:
        label = _labels(plan)[choose(size)[1]]
        if ranges and ranges[-1]["choice"] == label:
            ranges[-1]["to_bytes"] = size
        else:
            ranges.append({"choice": label, "from_bytes": size, "to_bytes": size})
    return {"rows": rows, "ranges": ranges}


def format_plan(plan: Plan, table: dict[str, Any], margin: float, max_error: float | None) -> str:
    """The text ``cerar plan`` prints: the constants, the candidates, the table, the crossovers."""
    model = plan.model
    head = "PREDICTED (not measured) for " if plan.predicted else "fitted from "
    lines = [f"cerar plan: {head}{plan.source}, {plan.regime} regime model, N = {plan.world_size}", ""]
    lines.append(f"  {plan.formula}")
    alphas = ", ".join(f"{t} {a * 1e6:.1f} us" for t, a in model.alpha_s.items())
    bandwidth = f"{1e-6 / model.beta_s_per_byte:.1f} MB/s" if model.beta_s_per_byte > 0 else "-"
    lines.append(f"  alpha per round: {alphas}; beta: 1/beta = {bandwidth} per rank")
    gammas = ", ".join(f"{k} {g * 1e9:.3g} ns" for k, g in model.gamma_s_per_value.items())
    lines.append(f"  gamma per value: {gammas or '-'}   (fit over {model.points} sizes, worst misfit "
                 f"{model.max_rel_residual:.0%})" if not plan.predicted else f"  gamma per value: {gammas or '-'}")
    budget = "no limit" if max_error is None else f"{max_error:g}"
    admitted = ", ".join(f"{c.label} ({c.predicted_error:.1e})" for c in plan.candidates)
    lines += ["", f"  candidates within max_error {budget} (predicted worst-rank error): {admitted}"]
    if plan.refused:
        lines.append("  over the budget: " + ", ".join(f"{c.label} ({c.predicted_error:.1e})" for c in plan.refused))
    if plan.unmeasured:
        lines.append("  not measured (left out): " + ", ".join(c.label for c in plan.unmeasured))
    labels = _labels(plan)
    width = max(10, *(len(x) + 1 for x in labels))
    lines += ["", f"  {'size':>6}" + "".join(f"{x:>{width}}" for x in labels) + "   choice (ms predicted)"]
    for row in table["rows"]:
        cells = "".join(f"{row['predicted_s'][x] * 1e3:>{width}.3g}" for x in labels)
        lines.append(f"  {format_size(row['size_bytes']):>6}{cells}   {row['choice']} ({row['reason']})")
    spans = [f"{format_size(r['from_bytes'])}-{format_size(r['to_bytes'])}: {r['choice']}" for r in table["ranges"]]
    lines += ["", f"  choice by size (margin {margin:g} over the best exact/16-bit ring): " + "; ".join(spans)]
    return "\n".join(lines)


def _labels(plan: Plan) -> list[str]:
    return [c.label for c in plan.candidates]


_UNITS = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


def parse_coding_rate(text: str) -> float:
    """``"500GB/s"``, ``"2TB/s"``, ``"8.9e9"`` -> bytes per second (decimal units)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?(?:e[+-]?\d+)?)\s*([kmgt]?)(?:b(?:/s)?)?\s*", str(text), re.I)
    value = float(match.group(1)) * _UNITS[match.group(2).lower()] if match else math.nan
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"Argument 'coding_rate' must be a rate such as 500GB/s or 8.9e9, not {text!r}.")
    return value


def parse_latency(text: str) -> float:
    """``"20us"``, ``"0.5ms"``, ``"1e-5"`` (seconds) -> seconds per round."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?(?:e[+-]?\d+)?)\s*(us|ms|s)?\s*", str(text), re.I)
    scale = {None: 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6}
    value = float(match.group(1)) * scale[(match.group(2) or "s").lower()] if match else math.nan
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"Argument 'latency' must be a time per round such as 20us or 0.5ms, not {text!r}.")
    return value
