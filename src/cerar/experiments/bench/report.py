"""How ``cerar bench`` shows its document: the terminal table and the two PNG plots."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cerar.experiments._extras import pyplot
from cerar.experiments.bench.config import format_size
from cerar.experiments.bench.run import series_key, series_label


def _ms(seconds: float | None) -> str:
    """Milliseconds, three significant digits, never in exponent form."""
    if seconds is None:
        return "-"
    ms = seconds * 1e3
    return f"{ms:.0f}" if ms >= 100 else f"{ms:.3g}"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def format_table(doc: dict[str, Any]) -> str:
    """One block per regime: every size and method, times, bandwidths, ratios, bytes, errors."""
    lines: list[str] = []
    n = doc["world_size"]
    several = len({r["construction"] for r in doc["results"] if r["construction"]}) > 1
    for regime, info in doc.get("regimes", {}).items():
        rows = [r for r in doc["results"] if r["regime"] == regime]
        head = f"{regime} regime, N = {n}"
        if regime == "slow":
            rate = info.get("link_rate_bytes_per_s")
            measured = f"{rate / 1e6:.1f} MB/s measured" if rate else "not measured"
            head += f", link {info.get('rate')} ({measured}), delay {info.get('delay')}"
            if info.get("congestion_control"):
                head += f", TCP {info['congestion_control']}"
        else:
            head += ", loopback, unlimited"
        lines += [head, ""]
        header = (
            f"  {'size':>5}  {'method':<24} {'time ms':>8} {'pred ms':>8} {'[min..max]':>17} {'busbw MB/s':>10} "
            f"{'x builtin':>9} {'x theory':>8} {'MB/rank':>8} {'x wire':>6} {'enc ms':>7} {'dec ms':>7} "
            f"{'x limit':>9} {'worst err':>9}"
        )
        lines += [header, "  " + "-" * (len(header) - 2)]
        last_size = None
        for r in sorted(rows, key=lambda r: (r["size_bytes"], series_key(r)[1:] != ("builtin", None, None))):
            size = format_size(r["size_bytes"]) if r["size_bytes"] != last_size else ""
            last_size = r["size_bytes"]
            spread = f"[{_ms(r['time_min_s'])}..{_ms(r['time_max_s'])}]"
            wire = r["time_median_s"] / r["wire_limit_s"] if r.get("wire_limit_s") else None
            wire_text = "-" if wire is None else f"{wire:.2f}"
            limit = r.get("coding_limit_ratio")
            cpu = r.get("coding_cpu_limit_ratio")
            limit_text = "-" if limit is None else f"{limit:.1f}" + ("" if cpu is None else f"/{cpu:.1f}")
            label = series_label(r, several) + (f" -> {r['auto']['method']}" if r.get("auto") else "")
            lines.append(
                f"  {size:>5}  {label:<24} {_ms(r['time_median_s']):>8} {_ms(r.get('predicted_s')):>8} {spread:>17} "
                f"{r['busbw_bytes_per_s'] / 1e6:>10.1f} {_ratio(r['ratio_to_builtin']):>9} "
                f"{_ratio(r['theory_ratio_to_builtin']):>8} {r['bytes_sent_per_rank'] / 1e6:>8.2f} "
                f"{wire_text:>6} {_ms(r['encode_s']):>7} {_ms(r['decode_s']):>7} {limit_text:>9} "
                f"{r['worst_rel_error']:>9.2g}"
            )
        if info.get("error"):
            lines += ["", f"  FAILED: {info['error'].splitlines()[0]}"]
        lines += _model_lines(doc, regime)
        lines.append("")
    lines += [
        "time: median over iterations of the slowest rank (a size's methods take turns, one call each per",
        "iteration); x builtin: time / builtin's; x theory: bytes /",
        "builtin's bytes, (1+(N-2)/c)/(2(N-1)/N) for cerar; MB/rank: sent per rank (transport; theory for",
        "builtin); x wire: time / (MB per rank / measured link rate); worst err: max over ranks of",
        "||result - exact sum|| / ||exact sum||; x limit: (enc + dec) / the bytes the coding must move at",
        "the slowest rank's measured copy rate (cerar.experiments.bench.limit), then the coding thread's CPU",
        "time in them / the same (the rest is time it waited for a core). The bytes per value: cerar",
        "4(1 + L/c) + p + 8 (L = c+N-2 rounds, p the packet's bytes); a lossy ring's codec (16-bit, int8,",
        "fp8, int4 wires; enc: round 1 and the reduce-scatter hops, dec: the all-gather's packets) 8 +",
        "w(3 - 2/N), w the wire's bytes with its scales: the input read and the result written once, N",
        "packets written and 2(N-1) read (hier rows: M nodes, on each rank's 1/G shard); the exact rows",
        "have none (-). alpha*: the free fit gave a negative latency (bandwidth-bound sweep); refitted",
        "with alpha = 0. pred ms: auto's cost model (rounds x alpha + bytes/rank x beta + values x gamma,",
        "one fit per regime over every method); auto -> the method auto chose at that size (its",
        "calibration calls are not timed).",
    ]
    m = doc.get("machine", {})
    if m:
        lines.append(
            f"machine: {m.get('cpu_model')}, {m.get('usable_cpus')} cpus, load average before "
            f"{m.get('load_average_before')} after {m.get('load_average_after')}"
        )
    coding = doc.get("versions", {}).get("cpu_coding")
    if coding:
        lines.append(f"CPU coding (cerar.comm.algorithms.native): {coding}")
    for note in doc.get("notes", []):
        lines.append(f"note: {note}")
    return "\n".join(lines)


def _model_lines(doc: dict[str, Any], regime: str) -> list[str]:
    fits = [f for f in doc.get("fits", []) if f["regime"] == regime]
    if not fits:
        return []
    several = len({f["construction"] for f in fits if f["construction"]}) > 1
    out = []
    for model in (m for m in doc.get("model", []) if m["regime"] == regime):
        alphas = ", ".join(f"{t} {a * 1e6:.0f}" for t, a in model["alpha_s_per_round"].items())
        gammas = ", ".join(f"{k} {g * 1e9:.2f}" for k, g in model["gamma_s_per_value"].items())
        bandwidth = model["bandwidth_bytes_per_s"]
        out += [
            "",
            f"  auto's cost model  {model['formula']}  (worst misfit {model['max_rel_residual']:.0%})",
            f"    alpha us/round: {alphas}; 1/beta {'-' if bandwidth is None else f'{bandwidth / 1e6:.1f}'} MB/s;"
            f" gamma ns/value: {gammas or '-'}",
        ]
    out += ["", "  alpha-beta model  t = rounds x alpha + bytes/rank x beta"]
    for f in fits:
        bw = f["bandwidth_bytes_per_s"]
        star = "*" if f.get("alpha_clamped") else " "
        out.append(
            f"    {series_label(f, several):<16} alpha {f['alpha_s'] * 1e6:>8.1f}{star} us/round   1/beta "
            f"{'-' if bw is None else f'{bw / 1e6:.1f}':>7} MB/s   (rounds {f['rounds']}, worst misfit "
            f"{f['max_rel_residual']:.0%})"
        )
    for x in (x for x in doc.get("crossovers", []) if x["regime"] == regime):
        predicted = {
            "above": f"faster above {format_size(x['predicted_crossover_bytes'] or 0)}",
            "below": f"faster below {format_size(x['predicted_crossover_bytes'] or 0)}",
            "always": "faster at every size",
            "never": "never faster",
        }[x["predicted_wins"]]
        measured = x["measured_crossover_bytes"]
        seen = f"faster from {format_size(measured)} up" if measured is not None else "not faster at the top size"
        out.append(
            f"    {series_label(x, several):<16} vs builtin: model says {predicted}; measured {seen} "
            f"({x['sizes_agreeing']}/{x['sizes_compared']} sizes agree)"
        )
    return out


def plot(doc: dict[str, Any], out_dir: str | Path) -> list[Path]:
    """Write ``time_vs_size.png``, ``ratio_vs_theory.png`` and ``bytes_vs_error.png``; return
    their paths."""
    plt = pyplot("bench", needed_by="cerar bench's plots")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    title = _title(doc)
    return [
        _per_regime(doc, out / "time_vs_size.png", plt, _draw_times, "all-reduce time (s, median; bars min..max)", 8),
        _per_regime(doc, out / "ratio_vs_theory.png", plt, _draw_ratios, "time / builtin time", 7),
        _plot_bytes_vs_error(doc, out, title, plt),
    ]


def _per_regime(doc: dict[str, Any], path: Path, plt: Any, draw: Any, ylabel: str, legend_size: int) -> Path:
    """One figure, a panel per regime: ``draw(ax, doc, regime)`` plots the series, the rest
    (size axis, labels, grid, legend, title) is the same for every figure."""
    regimes = list(doc.get("regimes", {})) or sorted({r["regime"] for r in doc["results"]})
    fig, axes = plt.subplots(1, len(regimes), figsize=(6 * len(regimes), 4.5), squeeze=False)
    for ax, regime in zip(axes[0], regimes, strict=True):
        draw(ax, doc, regime)
        _size_axis(ax, doc)
        ax.set_ylabel(ylabel)
        ax.set_title(_regime_title(doc, regime))
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=legend_size)
    fig.suptitle(_title(doc), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _draw_times(ax: Any, doc: dict[str, Any], regime: str) -> None:
    """Median time against size per series, min..max as error bars, log-log."""
    for label, rows in _series(doc, regime):
        sizes = [r["size_bytes"] for r in rows]
        med = [r["time_median_s"] for r in rows]
        err = [
            [m - r["time_min_s"] for m, r in zip(med, rows, strict=True)],
            [r["time_max_s"] - m for m, r in zip(med, rows, strict=True)],
        ]
        ax.errorbar(sizes, med, yerr=err, marker="o", capsize=3, label=label)
    ax.set_yscale("log")


def _draw_ratios(ax: Any, doc: dict[str, Any], regime: str) -> None:
    """Each series' time over builtin's against size, beside its byte theory (dashed)."""
    for label, rows in _series(doc, regime):
        if rows[0]["method"] == "builtin":
            continue
        rows = [r for r in rows if r["ratio_to_builtin"] is not None]
        if not rows:
            continue
        sizes = [r["size_bytes"] for r in rows]
        (line,) = ax.plot(sizes, [r["ratio_to_builtin"] for r in rows], marker="o", label=f"{label} measured")
        theory = rows[0]["theory_ratio_to_builtin"]
        ax.axhline(
            theory, color=line.get_color(), linestyle="--", linewidth=1, label=f"{label} byte theory {theory:.3f}"
        )
    ax.axhline(1.0, color="black", linewidth=0.8)


def _plot_bytes_vs_error(doc: dict[str, Any], out: Path, title: str, plt: Any) -> Path:
    """Bytes sent per element vs worst-rank error, one point per method at the largest size:
    what each method buys with its bytes."""
    largest = max(r["size_bytes"] for r in doc["results"])
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    seen: set[str] = set()
    several = len({r["construction"] for r in doc["results"] if r["construction"]}) > 1
    for r in doc["results"]:
        label = series_label(r, several)
        if r["size_bytes"] != largest or label in seen or r.get("worst_rel_error") is None:
            continue
        seen.add(label)
        per_element = r["bytes_sent_per_rank"] / (r["size_bytes"] / 4.0)
        ax.scatter(per_element, max(r["worst_rel_error"], 1e-9), s=40)
        ax.annotate(
            label, (per_element, max(r["worst_rel_error"], 1e-9)), fontsize=8, xytext=(4, 4), textcoords="offset points"
        )
    ax.set_yscale("log")
    ax.set_xlabel("bytes sent per element per rank")
    ax.set_ylabel("worst-rank relative error (i.i.d. normal inputs)")
    ax.set_title(f"the trade-off at {format_size(largest)}: bytes vs error", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    path = out / "bytes_vs_error.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _size_axis(ax: Any, doc: dict[str, Any]) -> None:
    """Log-2 size axis labelled with the measured sizes (1M, 4M, ...)."""
    sizes = sorted({r["size_bytes"] for r in doc["results"]})
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes)
    ax.set_xticklabels([format_size(s) for s in sizes])
    ax.minorticks_off()
    ax.set_xlabel("message size (bytes of float32)")


def _series(doc: dict[str, Any], regime: str) -> Sequence[tuple[str, list[dict[str, Any]]]]:
    several = len({r["construction"] for r in doc["results"] if r["construction"]}) > 1
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for r in doc["results"]:
        if r["regime"] == regime:
            groups.setdefault(series_key(r), []).append(r)
    return [(series_label(rows[0], several), sorted(rows, key=lambda r: r["size_bytes"])) for rows in groups.values()]


def _regime_title(doc: dict[str, Any], regime: str) -> str:
    info = doc.get("regimes", {}).get(regime, {})
    if regime == "slow":
        rate = info.get("link_rate_bytes_per_s")
        return f"slow: {info.get('rate')} per rank" + (f" ({rate / 1e6:.1f} MB/s measured)" if rate else "")
    return "fast: loopback, unlimited"


def _title(doc: dict[str, Any]) -> str:
    m = doc.get("machine", {})
    s = doc.get("settings", {})
    return (
        f"N = {doc['world_size']} ranks on {m.get('cpu_model')} ({m.get('usable_cpus')} cpus), "
        f"torch {doc.get('versions', {}).get('torch')}, {s.get('iters')} iters from 4 MB, {doc.get('created', '')}"
    )
