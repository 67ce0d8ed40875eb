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
import re
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from cerar._checks import check_choice, check_float, check_int
from cerar.coding import codes
from cerar.coding.code import Code
from cerar.experiments.bench.methods import BASELINE, METHODS, get_method
from cerar.experiments.bench.schema import SCHEMA_VERSION, add_ratios, machine_info, make_record, versions
from cerar.experiments.bench.stats import crossover, fit_alpha_beta, measured_crossover
from cerar.harness import netem
from cerar.harness.launch import DEFAULT_RATE, LaunchError, launch

CONSTRUCTIONS = ("perturbed", "vandermonde", "exact", "optimized")
REGIME_CHOICES = ("fast", "slow", "both")
MiB = 1 << 20
DEFAULT_SIZES = (1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB)
QUICK_SIZES = (64 << 10, 256 << 10)
_SIZE_PATTERN = re.compile(r"^(\d+(?:\.\d+)?)\s*([kmg]?)(i?b?)$", re.I)

Log = Callable[[str], None]


@dataclass
class BenchConfig:
    """What to measure. ``components=None`` means ``(N, 2N)``; sizes are bytes of float32.

    ``regimes`` lists ``"fast"`` and/or ``"slow"``; ``timeout_s=None`` sizes the limit of each
    regime's run from the cases (generously: it only exists to stop a hung run).
    """

    world_size: int = 4
    sizes_bytes: tuple[int, ...] = DEFAULT_SIZES
    components: tuple[int, ...] | None = None
    constructions: tuple[str, ...] = ("perturbed",)
    methods: tuple[str, ...] = ("builtin", "ring", "ring-fp16", "ring-bf16", "cerar")
    regimes: tuple[str, ...] = ("fast", "slow")
    rate: str = DEFAULT_RATE
    delay: str = "0ms"
    iters: int = 5
    warmup: int = 1
    seed: int = 0
    timeout_s: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def validated(self) -> BenchConfig:
        """Check every field; return ``self`` with ``components`` filled in."""
        n = check_int("world_size", self.world_size, minimum=2)
        if not self.sizes_bytes:
            raise ValueError("Argument 'sizes' must list at least one size, not ().")
        for size in self.sizes_bytes:
            check_int("sizes", size, minimum=4)
            if size % 4:
                raise ValueError(f"Argument 'sizes' must be multiples of 4 bytes (float32), not {size}.")
        comps = self.components if self.components is not None else (n, 2 * n)
        for c in comps:
            check_int("components", c, minimum=1)
        for name in self.constructions:
            check_choice("construction", name, CONSTRUCTIONS)
            if name == "exact" and any(c != n for c in comps):
                raise ValueError(
                    f"Argument 'components' must equal world_size ({n}) for construction 'exact', not {list(comps)}."
                )
        for name in self.methods:
            get_method(name)
        if BASELINE not in self.methods:
            raise ValueError(f"Argument 'methods' must include the baseline {BASELINE!r}, not {self.methods}.")
        if not self.regimes:
            raise ValueError("Argument 'regime' must name at least one regime, not ().")
        for regime in self.regimes:
            check_choice("regime", regime, ("fast", "slow"))
        netem.check_rate(self.rate)
        netem.check_delay(self.delay)
        check_int("iters", self.iters, minimum=1)
        check_int("warmup", self.warmup, minimum=0)
        check_int("seed", self.seed, minimum=0)
        if self.timeout_s is not None:
            check_float("timeout_s", self.timeout_s, positive=True)
        self.components = tuple(dict.fromkeys(comps))
        self.sizes_bytes = tuple(sorted(set(self.sizes_bytes)))
        return self


def parse_size(text: str) -> int:
    """``"4M"``, ``"64K"``, ``"1MiB"``, ``"1048576"`` -> bytes (K, M, G are powers of 1024)."""
    match = _SIZE_PATTERN.match(text.strip()) if isinstance(text, str) else None
    if match is None:
        raise ValueError(f"Argument 'sizes' must be sizes such as 64K, 1M, 16M or 1048576, not {text!r}.")
    scale = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[match.group(2).lower()]
    value = float(match.group(1)) * scale
    if value != int(value):
        raise ValueError(f"Argument 'sizes' must be a whole number of bytes, not {text!r}.")
    return int(value)


def format_size(size_bytes: float) -> str:
    """``1048576`` -> ``"1M"``; ``65536`` -> ``"64K"`` (powers of 1024, as parsed)."""
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if size_bytes >= scale:
            value = size_bytes / scale
            return f"{value:g}{unit}" if value == int(value) else f"{value:.3g}{unit}"
    return f"{int(size_bytes)}B"


def make_code(world_size: int, components: int, construction: str) -> Code:
    """The code a ``cerar`` series uses (tuned for float32 packets)."""
    if construction == "exact":
        return codes.exact(world_size)
    if construction == "vandermonde":
        return codes.vandermonde(world_size, components)
    if construction == "optimized":
        optimized = getattr(codes, "optimized", None)
        if optimized is None:
            raise ValueError("Argument 'construction' 'optimized' is not available in this version of cerar.")
        return optimized(world_size, components, "fp32")
    return codes.perturbed(world_size, components)


