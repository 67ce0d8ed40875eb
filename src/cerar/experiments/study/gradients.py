"""Each method's error on real gradients, beside the same figures on i.i.d. data.

Input: the per-rank gradients of one or more training points (``(N, d)`` each, e.g. from
:mod:`cerar.experiments.study.capture`). For every method it measures, by simulation of all ranks:

* CERAR with ``c = k N`` for each multiple ``k`` (default ``2, 3``) and each construction
  (``perturbed``, ``optimized``, ``vandermonde``; codes tuned for float32 packets, mixed decoder),
  float32 packets (:func:`cerar.protocol.simulate`);
* the exact ring with float32, float16 (power-of-two scaled) and bfloat16 wires
  (:func:`cerar.protocol.simulate_ring`, bit for bit the real ``ring_all_reduce``);

and reports bytes sent per gradient element per rank (CERAR ``4 (1 + (N-2)/c)``, ring
``itemsize x 2 (N-1)/N``), the worst-rank and mean-rank relative error
``||S_hat_j - S|| / ||S||`` over the whole flat gradient (one bucket), on each training point and
on i.i.d. standard normal inputs of the same ``(N, d)``. Given the flat gradient's parameter
layout (``parameters``: names and sizes, as :mod:`cerar.experiments.study.capture` stores), it
also reports the *per-parameter* worst relative error ``max_{j, p} ||S_hat_j[p] - S[p]|| /
||S[p]||`` over the parameters ``p`` whose true sum is non-zero (:func:`parameter_errors`, in
:mod:`cerar.experiments.study.gradient_errors`), which a bucket figure hides when small parameters
share the bucket with large ones. Parameters whose true sum is exactly zero (none of the batch
reached them) are reported apart, by their absolute error ``max_j ||S_hat_j[p]||``, and so are the
single values whose true sum is exactly zero (e.g. the embedding rows of bytes no rank's batch
held).
Every figure is computed from the simulators' ``outputs`` and ``exact`` alone, whatever layout
the protocol uses inside.

To show how much the ranks' gradients share, each data set also gets its
*common-part fraction* ``||mean_i g_i||^2 / mean_i ||g_i||^2`` (1: identical gradients; ``1/N``:
orthogonal ones of equal norm, as i.i.d. data), the smallest pairwise cosine, and the spread of
magnitudes (``max |g|`` over the RMS), which decides what a 16-bit wire loses to rounding and
underflow.

Pure numpy; matplotlib is imported by :func:`plot_gradient_study` only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from cerar._checks import check_int
from cerar.coding import codes
from cerar.coding.linear_code import Code
from cerar.coding.precision import ITEMSIZE
from cerar.experiments._extras import pyplot
from cerar.experiments.study.capture_file import check_parameters
from cerar.experiments.study.gradient_errors import call_errors, data_statistics, parameter_errors
from cerar.experiments.study.synthetic import iid_inputs
from cerar.protocol.simulate import simulate
from cerar.protocol.simulate_ring import simulate_ring

__all__ = [
    "CONSTRUCTIONS",
    "RING_WIRES",
    "build_code",
    "data_statistics",
    "gradient_study",
    "method_table",
    "parameter_errors",
    "parameter_table",
    "plot_gradient_study",
]

#: The constructions compared: every one of :data:`cerar.coding.codes.CONSTRUCTIONS` but
#: ``exact``, which needs ``c = N`` while the study sweeps ``c = k N`` (the float32 ring stands
#: in as the exact reference).
CONSTRUCTIONS: tuple[str, ...] = tuple(name for name in codes.CONSTRUCTIONS if name != "exact")
RING_WIRES: tuple[str, ...] = ("fp32", "fp16", "bf16")
#: CERAR's packet precisions: float32, and the 16-bit packets (codes designed for each).
CERAR_PACKETS: tuple[str, ...] = ("fp32", "fp16", "bf16")
IID = "i.i.d."


def build_code(construction: str, world_size: int, components: int, packet: str = "fp32") -> Code:
    """The ``packet``-precision code of ``construction`` (parameters chosen by the library). The
    study measures poor codes too (Vandermonde at ``c = 2N`` is one), so the library's error
    limit is off (``max_error=None``)."""
    if construction not in CONSTRUCTIONS:
        listed = ", ".join(repr(c) for c in CONSTRUCTIONS)
        raise ValueError(f"Argument 'construction' must be one of {listed}, not {construction!r}.")
    return codes.build(construction, world_size, components, packet, max_error=None)


def _check_datasets(datasets: Mapping[str, Any]) -> dict[str, np.ndarray]:
    if not isinstance(datasets, Mapping) or not datasets:
        raise TypeError(f"Argument 'datasets' must be a non-empty mapping of name -> (N, d) array, not {datasets!r}.")
    checked: dict[str, np.ndarray] = {}
    shapes = set()
    for name, value in datasets.items():
        if not isinstance(name, str) or name == IID:
            raise ValueError(f"Argument 'datasets' must have string names other than {IID!r}, not {name!r}.")
        array = np.asarray(value)
        if not np.issubdtype(array.dtype, np.floating):
            raise TypeError(f"Argument 'datasets' must hold float arrays, not dtype {array.dtype} ({name!r}).")
        if array.ndim != 2 or array.shape[0] < 2 or array.shape[1] < 1:
            raise ValueError(f"Argument 'datasets' must hold (N >= 2, d) arrays, not shape {array.shape} ({name!r}).")
        if not np.all(np.isfinite(array)):
            raise ValueError(f"Argument 'datasets' must hold finite values ({name!r} does not).")
        checked[name] = array
        shapes.add(array.shape)
    if len(shapes) != 1:
        raise ValueError(f"Argument 'datasets' must hold arrays of one shape, not {sorted(shapes)}.")
    return checked


def gradient_study(
    datasets: Mapping[str, Any],
    *,
    multiples: Sequence[int] = (2, 3),
    constructions: Sequence[str] = CONSTRUCTIONS,
    ring_wires: Sequence[str] = RING_WIRES,
    cerar_packets: Sequence[str] = CERAR_PACKETS,
    seed: int = 0,
    info: Mapping[str, Any] | None = None,
    parameters: Sequence[tuple[str, int]] | None = None,
) -> dict[str, Any]:
    """Measure every method on every data set and on i.i.d. normal inputs of the same shape.

    Args:
        datasets: name -> ``(N, d)`` per-rank inputs (e.g. ``{"step 0": ..., "step 75": ...}``),
            all of one shape; the i.i.d. set is added under the name ``"i.i.d."``.
        multiples: CERAR's ``c = k N`` for each ``k`` (integers, at least 1).
        constructions: a subset of :data:`CONSTRUCTIONS`.
        ring_wires: a subset of :data:`RING_WIRES`.
        cerar_packets: CERAR's packet precisions, a subset of :data:`CERAR_PACKETS` (float32 for
            every construction; the 16-bit ones with the ``optimized`` design for that precision,
            the one ``cerar.all_reduce(packet_dtype=...)`` uses by default).
        seed: the i.i.d. inputs' seed.
        info: copied into the result under ``"info"`` (e.g. the capture's settings).
        parameters: the flat vector's layout, ``(name, size)`` per parameter (sizes summing to
            ``d``; e.g. :attr:`cerar.experiments.study.capture_file.Capture.parameters`). Given, every
            error also has ``per_parameter`` (:func:`parameter_errors`; the i.i.d. set is cut at
            the same boundaries).

    Returns:
        A JSON-ready dict: ``world_size``, ``size``, ``datasets`` (names in order, i.i.d. first),
        ``statistics`` (per data set, :func:`data_statistics`), ``parameters`` (the layout as
        ``[name, size]`` lists, or None) and ``methods``: a list of ``{label, kind, construction,
        components, wire, bytes_per_element, cond, parameter, errors: {data set: {worst, mean,
        per_rank[, per_parameter]}}}``.
    """
    data = _check_datasets(datasets)
    multiples = [check_int("multiples", k, minimum=1) for k in multiples]
    for construction in constructions:
        if construction not in CONSTRUCTIONS:
            raise ValueError(f"Argument 'constructions' must hold names from {CONSTRUCTIONS}, not {construction!r}.")
    for wire in ring_wires:
        if wire not in RING_WIRES:
            raise ValueError(f"Argument 'ring_wires' must hold names from {RING_WIRES}, not {wire!r}.")
    for packet in cerar_packets:
        if packet not in CERAR_PACKETS:
            raise ValueError(f"Argument 'cerar_packets' must hold names from {CERAR_PACKETS}, not {packet!r}.")
    seed = check_int("seed", seed, minimum=0)
    n_ranks, size = next(iter(data.values())).shape
    layout = None if parameters is None else check_parameters(parameters, size)
    # float32 first: that is what the collective receives (gradients are float32 already).
    all_sets = {IID: iid_inputs(n_ranks, size, seed).astype(np.float32)}
    all_sets.update({name: array.astype(np.float32) for name, array in data.items()})

    methods = []
    if "fp32" in cerar_packets:
        methods += [_cerar_entry(c, k * n_ranks, all_sets, layout) for k in multiples for c in constructions]
    narrow = [p for p in cerar_packets if p != "fp32"]
    methods += [_cerar_entry("optimized", k * n_ranks, all_sets, layout, p) for k in multiples for p in narrow]
    methods += [_ring_entry(wire, all_sets, layout) for wire in ring_wires]
    return {
        "world_size": int(n_ranks),
        "size": int(size),
        "seed": seed,
        "datasets": list(all_sets),
        "statistics": {name: data_statistics(x) for name, x in all_sets.items()},
        "parameters": None if layout is None else [[name, count] for name, count in layout],
        "methods": methods,
        "info": dict(info or {}),
    }


Layout = tuple[tuple[str, int], ...] | None


def _cerar_entry(
    construction: str, components: int, data: Mapping[str, np.ndarray], layout: Layout, packet: str = "fp32"
) -> dict[str, Any]:
    """CERAR with ``construction``'s code for ``packet`` packets at ``c = components``, on every data set."""
    n_ranks = next(iter(data.values())).shape[0]
    code = build_code(construction, n_ranks, components, packet)
    return {
        "label": f"cerar {construction} c={components}" + ("" if packet == "fp32" else f" {packet}"),
        "kind": "cerar",
        "construction": construction,
        "components": components,
        "wire": packet,
        "bytes_per_element": ITEMSIZE[packet] * code.comm_rate,
        "cond": float(np.max(code.cond)),
        "parameter": {key: v for key, v in code.params.items() if isinstance(v, (int, float, str))},
        "errors": {name: call_errors(simulate(code, x, packet), layout) for name, x in data.items()},
    }


