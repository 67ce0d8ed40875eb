"""Issue 22, item 2: the float32-packet decode's accumulator. Today's float64 against plain
float32 and compensated float32 schemes: worst-rank error against a float64 exact sum, and time.

    python benchmarks/compensated_decode.py
    python benchmarks/compensated_decode.py --sizes 1,16 --repeats 5 --no-compile

One process, one thread (``torch.set_num_threads(1)``, as each rank of ``cerar bench``), N = 4,
c = 8, ``codes.perturbed(4, 8)``, float32 packets, i.i.d. normal float32 inputs. Per size:

1. All N ranks' rings are simulated in float32 as :class:`cerar.comm.algorithms.CerarRun` runs
   them: increments ``max(4, c / 2)`` rounds per product from the same float32 rows, each packet
   the received one plus the increment in float32, observation slots from round ``N - 1`` on.
2. Each variant decodes every rank's observations piece by piece and group of slots by group
   (:func:`cerar.comm.algorithms.slot_groups`, the engine's pieces) into a float32 output;
   the worst rank's ``||out - S|| / ||S||`` is taken against the inputs' float64 sum.
3. Rank 0's decode is timed, the variants alternating, ``--repeats`` times, after a pass over a
   64 MB buffer (the caches cold, as after a round's transfers): the median time, the median of
   each repeat's time over float64's (side by side), and the time over the decode's limit
   (:mod:`cerar.experiments.bench.limit`: ``s_p + 2 s_x`` bytes per value at the copy rate).

Every variant writes the sum back as ``out.t().copy_(acc)`` (bitwise today's ``out.copy_(acc.t())``,
faster for float32: ``benchmarks/fused_kernels.py``), so that the accumulations are compared.

Variants: ``fused C (kept)`` (:mod:`cerar.comm.native`: one compiled pass per piece, float64
accumulation, what CerarRun runs on a CPU with a C compiler); ``float64`` (the torch ops kept for
devices and machines without a compiler: observations widened into a float64 buffer, float64 ``addmm``);
``float32`` (``W`` in float32, ``addmm`` straight on the observations, no copy); ``f32 W hi+lo``
(``W = W_hi + W_lo`` in float32, two ``addmm``: the weights' rounding removed); ``two-float``
(``W_hi + W_lo`` and a TwoSum-compensated ``(hi, lo)`` float32 accumulator, torch ops);
``two-float compiled`` (its TwoSum update as one ``torch.compile`` kernel). Run it twice to see
the compile time with and without inductor's on-disk cache.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from collections.abc import Callable

import torch

from cerar import codes
from cerar.comm import native
from cerar.comm.algorithms import cerar_scale_window, fold_slots, own_part, rounds_per_product, slot_groups
from cerar.comm.transport import segments
from cerar.experiments.bench.limit import copy_bandwidth
from cerar.protocol.schedule import Schedule

Decoder = Callable[[torch.Tensor], None]


class RankData:
    """One rank's input (``(m, c)`` columns), its ``c`` float32 observation slots ``(c, m)`` and
    its decode matrices (float64), from a float32 simulation of the whole ring."""

    __slots__ = ("columns", "decode_obs", "decode_own", "observations", "rows_scale")

    def __init__(self, columns: torch.Tensor, observations: torch.Tensor, decode: torch.Tensor, rows_scale: float):
        c = columns.shape[1]
        self.columns, self.observations, self.rows_scale = columns, observations, rows_scale
        self.decode_own = decode[:, :c].contiguous()
        self.decode_obs = decode[:, c:].contiguous()


def simulate_ring(code: codes.Code, inputs: list[torch.Tensor]) -> list[RankData]:
    """Every rank's observations, computed as CerarRun computes them (float32 packets)."""
    n, c = code.world_size, code.components
    schedule = Schedule.for_code(code)
    window = cerar_scale_window(code, torch.float32, torch.float32)
    rows_exponent, data_exponent = window.split(window.exponent_for(max(float(x.abs().max()) for x in inputs)))
    if data_exponent:
        raise ValueError(f"inputs need a scaled copy (q = {data_exponent}); the study covers q = 0")
    scale = math.ldexp(1.0, rows_exponent)
    m = inputs[0].numel() // c
    plans = [schedule.plan(code, j) for j in range(n)]
    columns = [x.view(m, c) for x in inputs]
    per_product = rounds_per_product(c)
    increments: list[dict[int, torch.Tensor]] = [{} for _ in range(n)]
    for j, plan in enumerate(plans):
        rows = torch.from_numpy(plan.increments) / scale
        for first in range(0, schedule.rounds, per_product):
            batch = torch.zeros(per_product, c, dtype=torch.float64)
            batch[: min(per_product, schedule.rounds - first)] = rows[first : first + per_product]
            product = torch.mm(batch.float(), columns[j].t())  # encode_rounds, the whole packet as one piece
            for r in range(min(per_product, schedule.rounds - first)):
                increments[j][first + r + 1] = product[r].clone()
    observations = [torch.empty(c, m) for _ in range(n)]
    received = [torch.zeros(m) for _ in range(n)]
    for t in range(1, schedule.rounds + 1):
        sent = [increments[j][t] if t == 1 else received[j] + increments[j][t] for j in range(n)]
        for j in range(n):
            received[j] = sent[(j - 1) % n]
            slot = t - (n - 1)
            if slot >= 0:
                observations[j][slot].copy_(received[j])
    return [RankData(columns[j], observations[j], torch.from_numpy(plans[j].decode), scale) for j in range(n)]


