"""``cerar bench``: time all-reduce methods on a fast and a slow emulated network.

:func:`run_bench` launches ``world_size`` local ranks (:func:`cerar.harness.launch.launch`) once per
regime, each running :mod:`cerar.experiments.bench.worker` over every case (method x code x size), and
assembles the JSON document described in :mod:`cerar.experiments.bench.schema`: per-case records, the
alpha-beta fit of each series and the crossover size each fit predicts against the built-in
all-reduce, checked against the measurement.

The pieces: :mod:`cerar.experiments.bench.methods` (what is compared), :mod:`cerar.experiments.bench.stats` (the
arithmetic), :mod:`cerar.experiments.bench.schema` (the records), :mod:`cerar.experiments.bench.report` (table, plots).
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from cerar.coding import codes
from cerar.coding.linear_code import Code
from cerar.experiments.bench.config import (
    DEFAULT_SIZES,
    QUICK_SIZES,
    REGIME_CHOICES,
    BenchConfig,
    format_size,
    parse_size,
)
from cerar.experiments.bench.methods import ALL_REDUCE_METHODS, BASELINE, get_method
from cerar.experiments.bench.model import add_predictions
from cerar.experiments.bench.schema import SCHEMA_VERSION, add_ratios, machine_info, make_record, versions
from cerar.experiments.bench.stats import crossover, fit_alpha_beta, measured_crossover
from cerar.harness import netem
from cerar.harness.launch import LaunchError, launch

CONSTRUCTIONS = tuple(codes.CONSTRUCTIONS)
# Re-exported: the command and the tests import the settings from here with the runner.
__all__ = [
    "CONSTRUCTIONS",
    "DEFAULT_SIZES",
    "QUICK_SIZES",
    "REGIME_CHOICES",
    "BenchConfig",
    "analyse",
    "build_cases",
    "format_size",
    "json_safe",
    "make_code",
    "parse_size",
    "run_bench",
]

Log = Callable[[str], None]


def make_code(world_size: int, components: int, construction: str, precision: str = "fp32") -> Code:
    """The code a ``cerar`` series uses, tuned for its packet precision."""
    return codes.build(construction, world_size, components, precision)


def build_cases(config: BenchConfig) -> list[dict[str, Any]]:
    """Every (size, method, code) case, sorted by size so a worker builds each input once."""
    series: list[dict[str, Any]] = []
    for name in config.methods:
        method = get_method(name)
        if not method.coded:
            series.append({"method": name, "components": None, "construction": None, "code": None})
            if "max_error" in method.options:
                series[-1]["max_error"] = config.auto_max_error
            continue
        for construction in config.constructions:
            for c in config.components or ():
                # Hierarchical methods run CERAR between the M nodes: their code is for M.
                nodes = method.ring_size(config.world_size, config.ranks_per_node)
                code = make_code(nodes, c, construction, method.packet_precision)
                series.append(
                    {
                        "method": name,
                        "components": c,
                        "construction": construction,
                        "code": code.to_dict(),
                        "code_params": dict(code.params),
                    }
                )
    return [
        {**s, "size_bytes": size, "iters": config.iterations_for(size)} for size in config.sizes_bytes for s in series
    ]


def estimate_timeout_s(cases: Sequence[dict[str, Any]], config: BenchConfig, regime: str) -> float:
    """A limit no healthy run gets near: 4x a pessimistic per-iteration time, plus startup."""
    if config.timeout_s is not None:
        return config.timeout_s
    bandwidth = netem.rate_bytes_per_s(config.rate) if regime == "slow" else 25e6
    total = 120.0
    for case in cases:
        calls = config.warmup + case["iters"] + 1
        calls += 25 if get_method(case["method"]).calibrating is not None else 0  # auto's trials
        total += calls * (0.5 + 4.0 * 2.0 * case["size_bytes"] / bandwidth)
    return total


def run_bench(config: BenchConfig, *, progress: bool = True, log: Log | None = None) -> dict[str, Any]:
    """Run every regime of ``config`` and return the JSON document (see :mod:`cerar.experiments.bench.schema`).

    A regime whose ranks fail keeps the records it finished; its ``error`` says what failed.
    ``slow`` on a machine without root, ``ip`` or ``tc`` is skipped with a message via ``log``.
    """
    say = log or (lambda text: print(text, file=sys.stderr))
    config, regimes, notes = _runnable(config, say)
    cases = build_cases(config)
    load_before = _load_average()
    ticks = sum(config.warmup + case["iters"] + 1 for case in cases)
    bar = _progress_bar(ticks * len(regimes), progress)
    records: list[dict[str, Any]] = []
    regime_info: dict[str, Any] = {}
    try:
        for index, regime in enumerate(regimes):
            info, raws = _run_regime(regime, cases, config, bar, index * ticks)
            regime_info[regime] = info
            records += [
                make_record(raw, regime, config.world_size, info["link_rate_bytes_per_s"], config.ranks_per_node)
                for raw in raws
            ]
            if info["error"]:
                say(f"cerar bench: {regime} regime failed: {info['error']}")
    finally:
        if bar is not None:
            bar.close()
    add_ratios(records, BASELINE)
    fits, crossovers = analyse(records, config.world_size, config.ranks_per_node)
    model = add_predictions(records, config.world_size)
    slow = regime_info.get("slow", {})
    return {
        "schema_version": SCHEMA_VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {
            **machine_info(),
            "load_average_before": load_before,
            "load_average_after": _load_average(),
        },
        "versions": versions(),
        "settings": {
            **{k: v for k, v in asdict(config).items() if k != "extra"},
            "regimes": regimes,
            "inputs": "i.i.d. standard normal float32, one seed per rank",
            "timing": "per iteration the slowest rank's time, barrier before each; median/min/max",
        },
        "world_size": config.world_size,
        "nodes": config.nodes,
        "ranks_per_node": config.ranks_per_node,
        "link_rate_bytes_per_s": slow.get("link_rate_bytes_per_s"),
        "regimes": regime_info,
        "notes": notes,
        "results": records,
        "fits": fits,
        "crossovers": crossovers,
        "model": model,
    }


def _runnable(config: BenchConfig, say: Log) -> tuple[BenchConfig, list[str], list[str]]:
    """What this machine can run of ``config``: the config without the methods whose code is
    not installed, the regimes (``slow`` needs root, ``ip`` and ``tc``), and notes for the
    document on what was left out."""
    methods = []
    for name in config.methods:
        if get_method(name).available():
            methods.append(name)
        else:
            say(f"cerar bench: method {name!r} needs {get_method(name).requires}, not installed: skipped")
    regimes = list(config.regimes)
    notes: list[str] = []
    if "slow" in regimes:
        reason = netem.unavailable_reason()
        if reason is not None:
            message = f"slow regime unavailable: {reason}; running fast only"
            say(f"cerar bench: {message}")
            notes.append(message)
            regimes = [r for r in regimes if r != "slow"] or ["fast"]
    return replace(config, methods=tuple(methods)), regimes, notes


def _load_average() -> list[float] | None:
    # The machine may be shared: the load next to the numbers says how much to trust them.
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except (OSError, AttributeError):
        return None


def _progress_bar(total: int, enabled: bool) -> Any:
    if not enabled:
        return None
    from cerar.experiments._extras import require

    tqdm = require("tqdm", "bench").tqdm
    return tqdm(total=total, desc="cerar bench", unit="it", file=sys.stderr, dynamic_ncols=True)


def _run_regime(
    regime: str, cases: list[dict[str, Any]], config: BenchConfig, bar: Any, offset: int
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Launch the ranks for one regime; return its info and the raw records it produced."""
    from cerar.experiments.bench.worker import PROGRESS_KIND
    from cerar.harness.progress import parse_progress

    def on_line(rank: int, stream: str, line: str) -> None:
        progress = parse_progress(line, PROGRESS_KIND) if bar is not None and stream == "stdout" else None
        if progress is None:
            return
        bar.n = offset + progress.done
        bar.set_postfix_str(f"{regime} {progress.detail}", refresh=False)
        bar.refresh()

    info: dict[str, Any] = {
        "rate": None,
        "delay": None,
        "congestion_control": None,
        "link_rate_bytes_per_s": None,
        "error": None,
        "launcher": config.launcher,
    }
    with tempfile.TemporaryDirectory(prefix="cerar-bench-") as tmp:
        out = Path(tmp) / "records.json"
        cfg = Path(tmp) / "config.json"
        worker_config = {
            "world_size": config.world_size,
            "ranks_per_node": config.ranks_per_node,
            "seed": config.seed,
            "warmup": config.warmup,
            "iters": config.iters,
            "out": str(out),
            "cases": cases,
        }
        cfg.write_text(json.dumps(worker_config))
        started = time.perf_counter()
        try:
            result = launch(
                [sys.executable, "-m", "cerar.experiments.bench.worker", str(cfg)],
                config.world_size,
                regime=regime,
                rate=config.rate,
                delay=config.delay,
                timeout_s=estimate_timeout_s(cases, config, regime),
                on_line=on_line,
                ranks_per_node=config.ranks_per_node,
                launcher=config.launcher,
                rdzv=config.rdzv,
            )
            info.update(link_rate_bytes_per_s=result.link_rate_bytes_per_s)
            if regime == "slow":
                info.update(
                    rate=config.rate,
                    delay=config.delay,
                    congestion_control=result.congestion_control,
                    nominal_rate_bytes_per_s=netem.rate_bytes_per_s(config.rate),
                )
        except LaunchError as exc:
            info["error"] = str(exc)
        info["wall_s"] = time.perf_counter() - started
        raws = json.loads(out.read_text()) if out.exists() else []
    return info, raws