def _ring_entry(wire: str, data: Mapping[str, np.ndarray], layout: Layout) -> dict[str, Any]:
    """The exact ring with a ``wire`` wire, on every data set."""
    n_ranks = next(iter(data.values())).shape[0]
    return {
        "label": f"ring {wire}",
        "kind": "ring",
        "construction": None,
        "components": None,
        "wire": wire,
        "bytes_per_element": ITEMSIZE[wire] * 2 * (n_ranks - 1) / n_ranks,
        "cond": 1.0,
        "parameter": {},
        "errors": {name: call_errors(simulate_ring(x, wire), layout) for name, x in data.items()},
    }


def _has_parameters(study: Mapping[str, Any]) -> bool:
    return any("per_parameter" in e for m in study["methods"] for e in m["errors"].values())


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.2e}"


def method_table(study: Mapping[str, Any], statistic: str = "worst") -> str:
    """A Markdown table: one row per method, bytes per element and ``statistic`` ("worst" or
    "mean" rank error over the whole bucket) on every data set, then the data sets' common-part
    fractions. When the study has the per-parameter figures, each data set's column is followed
    by ``per-param``: the worst relative error over ranks and non-zero parameters."""
    if statistic not in ("worst", "mean"):
        raise ValueError(f"Argument 'statistic' must be 'worst' or 'mean', not {statistic!r}.")
    names = list(study["datasets"])
    split = _has_parameters(study)
    columns = [c for n in names for c in ((n, f"{n} per-param") if split else (n,))]
    head = "| method | bytes/elem | " + " | ".join(columns) + " |"
    rule = "|---|---|" + "---|" * len(columns)
    lines = [head, rule]
    for m in study["methods"]:
        cells = []
        for n in names:
            cells.append(f"{m['errors'][n][statistic]:.2e}")
            if split:
                cells.append(_cell(m["errors"][n].get("per_parameter", {}).get("worst")))
        lines.append(f"| {m['label']} | {m['bytes_per_element']:.3f} | {' | '.join(cells)} |")
    common = " | ".join(
        c for n in names for c in ((f"{study['statistics'][n]['common_fraction']:.3f}",) + (("",) if split else ()))
    )
    lines.append(f"| common-part fraction | | {common} |")
    return "\n".join(lines)