def float64_decoder(data: RankData) -> Decoder:
    """Today's decode (CerarRun._fold): widen each group's slots into a float64 buffer, own part
    in float32, float64 accumulator, transposed write-back."""
    c, m = data.columns.shape[1], data.columns.shape[0]
    pieces, groups = segments(m, 4), slot_groups(c)
    weights = (data.decode_obs * data.rows_scale).double()
    group_weights = {a: weights[:, a:b].contiguous() for a, b in groups}
    own_matrix = (data.decode_own / data.rows_scale).float()
    widest = max(b - a for a, b in pieces)
    arrived = torch.empty(max(b - a for a, b in groups), widest, dtype=torch.float64)
    own = torch.empty(c, widest)
    total = torch.empty(c * m, dtype=torch.float64)

    def decode(out: torch.Tensor) -> None:
        for start, stop in groups:
            for a, b in pieces:
                acc = total[c * a : c * b].view(c, b - a)
                slots = arrived[: stop - start, : b - a]
                slots.copy_(data.observations[start:stop, a:b])
                begin = own_part(own_matrix, data.columns[a:b], own[:, : b - a]) if start == 0 else None
                fold_slots(acc, slots, group_weights[start], begin, data.rows_scale)
                if stop == c:
                    out[a:b].t().copy_(acc)  # bitwise out.copy_(acc.t()), faster (fused_kernels.py)

    return decode


def fused_decoder(data: RankData) -> Decoder:
    """The compiled one-pass decode (:mod:`cerar.comm.native`, what CerarRun runs on a CPU with
    a C compiler): float64 accumulation per column, the input, the slots and the output each
    streamed once, piece by piece."""
    m = data.columns.shape[0]
    pieces = segments(m, 4)
    kernel = native.fused_decoder(
        data.decode_own, data.decode_obs * data.rows_scale, torch.float32, torch.float32, torch.device("cpu")
    )
    if kernel is None:
        raise RuntimeError(f"the compiled decode is unavailable: {native.status()}")

    def decode(out: torch.Tensor) -> None:
        for a, b in pieces:
            kernel.decode(data.columns[a:b], data.observations[:, a:b], 1.0, out[a:b])

    return decode


