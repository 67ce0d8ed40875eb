"""Issue 22, item 3: CERAR's memory-bound coding ops, as today's separate passes against
hand-fused torch ops and ``torch.compile`` (inductor) kernels: time, bytes, ratio to the copy
limit, numerical equality, compile time.

    python benchmarks/fused_kernels.py
    python benchmarks/fused_kernels.py --sizes 16,64 --repeats 21 --no-compile
    python benchmarks/fused_kernels.py --ops send --repeats 41 --no-compile

One process, one thread (``torch.set_num_threads(1)``, as each rank of ``cerar bench``), N = 4,
c = 8, data of ``--sizes`` MB of float32 per rank, so a packet holds ``m = d / 8`` values, cut
into the engine's pieces (:func:`cerar.comm.transport.segments`). Each op is timed over all the
pieces of one round (or of one group of slots), the variants alternating, ``--repeats`` times,
each after a read of a 64 MB buffer (caches cold, as after a round's transfers); medians.

1. ``send``: a round's packet, received + increment, cast to the packet dtype (float16: today
   ``torch.add`` into a float32 buffer, then ``copy_`` into the send buffer). Minimum bytes per
   packet value: read the increment (4) and the received (s_p), write the packet (s_p).
2. ``fold``: one group of 3 observation slots into the ``(c, w)`` accumulator (float32 for
   16-bit packets, float64 for float32 ones; today the slots are first widened into an
   accumulator-dtype buffer for ``addmm``); ``fold+own``: the first group, which starts the
   accumulator from the own part ``D X`` (computed by MKL in float32, outside the timing).
   Minimum: read 3 slots, read and write the accumulator (the first group: read the own part).
3. ``write-back``: the accumulator written into the input's ``(w, c)`` layout (today
   ``out.copy_(acc.t())``); ``last+wb``: the last group (2 slots) and the write-back together.

``ratio`` is the median of each repeat's time over today's, side by side; ``moved`` and ``min``
are the MB the variant reads + writes and the least the op must; ``x limit`` is the time over
(``min`` / copy rate), the rate :func:`cerar.experiments.bench.limit.copy_bandwidth`'s, in the
same run. ``equal`` says
whether a variant's result is bitwise that of today's; where the summation order differs it
gives the largest difference relative to the largest value. Run it twice: the second run shows
the compile time with inductor's on-disk cache warm.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch

from cerar.comm.transport import segments
from cerar.experiments.bench.limit import copy_bandwidth

C = 8
GROUP = 3  # slot_groups(8): (0, 3), (3, 6), (6, 8)

# ---------------------------------------------------------------------------------------------
# The kernels, eager; torch.compile of the same functions gives the compiled variants.


def send_fused(increment: torch.Tensor, received: torch.Tensor, out: torch.Tensor) -> None:
    """``out = received + increment``, computed in the common (wider) dtype, rounded once."""
    out.copy_(increment + received)


def fold_rows(total: torch.Tensor, weights: torch.Tensor, rows: list[torch.Tensor]) -> None:
    """``total += weights @ rows``, one slot (a contiguous row, any float dtype) at a time."""
    acc = total
    for s in range(len(rows)):
        acc = acc + weights[:, s : s + 1] * rows[s].to(total.dtype)
    total.copy_(acc)


def fold_rows_from(
    total: torch.Tensor, start: torch.Tensor, scale: torch.Tensor, weights: torch.Tensor, rows: list[torch.Tensor]
) -> None:  # fmt: skip
    """``total = scale * start + weights @ rows`` (``start`` the own part, ``scale`` 0-d)."""
    acc = start.to(total.dtype) * scale
    for s in range(len(rows)):
        acc = acc + weights[:, s : s + 1] * rows[s].to(total.dtype)
    total.copy_(acc)


def fold_rows_out(out_t: torch.Tensor, total: torch.Tensor, weights: torch.Tensor, rows: list[torch.Tensor]) -> None:
    """The last group and the write-back: ``out_t = total + weights @ rows`` (``out_t`` the
    transposed view of the output, in the data's dtype)."""
    acc = total
    for s in range(len(rows)):
        acc = acc + weights[:, s : s + 1] * rows[s].to(total.dtype)
    out_t.copy_(acc)


def write_back(out_t: torch.Tensor, total: torch.Tensor) -> None:
    out_t.copy_(total)


def compile_all(enabled: bool) -> tuple[dict[str, Callable[..., None]], float]:
    """The compiled kernels (dynamic shapes), or none where torch.compile fails here; each is
    built at its first call of a new kind of input (dtypes, a piece at offset 0 or not), which
    the study makes outside its timings (``first call``)."""
    if not enabled:
        return {}, 0.0
    began = time.perf_counter()
    try:
        kernels = {
            f.__name__: torch.compile(f, dynamic=True)
            for f in (send_fused, fold_rows, fold_rows_from, fold_rows_out, write_back)
        }
        x = torch.randn(16)
        kernels["send_fused"](x, x.half(), torch.empty(16, dtype=torch.float16))  # inductor loads, gcc runs
    except Exception as exc:  # no compiler or headers: eager only
        print(f"torch.compile unavailable ({type(exc).__name__}: {exc}); compiled variants skipped")
        return {}, time.perf_counter() - began
    return kernels, time.perf_counter() - began


# ---------------------------------------------------------------------------------------------
# Timing


def compiled_graphs() -> int:
    """Graphs torch.compile has built so far in this process."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


class Timer:
    """The variants of one op, the first today's: each run once (warm: pages faulted in, kernels
    compiled), then all alternately, after a cold-cache read, ``repeats`` times."""

    def __init__(self, flush: torch.Tensor, rate: float, min_bytes: float) -> None:
        self.flush, self.rate, self.min_bytes = flush, rate, min_bytes
        self.variants: dict[str, tuple[Callable[[], None], float, torch.Tensor]] = {}
        self.first_s: dict[str, float] = {}

    def add(self, name: str, run: Callable[[], None], moved_bytes: float, result: torch.Tensor) -> None:
        """``run`` writes its result into ``result``; it moves ``moved_bytes`` (reads + writes)."""
        began = time.perf_counter()
        run()
        self.first_s[name] = time.perf_counter() - began
        self.variants[name] = (run, moved_bytes, result.clone())

    def report(self, size: float, op: str, repeats: int, compiled: bool) -> None:
        before = compiled_graphs() if compiled else 0
        times: dict[str, list[float]] = {name: [] for name in self.variants}
        for _ in range(repeats):
            for name, (run, _, _) in self.variants.items():
                self.flush.sum()
                began = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - began)
        rebuilt = compiled and compiled_graphs() != before
        base_name = next(iter(self.variants))
        base_result = self.variants[base_name][2]
        for name, (_, moved, result) in self.variants.items():
            median = statistics.median(times[name])
            paired = statistics.median(t / b for t, b in zip(times[name], times[base_name], strict=True))
            note = "" if name == base_name else difference(result, base_result)
            if name == "compiled":
                note += f"; first call {self.first_s[name]:.1f} s" + ("; RECOMPILED IN TIMING" if rebuilt else "")
            print(
                f"{size:>4g} {op:<19} {name:<15} {median * 1e3:>8.3f} {paired:>6.3f} {moved / 2**20:>7.1f} "
                f"{self.min_bytes / 2**20:>7.1f} {median / (self.min_bytes / self.rate):>7.2f}  {note}"
            )


def difference(a: torch.Tensor, b: torch.Tensor) -> str:
    """``bitwise`` if equal, else the largest difference relative to the largest value."""
    if torch.equal(a, b):
        return "bitwise"
    return f"max diff {float((a.double() - b.double()).abs().max() / b.double().abs().max()):.1e}"


# ---------------------------------------------------------------------------------------------
# The ops


def study_send(size: float, m: int, packet: torch.dtype, kernels: dict, timer_args: tuple, repeats: int) -> None:
    """1. A round's packet: received + increment, rounded once to the packet dtype."""
    s_p = torch.empty((), dtype=packet).element_size()
    pieces = segments(m, s_p)
    increment, received = torch.randn(m), torch.randn(m).to(packet)
    encoded, out = torch.empty(m), torch.empty(m, dtype=packet)
    timer = Timer(*timer_args, min_bytes=m * (4 + 2 * s_p))

    def today() -> None:
        for a, b in pieces:
            if packet == torch.float32:
                torch.add(received[a:b], increment[a:b], out=out[a:b])
            else:  # CerarRun's prepare: add in the data's dtype, then round
                torch.add(increment[a:b], received[a:b], out=encoded[a:b])
                out[a:b].copy_(encoded[a:b])

    def fused() -> None:
        for a, b in pieces:
            torch.add(increment[a:b], received[a:b], out=out[a:b])

    def compiled() -> None:
        for a, b in pieces:
            kernels["send_fused"](increment[a:b], received[a:b], out[a:b])

    timer.add("today", today, m * (4 + s_p + 8 + s_p) if s_p == 2 else m * 12, out)
    if packet == torch.float16:
        timer.add("add out=fp16", fused, m * (4 + 2 * s_p), out)
    if kernels:
        timer.add("compiled", compiled, m * (4 + 2 * s_p), out)
    timer.report(size, f"send {'fp16' if s_p == 2 else 'fp32'}", repeats, bool(kernels))