def parameter_table(study: Mapping[str, Any]) -> str:
    """A Markdown table of the per-parameter figures (:func:`parameter_errors`): per method and
    data set, the bucket's worst-rank error, the per-parameter worst and where it is (parameter,
    rank), and the absolute error on parameters and on values whose true sum is exactly zero.
    ValueError if the study was run without ``parameters``."""
    if not _has_parameters(study):
        raise ValueError("Argument 'study' has no per-parameter figures: run gradient_study with parameters.")
    lines = [
        "| method | data set | bucket worst | per-param worst | parameter (rank) | per-param median "
        "| zero-sum params: count, worst abs | zero-sum values: count, worst abs |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for m in study["methods"]:
        for n in study["datasets"]:
            e = m["errors"][n]
            p = e["per_parameter"]
            where = "-" if p["worst_parameter"] is None else f"{p['worst_parameter']} ({p['worst_rank']})"
            z, v = p["zero_sum"], p["zero_values"]
            lines.append(
                f"| {m['label']} | {n} | {e['worst']:.2e} | {_cell(p['worst'])} | {where} | {_cell(p['median'])} "
                f"| {z['count']}, {_cell(z['worst_abs'])} | {v['count']}, {_cell(v['worst_abs'])} |"
            )
    return "\n".join(lines)


def plot_gradient_study(study: Mapping[str, Any], path: Path | str) -> None:
    """Worst-rank error (log) against bytes per element: one marker per method, one colour
    per data set (i.i.d. and each training point), CERAR points of one construction joined.
    With the per-parameter figures, each point also gets a hollow twin (dashed for CERAR) at the
    per-parameter worst error."""
    plt = pyplot("bench", needed_by="cerar study")
    markers = {"perturbed": "o", "optimized": "s", "vandermonde": "D", "fp32": "*", "fp16": "^", "bf16": "v"}
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    fig, ax = plt.subplots(figsize=(8, 5.2))
    for d_index, name in enumerate(study["datasets"]):
        colour = colours[d_index % len(colours)]
        for construction in CONSTRUCTIONS:
            pts = sorted(
                (m["bytes_per_element"], m["errors"][name]["worst"])
                for m in study["methods"]
                if m["construction"] == construction
            )
            if pts:
                x, y = zip(*pts, strict=True)
                ax.plot(x, np.maximum(y, 1e-12), color=colour, marker=markers[construction], linestyle="-",
                        alpha=0.8)
            per_param = sorted(
                (m["bytes_per_element"], _per_parameter_worst(m, name))
                for m in study["methods"]
                if m["construction"] == construction and _per_parameter_worst(m, name) is not None
            )
            if per_param:
                x, y = zip(*per_param, strict=True)
                ax.plot(x, np.maximum(y, 1e-12), color=colour, marker=markers[construction], linestyle="--",
                        markerfacecolor="none", alpha=0.8)
        for m in study["methods"]:
            if m["kind"] == "ring":
                size = 10 if m["wire"] == "fp32" else 8
                ax.plot(m["bytes_per_element"], max(m["errors"][name]["worst"], 1e-12), color=colour,
                        marker=markers[m["wire"]], markersize=size, linestyle="none")
                worst = _per_parameter_worst(m, name)
                if worst is not None:
                    ax.plot(m["bytes_per_element"], max(worst, 1e-12), color=colour, marker=markers[m["wire"]],
                            markersize=size, markerfacecolor="none", linestyle="none")
        common = study["statistics"][name]["common_fraction"]
        ax.plot([], [], color=colour, linewidth=6, label=f"{name} (common {common:.2f})")
    # Legend: markers (methods) in black, colours (data sets) as bars.
    shown = {m["construction"] or m["wire"]: m["label"].rsplit(" c=", 1)[0] for m in study["methods"]}
    for key, label in shown.items():
        ax.plot([], [], color="black", marker=markers[key], linestyle="-" if key in CONSTRUCTIONS else "none",
                label=label)
    if _has_parameters(study):
        ax.plot([], [], color="black", marker="o", markerfacecolor="none", linestyle="--",
                label="hollow, dashed: worst per parameter")
    ax.set_yscale("log")
    ax.set(
        xlabel="bytes sent per gradient element per rank",
        ylabel="worst-rank relative error ||S_hat_j - S|| / ||S||"
        + (" (hollow: max_p ||S_hat_j[p] - S[p]|| / ||S[p]||)" if _has_parameters(study) else ""),
        title=f"Real gradients vs i.i.d., N = {study['world_size']}, d = {study['size']:,}",
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _per_parameter_worst(method: Mapping[str, Any], name: str) -> float | None:
    return method["errors"][name].get("per_parameter", {}).get("worst")