def split_matrices(
    data: RankData, groups: list[tuple[int, int]]
) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor], torch.Tensor]:
    """The observations' weights ``W * 2**r`` split into float32 ``W_hi = fl32(W)`` and ``W_lo =
    W - W_hi`` per group of slots (keyed by its first slot), and the own part's ``D / 2**r``."""
    weights = data.decode_obs * data.rows_scale
    high = weights.float()
    low = (weights - high.double()).float()
    highs = {a: high[:, a:b].contiguous() for a, b in groups}
    lows = {a: low[:, a:b].contiguous() for a, b in groups}
    return highs, lows, (data.decode_own / data.rows_scale).float()


def float32_decoder(data: RankData, split_weights: bool) -> Decoder:
    """A float32 accumulator: the own part written straight into it, each group one ``addmm`` on
    the observations as they lie (float32 packets: no copy); with ``split_weights`` a second
    ``addmm`` with ``W_lo = W - fl32(W)``."""
    c, m = data.columns.shape[1], data.columns.shape[0]
    pieces, groups = segments(m, 4), slot_groups(c)
    highs, lows, own_matrix = split_matrices(data, groups)
    total = torch.empty(c * m)

    def decode(out: torch.Tensor) -> None:
        for start, stop in groups:
            for a, b in pieces:
                acc = total[c * a : c * b].view(c, b - a)
                slots = data.observations[start:stop, a:b]
                if start == 0:
                    own_part(own_matrix, data.columns[a:b], acc)
                    acc.addmm_(highs[start], slots, beta=data.rows_scale)
                else:
                    acc.addmm_(highs[start], slots)
                if split_weights:
                    acc.addmm_(lows[start], slots)
                if stop == c:
                    out[a:b].t().copy_(acc)  # bitwise out.copy_(acc.t()), faster (fused_kernels.py)

    return decode


def two_sum_update(high: torch.Tensor, low: torch.Tensor, product: torch.Tensor, tail: torch.Tensor) -> None:
    """``(high, low) += product + tail`` as a two-float: TwoSum (Knuth) of ``high + product``,
    its rounding error and ``tail`` (``W_lo R``, small) into ``low``; in place."""
    total = high + product
    back = total - high
    error = (high - (total - back)) + (product - back)
    low.add_(error + tail)
    high.copy_(total)


def two_float_decoder(data: RankData, update: Callable[..., None]) -> Decoder:
    """A two-float ``(high, low)`` float32 accumulator: each group's ``W_hi R`` and ``W_lo R`` as
    float32 products (MKL), summed into the pair by ``update``; out = ``high + low``."""
    c, m = data.columns.shape[1], data.columns.shape[0]
    pieces, groups = segments(m, 4), slot_groups(c)
    highs, lows, own_matrix = split_matrices(data, groups)
    widest = max(b - a for a, b in pieces)
    product, tail = torch.empty(c, widest), torch.empty(c, widest)
    high_flat, low_flat = torch.empty(c * m), torch.empty(c * m)

    def decode(out: torch.Tensor) -> None:
        for start, stop in groups:
            for a, b in pieces:
                high = high_flat[c * a : c * b].view(c, b - a)
                low = low_flat[c * a : c * b].view(c, b - a)
                slots = data.observations[start:stop, a:b]
                p, q = product[:, : b - a], tail[:, : b - a]
                torch.mm(highs[start], slots, out=p)
                torch.mm(lows[start], slots, out=q)
                if start == 0:
                    own_part(own_matrix, data.columns[a:b], high)
                    if data.rows_scale != 1.0:
                        high.mul_(data.rows_scale)  # exact: a power of two
                    low.zero_()
                update(high, low, p, q)
                if stop == c:
                    high.add_(low)
                    out[a:b].t().copy_(high)

    return decode