def study_decode(size: float, m: int, packet: torch.dtype, kernels: dict, timer_args: tuple, repeats: int) -> None:
    """2 and 3. The folds of the decode and its write-back."""
    generator = torch.Generator().manual_seed(7)
    acc_dtype = torch.float32 if packet == torch.float16 else torch.float64
    s_p, s_a = torch.empty((), dtype=packet).element_size(), torch.empty((), dtype=acc_dtype).element_size()
    name = "fp16>f32" if s_p == 2 else "fp32>f64"
    pieces = segments(m, s_p)
    widest = max(b - a for a, b in pieces)
    observations = torch.randn(C, m, generator=generator).to(packet)
    weights = torch.randn(C, C, generator=generator, dtype=torch.float64).to(acc_dtype)
    group_w, last_w = weights[:, :GROUP].contiguous(), weights[:, C - 2 :].contiguous()
    decode_own = torch.randn(C, C, generator=generator)
    columns = torch.randn(m, C, generator=generator)  # the input's (w, c) rows
    own = torch.empty(C, widest)
    base = torch.randn(C * m, generator=generator, dtype=acc_dtype)
    total = torch.empty(C * m, dtype=acc_dtype)
    arrived = torch.empty(GROUP, widest, dtype=acc_dtype)
    scale = torch.ones((), dtype=acc_dtype)
    out = torch.empty(m, C)

    def acc(a: int, b: int) -> torch.Tensor:
        return total[C * a : C * b].view(C, b - a)

    def rows(a: int, b: int, first: int, stop: int) -> list[torch.Tensor]:
        return [observations[s, a:b] for s in range(first, stop)]

    def widened(a: int, b: int, first: int, stop: int) -> torch.Tensor:
        slots = arrived[: stop - first, : b - a]
        slots.copy_(observations[first:stop, a:b])
        return slots

    def fold_today() -> None:  # a middle group of 3 slots, from `base`
        for a, b in pieces:
            acc(a, b).addmm_(group_w, widened(a, b, 0, GROUP))

    def fold_compiled() -> None:
        for a, b in pieces:
            kernels["fold_rows"](acc(a, b), group_w, rows(a, b, 0, GROUP))

    timer = Timer(*timer_args, min_bytes=m * (GROUP * s_p + 2 * C * s_a))
    for variant, run, moved in (("today", fold_today, GROUP * (s_p + 2 * s_a)), ("compiled", fold_compiled, 0)):
        if variant == "compiled" and not kernels:
            continue
        total.copy_(base)  # each variant's result from the same start (the timings accumulate on)
        timer.add(variant, run, m * (GROUP * s_p + 2 * C * s_a + moved), total)
    timer.report(size, f"fold {name}", repeats, bool(kernels))

    def first_today() -> None:  # the first group, from the own part D X (MKL, float32)
        for a, b in pieces:
            start = torch.mm(decode_own, columns[a:b].t(), out=own[:, : b - a])
            acc(a, b).copy_(start)
            acc(a, b).addmm_(group_w, widened(a, b, 0, GROUP), beta=1.0)

    def first_into() -> None:  # float32 accumulator: D X straight into it
        for a, b in pieces:
            torch.mm(decode_own, columns[a:b].t(), out=acc(a, b))
            acc(a, b).addmm_(group_w, widened(a, b, 0, GROUP), beta=1.0)

    def first_compiled() -> None:
        for a, b in pieces:
            start = torch.mm(decode_own, columns[a:b].t(), out=own[:, : b - a])
            kernels["fold_rows_from"](acc(a, b), start, scale, group_w, rows(a, b, 0, GROUP))

    own_bytes = 4 * C * 2 + 4 * C  # D X: read the rows, write the own part
    timer = Timer(*timer_args, min_bytes=m * (GROUP * s_p + 4 * C + s_a * C + 4 * C))
    timer.add("today", first_today, m * (own_bytes + C * (4 + s_a) + GROUP * (s_p + 2 * s_a) + 2 * C * s_a), total)
    if s_a == 4:
        timer.add("D X into acc", first_into, m * (4 * C * 2 + GROUP * (s_p + 2 * s_a) + 2 * C * s_a), total)
    if kernels:
        timer.add("compiled", first_compiled, m * (own_bytes + 4 * C + GROUP * s_p + C * s_a), total)
    timer.report(size, f"fold+own {name}", repeats, bool(kernels))

    def back_today() -> None:
        for a, b in pieces:
            out[a:b].copy_(acc(a, b).t())

    def back_strided() -> None:  # the transposed output's view as the copy's target
        for a, b in pieces:
            out[a:b].t().copy_(acc(a, b))

    def back_compiled() -> None:
        for a, b in pieces:
            kernels["write_back"](out[a:b].t(), acc(a, b))

    timer = Timer(*timer_args, min_bytes=m * C * (s_a + 4))
    timer.add("today", back_today, m * C * (s_a + 4), out)
    timer.add("out.t().copy_", back_strided, m * C * (s_a + 4), out)
    if kernels:
        timer.add("compiled", back_compiled, m * C * (s_a + 4), out)
    timer.report(size, f"write-back {name}", repeats, bool(kernels))

    # The last group (2 slots) with the write-back; the accumulator restored from `base`
    # first (both variants pay that copy, counted in their bytes).
    def last_today(strided: bool = False) -> None:
        for a, b in pieces:
            acc(a, b).copy_(base[C * a : C * b].view(C, b - a))
            acc(a, b).addmm_(last_w, widened(a, b, C - 2, C))
            if strided:
                out[a:b].t().copy_(acc(a, b))
            else:
                out[a:b].copy_(acc(a, b).t())

    def last_compiled() -> None:
        for a, b in pieces:
            acc(a, b).copy_(base[C * a : C * b].view(C, b - a))
            kernels["fold_rows_out"](out[a:b].t(), acc(a, b), last_w, rows(a, b, C - 2, C))

    restore = 2 * C * s_a
    fused_bytes = m * (restore + 2 * s_p + C * s_a + 4 * C)
    timer = Timer(*timer_args, min_bytes=fused_bytes)
    today_bytes = m * (restore + 2 * (s_p + 2 * s_a) + 2 * C * s_a + C * (s_a + 4))
    timer.add("today", last_today, today_bytes, out)
    timer.add("out.t().copy_", lambda: last_today(strided=True), today_bytes, out)
    if kernels:
        timer.add("compiled", last_compiled, fused_bytes, out)
    timer.report(size, f"last+wb {name}", repeats, bool(kernels))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1,16,64", help="data per rank in MB (float32)")
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--ops", default="send,decode", help="which ops: send (1.), decode (2. and 3.)")
    parser.add_argument("--no-compile", action="store_true", help="eager variants only")
    args = parser.parse_args(argv)
    ops = set(args.ops.split(","))
    torch.set_num_threads(1)
    kernels, compile_s = compile_all(not args.no_compile)
    flush = torch.ones(64 << 20 >> 2)
    rate = copy_bandwidth()
    print(f"load average {os.getloadavg()[0]:.2f}; copy rate {rate / 1e9:.2f} GB/s (read + write), one thread")
    if kernels:
        print(f"torch.compile: inductor loaded and its first kernel built in {compile_s:.1f} s")
    print(f"{'MB':>4} {'op':<19} {'variant':<15} {'ms':>8} {'ratio':>6} {'moved':>7} {'min':>7} {'x limit':>7}  equal")
    for size in [float(s) for s in args.sizes.split(",")]:
        m = int(size * (1 << 20)) // 4 // C
        for packet in (torch.float16, torch.float32):
            if "send" in ops:
                study_send(size, m, packet, kernels, (flush, rate), args.repeats)
        for packet in (torch.float16, torch.float32):
            if "decode" in ops:
                study_decode(size, m, packet, kernels, (flush, rate), args.repeats)
    if kernels:
        print(f"compiled graphs: {compiled_graphs()}")
    print(f"load average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
