"""The bytes-against-error frontier behind ``cerar study --frontier`` and ``--blocks``.

Three measurements, all from the project's simulators on float32 inputs (worst-rank relative
error, median over seeds):

* :func:`block_table`: the block-quantized rings (:func:`cerar.protocol.simulate_ring`) at
  every block size and scale dtype on three inputs (i.i.d. Gaussian, Student-t(3), and
  per-layer-scaled), the table each wire's default :class:`cerar.coding.blocks.BlockFormat` block
  was chosen from (the 8-bit wires by default, int4 with ``wires=("int4",), blocks=INT4_BLOCKS``);
  :func:`block_tables` is ``cerar study --blocks``'s, for the wires of ``--wires``;
* :func:`frontier_study`: for each ``N``, the rings (float32, float16, bfloat16, int8 and e4m3 at
  each block size, int4 and the narrower block wires at each of :data:`INT4_BLOCKS`), the direct
  shape of every block wire at the same formats (:func:`cerar.coding.blocks.direct_round_trip`:
  the ring's bytes, two roundings) and CERAR at ``c = N+1, 3N/2, 2N, 3N`` with
  float32/float16/bfloat16 packets and over 8-bit packets, as points (bytes per value, error)
  with the Pareto frontier marked; beside them, as references outside the frontier,
  hypothetical rings of packed 5-7-bit integer codes (the int8 format with a smaller ``QMAX``;
  cerar has no such wire) to judge CERAR's 8-bit points by what a narrower ring would give (the
  4-bit one is the real int4 wire, :func:`narrow_round_trip` at 4 bits being its round trip);
* :func:`k_table`: CERAR's error decomposed as ``sqrt(wrap^2 + (A delta)^2)``: the code's
  exact-arithmetic error ``wrap`` (float64 packets), the decode's amplification ``A`` of the
  packets' rms relative rounding ``delta``, and ``K = wrap A``, whence ``error >= sqrt(2 K delta)``.

Pure numpy; matplotlib only in :func:`plot_frontier`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from cerar.coding import codes
from cerar.coding.blocks import WIRES, BlockFormat, direct_round_trip, ring_error_bound, round_trip
from cerar.coding.linear_code import Code
from cerar.coding.precision import ITEMSIZE, rounder
from cerar.experiments._extras import pyplot
from cerar.protocol.simulate import simulate
from cerar.protocol.simulate_ring import ring_bytes_per_value, simulate_ring, simulate_ring_rounded

__all__ = [
    "BLOCKS",
    "INPUTS",
    "INT4_BLOCKS",
    "LARGE_N_BLOCKS",
    "TABLE_BLOCKS",
    "block_table",
    "block_tables",
    "cerar_8bit_designs",
    "default_format_points",
    "direct_error",
    "frontier_study",
    "inputs",
    "k_table",
    "mark_pareto",
    "packet_delta",
    "plot_frontier",
]

#: The block sizes measured for the 8-bit wires.
BLOCKS: tuple[int, ...] = (32, 64, 128, 256, 512, 1024)
#: The block sizes measured for the 4-bit wire (``block_table(wires=("int4",), blocks=INT4_BLOCKS)``):
#: its rounding is 18x coarser than int8's, so smaller blocks earn their scales' bytes.
INT4_BLOCKS: tuple[int, ...] = (8, 16, 32, 64, 128)
#: The 8-bit wires: the block table's default wires and CERAR's coarse packets in the frontier.
EIGHT_BIT_WIRES: tuple[str, ...] = ("int8", "fp8")
#: The block sizes ``cerar study --blocks`` measures per wire at ``N = 4`` (every one; the wires
#: narrower than 8 bits at int4's)...
TABLE_BLOCKS: dict[str, tuple[int, ...]] = {w: BLOCKS if w in EIGHT_BIT_WIRES else INT4_BLOCKS for w in WIRES}
#: ... and at ``N = 8, 16`` (three around the wire's default block).
LARGE_N_BLOCKS: dict[str, tuple[int, ...]] = {
    w: (32, 64, 256) if w in EIGHT_BIT_WIRES else (16, 32, 64) for w in WIRES
}
#: The inputs of the block table.
INPUTS: tuple[str, ...] = ("gaussian", "student-t3", "layers")
#: The float packet and ring precisions of the frontier.
FLOATS: tuple[str, ...] = ("fp32", "fp16", "bf16")
#: Spacings tried for the spread-seam perturbed code over 8-bit packets.
DELTAS: tuple[float, ...] = (0.04, 0.07, 0.115, 0.19, 0.3)
#: The plot's colours of the direct shape's series, one per block wire in :data:`WIRES`' order.
DIRECT_COLORS: tuple[str, ...] = ("tab:purple", "tab:brown", "tab:cyan", "tab:pink", "tab:olive")
#: Bits of the hypothetical packed integer rings (references only; 4 bits is the real int4 wire).
NARROW_BITS: tuple[int, ...] = (5, 6, 7)


def narrow_round_trip(x: np.ndarray, bits: int, block: int = 64) -> np.ndarray:
    """The int8 format's round trip (bfloat16 scales) with ``QMAX = 2^(bits-1) - 1``: a packed
    ``bits``-bit integer wire, which cerar has for 4 bits only (int4, the same values) and not
    for 5-7; for reference points only."""
    fmt = BlockFormat("int8", block, "bf16")
    qmax = np.float32(2 ** (bits - 1) - 1)
    m = x.shape[-1]
    padded = np.zeros((*x.shape[:-1], fmt.blocks(m) * block), dtype=np.float32)
    padded[..., :m] = x
    blocks = padded.reshape(*x.shape[:-1], -1, block)
    scales = rounder("bf16")(np.max(np.abs(blocks), axis=-1) / qmax)
    safe = np.where(scales > 0, scales, np.float32(1))[..., None]
    q = np.rint(np.clip(blocks / safe, -qmax, qmax)) * (scales[..., None] > 0)
    return (q.astype(np.float32) * scales[..., None]).reshape(*x.shape[:-1], -1)[..., :m]


def inputs(kind: str, world_size: int, size: int, seed: int) -> np.ndarray:
    """``(N, size)`` float32 inputs: ``"gaussian"`` i.i.d. standard normal, ``"student-t3"``
    i.i.d. Student-t with 3 degrees of freedom (heavy tails), ``"layers"`` i.i.d. normal in
    segments of 1024-8192 values (layers of a gradient bucket), each scaled by its own factor drawn
    log-uniform over 4 decades, the same on every rank."""
    rng = np.random.default_rng(seed)
    if kind == "gaussian":
        return rng.standard_normal((world_size, size)).astype(np.float32)
    if kind == "student-t3":
        return rng.standard_t(3, (world_size, size)).astype(np.float32)
    if kind != "layers":
        raise ValueError(f"Argument 'kind' must be one of {INPUTS}, not {kind!r}.")
    x = rng.standard_normal((world_size, size))
    edges = np.cumsum(rng.integers(1024, 8193, size // 1024 + 2))
    edges = edges[edges < size]
    factors = 10.0 ** rng.uniform(-4, 0, len(edges) + 1)
    return (x * factors[np.searchsorted(edges, np.arange(size), side="right")]).astype(np.float32)


def packet_delta(packet: str, fmt: BlockFormat | None = None, size: int = 1 << 16, seed: int = 0) -> float:
    """The rms relative rounding ``||round(g) - g|| / ||g||`` of a packet of Gaussian values (CERAR's
    packets are sums of many scaled inputs) in ``packet``: a float precision or an 8-bit wire."""
    g = np.random.default_rng(seed).standard_normal(size).astype(np.float32)
    if packet in WIRES:
        f = fmt or BlockFormat(packet)
        back = round_trip(g, BlockFormat(packet, f.block, f.scale))
    else:
        back = rounder(packet)(g)
    return float(np.linalg.norm(back.astype(np.float64) - g) / np.linalg.norm(g.astype(np.float64)))


def _median(values: Sequence[float]) -> float:
    return float(np.median(np.asarray(values)))


def block_table(
    world_sizes: Sequence[int] = (4,),
    blocks: Sequence[int] = BLOCKS,
    scales: Sequence[str] = ("fp32", "fp16", "bf16"),
    size: int = 1 << 20,
    seeds: int = 3,
    kinds: Sequence[str] = INPUTS,
    wires: Sequence[str] = EIGHT_BIT_WIRES,
) -> list[dict[str, Any]]:
    """Bytes per value and worst-rank relative error (median over ``seeds``) of the block-quantized
    rings at every wire of ``wires``, block size and scale dtype, on every input kind, with the
    predicted bound. The 8-bit wires by default (the table int8's default block came from);
    ``wires=("int4",), blocks=INT4_BLOCKS`` gives the table int4's came from."""
    for wire in wires:
        if wire not in WIRES:
            raise ValueError(f"Argument 'wires' must hold wires of {WIRES}, not {wire!r}.")
    rows = []
    for n in world_sizes:
        data = {kind: [inputs(kind, n, size, seed) for seed in range(seeds)] for kind in kinds}
        for wire in wires:
            for scale in scales:
                for block in blocks:
                    fmt = BlockFormat(wire, block, scale)
                    errors = {
                        kind: _median([simulate_ring(x, wire, block_format=fmt).worst_relative_error for x in xs])
                        for kind, xs in data.items()
                    }
                    rows.append({
                        "world_size": n, "wire": wire, "block": block, "scale": scale,
                        "bytes_per_value": ring_bytes_per_value(n, wire, fmt),
                        "errors": errors, "bound": ring_error_bound(n, fmt),
                    })  # fmt: skip
    return rows


def block_tables(
    wires: Sequence[str] = EIGHT_BIT_WIRES, size: int = 1 << 20, seeds: int = 3, quick: bool = False
) -> list[dict[str, Any]]:
    """``cerar study --blocks``'s table for ``wires``: every wire at ``N = 4`` at its
    :data:`TABLE_BLOCKS` with every scale dtype, and (unless ``quick``) at ``N = 8, 16`` at its
    :data:`LARGE_N_BLOCKS` with float32 and bfloat16 scales; wires of the same block sizes share a
    :func:`block_table` call (the 8-bit wires side by side, as in the table int8's block came from)."""
    for wire in wires:
        if wire not in WIRES:
            raise ValueError(f"Argument 'wires' must hold wires of {WIRES}, not {wire!r}.")
    rows: list[dict[str, Any]] = []
    stages = [((4,), TABLE_BLOCKS, ("fp32", "fp16", "bf16"))]
    if not quick:
        stages.append(((8, 16), LARGE_N_BLOCKS, ("fp32", "bf16")))
    for world_sizes, blocks_of, scales in stages:
        groups: dict[tuple[int, ...], list[str]] = {}
        for wire in dict.fromkeys(wires):
            groups.setdefault(blocks_of[wire], []).append(wire)
        for blocks, group in groups.items():
            rows += block_table(world_sizes, blocks, scales, size=size, seeds=seeds, wires=tuple(group))
    return rows


def default_format_points(points: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The frontier's block-wire rings and direct shapes at each wire's default format
    (:class:`cerar.coding.blocks.BlockFormat`'s block and scale): ``ring-<wire>`` and
    ``direct-<wire>`` of every block wire as the route table's rows run them, to print side by side."""
    defaults = {wire: BlockFormat(wire) for wire in WIRES}
    return [
        p for p in points
        if p["kind"] in ("ring8", "ring4", "direct")
        and (p["block"], p["scale"]) == (defaults[p["wire"]].block, defaults[p["wire"]].scale)
    ]  # fmt: skip


def direct_error(x: np.ndarray, fmt: BlockFormat) -> float:
    """The direct shape's relative error on the ``(N, d)`` inputs ``x``
    (:func:`cerar.coding.blocks.direct_round_trip`; every rank ends with the same values, so it
    is the worst rank's too): ``||out - S|| / ||S||``, ``S`` the exact sum."""
    exact = np.asarray(x, dtype=np.float64).sum(axis=0)
    out = direct_round_trip(x, fmt).astype(np.float64)
    return float(np.linalg.norm(out - exact) / np.linalg.norm(exact))


def _components(world_size: int) -> list[int]:
    n = world_size
    return sorted({n + 1, (3 * n) // 2, 2 * n, 3 * n})


def cerar_8bit_designs(world_size: int, components: int) -> dict[str, Code]:
    """Candidate codes for 8-bit packets: ``optimized`` designed for bfloat16 (the coarsest float
    precision the optimiser models) and the spread-seam perturbed code at each of :data:`DELTAS`
    (wider than the float designs' spacing: the coarser the packet, the larger the best delta)."""
    designs = {"optimized(bf16)": codes.optimized(world_size, components, "bf16", max_error=None)}
    for delta in DELTAS:
        try:
            code = codes.perturbed(world_size, components, delta, spread_seam=True, max_error=None)
        except ValueError:  # beyond the construction's range of delta at this c
            continue
        designs[f"perturbed-spread(delta={delta:g})"] = code
    return designs


def _point(kind: str, label: str, n: int, bytes_per_value: float, errors: list[float], **extra: Any) -> dict[str, Any]:
    return {"kind": kind, "label": label, "world_size": n, "bytes_per_value": bytes_per_value,
            "error": _median(errors), "errors": errors, **extra}  # fmt: skip


def frontier_study(
    world_sizes: Sequence[int] = (4, 8, 16),
    size: int = 1 << 16,
    seeds: int = 3,
    blocks: Sequence[int] = BLOCKS,
    block_scales: Sequence[str] = ("fp32", "bf16"),
    cerar_format: BlockFormat | None = None,
    int4_blocks: Sequence[int] = INT4_BLOCKS,
) -> dict[str, Any]:
    """Bytes per value against worst-rank error on i.i.d. Gaussian float32 inputs of ``size``
    values per rank (median over ``seeds``) for every ring, direct shape and CERAR design (see the
    module doc), the Pareto frontier marked (``on_frontier``), and :func:`k_table` for the same
    ``N``. The 8-bit rings run at ``blocks``, the int4 ring (and the narrower ones) at ``int4_blocks``
    (coarser codes favour smaller blocks); each ring's point of a block wire (kind ``ring8``, ``ring4``) is
    followed by the direct shape's at the same format (kind ``direct``, its predicted ``bound``
    :func:`cerar.coding.blocks.ring_error_bound`'s ``shape="direct"``).

    The 8-bit CERAR designs are tuned on a separate seed (the best of :func:`cerar_8bit_designs`
    per ``c`` and wire), then measured on the same inputs as the rest."""
    fmt8 = cerar_format or BlockFormat()
    points: list[dict[str, Any]] = []
    for n in world_sizes:
        xs = [inputs("gaussian", n, size, seed) for seed in range(seeds)]
        tune = inputs("gaussian", n, max(size // 4, 64 * n), 1000 + seeds)
        for wire in FLOATS:
            points.append(_point("ring", f"ring {wire}", n, ring_bytes_per_value(n, wire),
                                 [simulate_ring(x, wire).worst_relative_error for x in xs], wire=wire))
        for wire in WIRES:
            for scale in block_scales:
                for block in blocks if wire in EIGHT_BIT_WIRES else int4_blocks:
                    fmt = BlockFormat(wire, block, scale)
                    errors = [simulate_ring(x, wire, block_format=fmt).worst_relative_error for x in xs]
                    kind = "ring8" if wire in EIGHT_BIT_WIRES else "ring4"
                    points.append(_point(kind, f"ring {wire} B={block} {scale}", n,
                                         ring_bytes_per_value(n, wire, fmt), errors, wire=wire, block=block,
                                         scale=scale, bound=ring_error_bound(n, fmt)))  # fmt: skip
                    # the direct shape at the same format: the ring's bytes, two roundings
                    points.append(_point("direct", f"direct {wire} B={block} {scale}", n,
                                         ring_bytes_per_value(n, wire, fmt), [direct_error(x, fmt) for x in xs],
                                         wire=wire, block=block, scale=scale,
                                         bound=ring_error_bound(n, fmt, shape="direct")))  # fmt: skip
        for bits in NARROW_BITS:
            errors = [simulate_ring_rounded(x, lambda v, b=bits: narrow_round_trip(v, b)).worst_relative_error
                      for x in xs]  # fmt: skip
            points.append(_point("narrow", f"ring int{bits} B=64 bf16 (hypothetical)", n,
                                 2 * (n - 1) / n * (bits / 8 + 2 / 64), errors, bits=bits))  # fmt: skip
        for c in _components(n):
            for precision in FLOATS:
                code = codes.optimized(n, c, precision, max_error=None)
                points.append(_point("cerar", f"CERAR c={c} {precision}", n, ITEMSIZE[precision] * code.comm_rate,
                                     [simulate(code, x, precision).worst_relative_error for x in xs],
                                     components=c, packet=precision, design="optimized"))  # fmt: skip
            for wire in EIGHT_BIT_WIRES:
                designs = cerar_8bit_designs(n, c)
                tuned = {name: simulate(code, tune, wire, block_format=fmt8).worst_relative_error
                         for name, code in designs.items()}  # fmt: skip
                best = min(tuned, key=tuned.__getitem__)
                code = designs[best]
                errors = [simulate(code, x, wire, block_format=fmt8).worst_relative_error for x in xs]
                points.append(_point("cerar8", f"CERAR c={c} {wire}", n, fmt8.bytes_per_value * code.comm_rate,
                                     errors, components=c, packet=wire, design=best, tuning=tuned,
                                     block=fmt8.block, scale=fmt8.scale))  # fmt: skip
    mark_pareto(points)
    return {
        "points": points,
        "size": size,
        "seeds": seeds,
        "cerar_block_format": {"wire": fmt8.wire, "block": fmt8.block, "scale": fmt8.scale},
        "k_table": k_table(world_sizes, size=max(size // 4, 4096)),
    }


def mark_pareto(points: list[dict[str, Any]]) -> None:
    """Set ``on_frontier`` on each point: no other point of its ``N`` (the hypothetical narrow rings
    left out) has fewer or equal bytes and less or equal error, one of them strictly; and
    ``dominated_by_narrow``: a hypothetical narrow ring has (fewer or equal bytes and less error)."""
    for p in points:
        p["dominated_by_narrow"] = any(
            q["kind"] == "narrow" and q["world_size"] == p["world_size"]
            and q["bytes_per_value"] <= p["bytes_per_value"] and q["error"] < p["error"]
            for q in points
        )  # fmt: skip
        p["on_frontier"] = p["kind"] != "narrow" and not any(
            q["kind"] != "narrow"
            and q["world_size"] == p["world_size"]
            and q["bytes_per_value"] <= p["bytes_per_value"]
            and q["error"] <= p["error"]
            and (q["bytes_per_value"] < p["bytes_per_value"] or q["error"] < p["error"])
            for q in points
        )


def _rank_errors(result: Any, reference: Any) -> np.ndarray:
    """Per rank ``||out - reference_out|| / ||S||``."""
    scale = float(np.linalg.norm(result.exact))
    return np.linalg.norm(result.outputs - reference.outputs, axis=1) / scale


def k_table(
    world_sizes: Sequence[int] = (4, 8, 16),
    size: int = 1 << 14,
    seed: int = 0,
    probe: str = "bf16",
    packets: Sequence[str] = ("fp32", "fp16", "bf16", "int8", "fp8"),
) -> list[dict[str, Any]]:
    """``wrap``, ``A`` and ``K = wrap A`` for several designs at ``c = N+1`` and ``2N``, with each
    design's error at every packet precision beside ``sqrt(wrap^2 + (A delta)^2)`` (the model)
    and ``sqrt(2 K delta)`` (its floor over designs of one ``K``).

    ``wrap`` is the worst-rank error with float64 packets; ``A`` is the worst rank's
    ``||out_probe - out_fp64|| / ||S||`` divided by the ``probe`` packets' ``delta``
    (:func:`packet_delta`), i.e. the decode's amplification of the packets' rms relative rounding.
    """
    deltas = {p: packet_delta(p) for p in packets}
    rows = []
    for n in world_sizes:
        for c in (n + 1, 2 * n):
            designs = {f"optimized({p})": codes.optimized(n, c, p, max_error=None) for p in FLOATS}
            for delta in DELTAS[:4]:
                try:
                    designs[f"perturbed-spread(delta={delta:g})"] = codes.perturbed(
                        n, c, delta, spread_seam=True, max_error=None
                    )
                except ValueError:
                    continue
            x = inputs("gaussian", n, size, seed)
            for name, code in designs.items():
                exact = simulate(code, x, "fp64")
                wrap = exact.worst_relative_error
                amp = float(np.max(_rank_errors(simulate(code, x, probe), exact))) / deltas[probe]
                k = wrap * amp
                row = {"world_size": n, "components": c, "design": name, "wrap": wrap, "A": amp, "K": k,
                       "measured": {}, "model": {}, "floor": {}}  # fmt: skip
                for p in packets:
                    row["measured"][p] = simulate(code, x, p).worst_relative_error
                    row["model"][p] = math.hypot(wrap, amp * deltas[p])
                    row["floor"][p] = math.sqrt(2 * k * deltas[p])
                rows.append(row)
    return [{**row, "deltas": deltas} for row in rows]


def plot_frontier(study: dict[str, Any], path: Path) -> None:
    """One panel per ``N``: worst-rank error (log) against bytes per value, every method (the
    direct shape a series per wire: "direct int8", "direct int4"...), the Pareto frontier joined;
    labelled: the frontier's points (the direct shape's at its row's format only), CERAR's 8-bit
    ones and each block row's format."""
    plt = pyplot("bench", needed_by="cerar study --frontier")
    world_sizes = sorted({p["world_size"] for p in study["points"]})
    fig, axes = plt.subplots(1, len(world_sizes), figsize=(5.5 * len(world_sizes), 4.6), squeeze=False)
    styles = {"ring": ("s", "black"), "ring8": ("o", "tab:blue"), "ring4": ("v", "tab:green"),
              "cerar": ("^", "tab:orange"), "cerar8": ("D", "tab:red"), "narrow": ("x", "grey")}  # fmt: skip
    narrow = "/".join(w for w in WIRES if any(p["kind"] == "ring4" and p["wire"] == w for p in study["points"]))
    names = {"ring": "ring fp32/fp16/bf16", "ring8": "ring int8/e4m3 (blocks)", "ring4": f"ring {narrow} (blocks)",
             "cerar": "CERAR fp32/fp16/bf16", "cerar8": "CERAR int8/e4m3 packets",
             "narrow": "ring int5-int7 (hypothetical)"}  # fmt: skip
    direct_wires = [w for w in WIRES if any(p["kind"] == "direct" and p["wire"] == w for p in study["points"])]
    for i, wire in enumerate(direct_wires):  # one series per wire, after the others
        styles[f"direct {wire}"] = ("P*Xhp"[i % 5], DIRECT_COLORS[i % len(DIRECT_COLORS)])
        names[f"direct {wire}"] = f"direct {wire} (blocks)"
    for ax, n in zip(axes[0], world_sizes, strict=True):
        mine = [p for p in study["points"] if p["world_size"] == n]
        for kind, (marker, color) in styles.items():
            pts = [p for p in mine if (p["kind"] if p["kind"] != "direct" else f"direct {p['wire']}") == kind]
            if pts:
                ax.semilogy([p["bytes_per_value"] for p in pts], [max(p["error"], 1e-12) for p in pts], marker,
                            color=color, alpha=0.7, linestyle="none", label=names[kind])  # fmt: skip
        front = sorted((p["bytes_per_value"], max(p["error"], 1e-12)) for p in mine if p["on_frontier"])
        ax.step(*zip(*front, strict=True), where="post", color="grey", alpha=0.6, label="Pareto frontier")
        shown = {id(p) for p in default_format_points(mine)}
        for p in mine:  # the direct shape's frontier points by their series, labelled at the row's format only
            if (p["on_frontier"] and p["kind"] != "direct") or p["kind"] == "cerar8" or id(p) in shown:
                ax.annotate(p["label"].replace("CERAR ", "").replace("ring ", ""), (p["bytes_per_value"], p["error"]),
                            fontsize=5, alpha=0.8)  # fmt: skip
        ax.set(title=f"N = {n}", xlabel="bytes sent per value per rank", ylabel="worst-rank relative error")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