def compiled_update(enabled: bool) -> tuple[Callable[..., None] | None, float]:
    """:func:`two_sum_update` through ``torch.compile`` (dynamic shapes), warmed on a small
    example; ``(None, seconds)`` where it cannot be compiled here."""
    if not enabled:
        return None, 0.0
    began = time.perf_counter()
    try:
        kernel = torch.compile(two_sum_update, dynamic=True)
        example = [torch.randn(8, 1000) for _ in range(4)]
        expected = [t.clone() for t in example]
        two_sum_update(*expected)
        kernel(*example)
        if not all(torch.equal(x, y) for x, y in zip(example, expected, strict=True)):
            print("two-float compiled: NOT bitwise equal to the eager TwoSum on the warm-up example")
    except Exception as exc:  # no compiler, no Python headers, ...: the study falls back to eager
        print(f"torch.compile unavailable ({type(exc).__name__}: {exc}); compiled variant skipped")
        return None, time.perf_counter() - began
    return kernel, time.perf_counter() - began


def relative_error(out: torch.Tensor, exact: torch.Tensor) -> float:
    return float((out.view(-1).double() - exact).norm() / exact.norm())


def cold_caches(buffer: torch.Tensor) -> None:
    """Evict the caches by reading a buffer far larger than them (no dirty lines left behind)."""
    buffer.sum()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1,16,64", help="data per rank in MB (float32)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile variant")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    code = codes.perturbed(4, 8)
    n, c = code.world_size, code.components
    update, compile_s = compiled_update(not args.no_compile)
    if update is not None:
        print(f"two-float compiled: first compile + warm-up {compile_s:.1f} s (dynamic shapes, one graph)")
    flush = torch.ones(64 << 20 >> 2)
    rate = copy_bandwidth()
    print(f"load average {os.getloadavg()[0]:.2f}; copy rate {rate / 1e9:.2f} GB/s (read + write), one thread")
    print(f"{'MB':>4} {'variant':<20} {'worst error':>11} {'vs f64':>7} {'ms':>8} {'vs f64':>7} {'x limit':>8}")
    for size in [float(s) for s in args.sizes.split(",")]:
        d = int(size * (1 << 20)) // 4 // c * c
        inputs = [torch.randn(d, generator=torch.Generator().manual_seed(100 + j)) for j in range(n)]
        exact = torch.stack([x.double() for x in inputs]).sum(0)
        ranks = simulate_ring(code, inputs)
        variants: dict[str, Callable[[RankData], Decoder]] = {
            "float64 torch ops": float64_decoder,
            "float32": lambda data: float32_decoder(data, split_weights=False),
            "f32 W hi+lo": lambda data: float32_decoder(data, split_weights=True),
            "two-float": lambda data: two_float_decoder(data, two_sum_update),
        }
        if native.status().startswith("on"):
            variants["fused C (kept)"] = fused_decoder
        if update is not None:
            variants["two-float compiled"] = lambda data, kernel=update: two_float_decoder(data, kernel)
        out = torch.empty(d // c, c)
        errors = {}
        for name, make in variants.items():
            worst = 0.0
            for data in ranks:
                make(data)(out)
                worst = max(worst, relative_error(out, exact))
            errors[name] = worst
        decoders = {name: make(ranks[0]) for name, make in variants.items()}
        times: dict[str, list[float]] = {name: [] for name in decoders}
        for decode in decoders.values():
            decode(out)  # warm: buffers faulted in
        for _ in range(args.repeats):
            for name, decode in decoders.items():
                cold_caches(flush)
                began = time.perf_counter()
                decode(out)
                times[name].append(time.perf_counter() - began)
        limit = d * (4 + 2 * 4) / rate  # cerar.experiments.bench.limit: decode reads s_p + s_x, writes s_x
        base = "float64 torch ops"
        for name in decoders:
            median = statistics.median(times[name])
            paired = statistics.median(t / b for t, b in zip(times[name], times[base], strict=True))
            print(
                f"{size:>4g} {name:<20} {errors[name]:>11.4e} {errors[name] / errors[base]:>7.3f} "
                f"{median * 1e3:>8.2f} {paired:>7.3f} {median / limit:>8.2f}"
            )
    print(f"load average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