def series_key(record: dict[str, Any]) -> tuple[Any, ...]:
    return (record["regime"], record["method"], record["components"], record["construction"])


def series_label(record: dict[str, Any], with_construction: bool = False) -> str:
    """``"builtin"``, ``"ring"``, ``"cerar c=8"`` (with the construction when several ran)."""
    label = record["method"]
    if record["components"] is not None:
        label += f" c={record['components']}"
        if with_construction and record["construction"]:
            label += f" {record['construction']}"
    return label


def analyse(records: list[dict[str, Any]], world_size: int, ranks_per_node: int = 1) -> tuple[list[dict], list[dict]]:
    """Alpha-beta fit per series and, per non-baseline series, the predicted crossover size
    against the baseline with the sizes where prediction and measurement agree."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for record in records:
        groups.setdefault(series_key(record), []).append(record)
    fitted: dict[tuple[Any, ...], Any] = {}
    fits: list[dict[str, Any]] = []
    for key, rows in groups.items():
        rows.sort(key=lambda r: r["size_bytes"])
        method = ALL_REDUCE_METHODS[key[1]]
        if method.calibrating is not None:
            continue  # auto is another method at each size: its fit is its choices
        fit = fit_alpha_beta(
            [r["size_bytes"] for r in rows],
            [r["bytes_sent_per_rank"] for r in rows],
            [r["time_median_s"] for r in rows],
            method.rounds(method.ring_size(world_size, ranks_per_node), key[2]),
        )
        fitted[key] = fit
        if fit is not None:
            fits.append(
                {
                    "regime": key[0],
                    "method": key[1],
                    "components": key[2],
                    "construction": key[3],
                    **fit.as_dict(),
                }
            )
    crossovers: list[dict[str, Any]] = []
    for key, fit in fitted.items():
        base = fitted.get((key[0], BASELINE, None, None))
        if key[1] == BASELINE or fit is None or base is None:
            continue
        predicted = crossover(fit, base)
        base_rows = {r["size_bytes"]: r for r in groups[(key[0], BASELINE, None, None)]}
        sizes, faster, agree = [], [], 0
        for row in groups[key]:
            ref = base_rows.get(row["size_bytes"])
            if ref is None:
                continue
            win = row["time_median_s"] < ref["time_median_s"]
            sizes.append(row["size_bytes"])
            faster.append(win)
            agree += int(win == predicted.predicts_faster(row["size_bytes"]))
        crossovers.append(
            {
                "regime": key[0],
                "method": key[1],
                "components": key[2],
                "construction": key[3],
                "predicted_wins": predicted.wins,
                "predicted_crossover_bytes": predicted.size_bytes,
                "measured_crossover_bytes": measured_crossover(sizes, faster),
                "measured_faster_sizes": [s for s, w in zip(sizes, faster, strict=True) if w],
                "sizes_agreeing": agree,
                "sizes_compared": len(sizes),
            }
        )
    return fits, crossovers


def json_safe(value: Any) -> Any:
    """``value`` with every NaN/Inf float replaced by ``None`` (JSON has no such numbers)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value
