"""The exact ring all-reduce (reduce-scatter, then all-gather) on cerar's engine, optionally with a
16-bit wire: the baseline that isolates CERAR's coding gain, on the same transport."""

from __future__ import annotations

import functools
import math

import torch

from cerar.comm.kernels.decode import scale_by_power_of_two
from cerar.comm.kernels.workspace import WORKSPACE
from cerar.comm.ring.engine import Action, Piece, Program, run_program, segments
from cerar.comm.ring.links import Ring
from cerar.comm.ring.stats import CommStats

__all__ = ["run_ring"]


def run_ring(
    flat: torch.Tensor,
    ring: Ring,
    stats: CommStats,
    wire_dtype: torch.dtype | None = None,
    scale_exponent: int = 0,
) -> torch.Tensor:
    """Exact ring all-reduce (reduce-scatter then all-gather) of the contiguous 1-d ``flat``,
    in place. With ``wire_dtype`` the chunks travel in that dtype and are accumulated in
    ``flat``'s dtype; the values are divided by ``2**scale_exponent`` before the ring and
    multiplied back after (exact), to keep float16 sums in range."""
    n = ring.size
    d = flat.numel()
    chunk = math.ceil(d / n)
    wire = wire_dtype or flat.dtype
    padded = WORKSPACE.padded("ring_padded", flat, n * chunk)
    scale_by_power_of_two(padded, -scale_exponent)
    chunks = padded.view(n, chunk)
    send = WORKSPACE.get("ring_send", (2, chunk), wire, flat.device)
    recv = WORKSPACE.get("ring_recv", (2, chunk), wire, flat.device)
    widened = WORKSPACE.get("ring_widened", (chunk,), flat.dtype, flat.device) if wire != flat.dtype else None
    r = ring.rank
    owned = (r + 1) % n  # fully reduced here after the reduce-scatter
    rounds = []
    for t in range(1, 2 * (n - 1) + 1):
        pieces = []
        for a, b in segments(chunk, flat.element_size()):
            out, arrived = send[t % 2, a:b], recv[t % 2, a:b]
            index = (r - t + 1) % n if t < n else (r + 1 - (t - n)) % n
            prepare: Action = functools.partial(out.copy_, chunks[index, a:b])
            if t == n and wire != flat.dtype:
                # Every rank must end with the same values: the owner keeps what it sends.
                prepare = functools.partial(_both, functools.partial(_round_to, chunks[owned, a:b], wire), prepare)
            received: Action
            if t < n:  # reduce-scatter: accumulate in flat's dtype
                into = chunks[(r - t) % n, a:b]
                if widened is not None:
                    received = functools.partial(_add_widened, into, arrived, widened[a:b])
                else:
                    received = functools.partial(into.add_, arrived)
            else:  # all-gather: take the owner's values
                received = functools.partial(chunks[(r - (t - n)) % n, a:b].copy_, arrived)
            pieces.append(Piece(out, arrived, prepare, received))
        rounds.append(pieces)
    run_program(ring, stats, Program(rounds, flat.device))
    scale_by_power_of_two(padded, scale_exponent)
    if padded is not flat:
        flat.copy_(padded[:d])
    stats.peak_extra_bytes = max(stats.peak_extra_bytes, WORKSPACE.held_bytes)
    return flat


def _both(first: Action, second: Action) -> None:
    first()
    second()


def _round_to(values: torch.Tensor, wire: torch.dtype) -> None:
    values.copy_(values.to(wire))


def _add_widened(into: torch.Tensor, arrived: torch.Tensor, widened: torch.Tensor) -> None:
    widened.copy_(arrived)
    into.add_(widened)