def build_cases(config: BenchConfig) -> list[dict[str, Any]]:
    """Every (size, method, code) case, sorted by size so a worker builds each input once."""
    series: list[dict[str, Any]] = []
    for name in config.methods:
        method = get_method(name)
        if not method.coded:
            series.append({"method": name, "components": None, "construction": None, "code": None})
            continue
        for construction in config.constructions:
            for c in config.components or ():
                code = make_code(config.world_size, c, construction)
                series.append(
                    {
                        "method": name,
                        "components": c,
                        "construction": construction,
                        "code": code.to_dict(),
                        "code_params": dict(code.params),
                    }
                )
    return [{**s, "size_bytes": size} for size in config.sizes_bytes for s in series]


def estimate_timeout_s(cases: Sequence[dict[str, Any]], config: BenchConfig, regime: str) -> float:
    """A limit no healthy run gets near: 4x a pessimistic per-iteration time, plus startup."""
    if config.timeout_s is not None:
        return config.timeout_s
    bandwidth = netem.rate_bytes_per_s(config.rate) if regime == "slow" else 25e6
    per_case = config.warmup + config.iters + 1
    total = 120.0
    for case in cases:
        total += per_case * (0.5 + 4.0 * 2.0 * case["size_bytes"] / bandwidth)
    return total


def run_bench(config: BenchConfig, *, progress: bool = True, log: Log | None = None) -> dict[str, Any]:
    """Run every regime of ``config`` and return the JSON document (see :mod:`cerar.experiments.bench.schema`).

    A regime whose ranks fail keeps the records it finished; its ``error`` says what failed.
    ``slow`` on a machine without root, ``ip`` or ``tc`` is skipped with a message via ``log``.
    """
    config = config.validated()
    say = log or (lambda text: print(text, file=sys.stderr))
    methods = []
    for name in config.methods:
        if get_method(name).available():
            methods.append(name)
        else:
            say(f"cerar bench: method {name!r} needs {get_method(name).requires}, not installed: skipped")
    config.methods = tuple(methods)
    regimes = list(config.regimes)
    notes: list[str] = []
    if "slow" in regimes:
        reason = netem.unavailable_reason()
        if reason is not None:
            message = f"slow regime unavailable: {reason}; running fast only"
            say(f"cerar bench: {message}")
            notes.append(message)
            regimes = [r for r in regimes if r != "slow"] or ["fast"]
    cases = build_cases(config)
    load_before = _load_average()
    ticks = (config.warmup + config.iters + 1) * len(cases)
    bar = _progress_bar(ticks * len(regimes), progress)
    records: list[dict[str, Any]] = []
    regime_info: dict[str, Any] = {}
    try:
        for index, regime in enumerate(regimes):
            info, raws = _run_regime(regime, cases, config, bar, index * ticks)
            regime_info[regime] = info
            records += [make_record(raw, regime, config.world_size, info["link_rate_bytes_per_s"]) for raw in raws]
            if info["error"]:
                say(f"cerar bench: {regime} regime failed: {info['error']}")
    finally:
        if bar is not None:
            bar.close()
    add_ratios(records, BASELINE)
    fits, crossovers = analyse(records, config.world_size)
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
        "link_rate_bytes_per_s": slow.get("link_rate_bytes_per_s"),
        "regimes": regime_info,
        "notes": notes,
        "results": records,
        "fits": fits,
        "crossovers": crossovers,
    }


def _load_average() -> list[float] | None:
    # The machine may be shared: the load next to the numbers says how much to trust them.
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except (OSError, AttributeError):
        return None


def _progress_bar(total: int, enabled: bool) -> Any:
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="cerar bench", unit="it", file=sys.stderr, dynamic_ncols=True)


def _run_regime(
    regime: str, cases: list[dict[str, Any]], config: BenchConfig, bar: Any, offset: int
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Launch the ranks for one regime; return its info and the raw records it produced."""
    from cerar.experiments.bench.worker import PROGRESS

    def on_line(rank: int, stream: str, line: str) -> None:
        if bar is None or not line.startswith(PROGRESS):
            return
        done, _total, *label = line[len(PROGRESS) :].split()
        bar.n = offset + int(done)
        bar.set_postfix_str(f"{regime} {' '.join(label)}", refresh=False)
        bar.refresh()

    info: dict[str, Any] = {"rate": None, "delay": None, "link_rate_bytes_per_s": None, "error": None}
    with tempfile.TemporaryDirectory(prefix="cerar-bench-") as tmp:
        out = Path(tmp) / "records.json"
        cfg = Path(tmp) / "config.json"
        worker_config = {
            "world_size": config.world_size,
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
            )
            info.update(link_rate_bytes_per_s=result.link_rate_bytes_per_s)
            if regime == "slow":
                info.update(
                    rate=config.rate,
                    delay=config.delay,
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


def analyse(records: list[dict[str, Any]], world_size: int) -> tuple[list[dict], list[dict]]:
    """Alpha-beta fit per series and, per non-baseline series, the predicted crossover size
    against the baseline with the sizes where prediction and measurement agree."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for record in records:
        groups.setdefault(series_key(record), []).append(record)
    fitted: dict[tuple[Any, ...], Any] = {}
    fits: list[dict[str, Any]] = []
    for key, rows in groups.items():
        rows.sort(key=lambda r: r["size_bytes"])
        method = METHODS[key[1]]
        fit = fit_alpha_beta(
            [r["size_bytes"] for r in rows],
            [r["bytes_sent_per_rank"] for r in rows],
            [r["time_median_s"] for r in rows],
            method.rounds(world_size, key[2]),
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
