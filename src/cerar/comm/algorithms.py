"""The two ring algorithms, on the pipelined engine of :mod:`cerar.comm.transport`.

* :func:`run_cerar` executes a :class:`cerar.protocol.schedule.RankPlan`: each round adds the precomputed
  increment to the packet received last round and sends it on; packets of the observation
  rounds land directly in the observation buffer; each column piece is decoded as soon as the
  last round's piece has arrived, while the rest is still on the wire.
* :func:`run_ring` is the exact reduce-scatter + all-gather ring, optionally with a 16-bit wire.

Increments are computed in blocks of rounds, one matrix product per block, once a round is on
the wire, so each round's critical path is one add and one send.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from cerar.coding.code import Code
from cerar.comm.handshake import FlagChain, all_finite
from cerar.comm.stats import CommStats
from cerar.comm.transport import WORKSPACE, Ring, run_rounds, segments
from cerar.protocol.schedule import Schedule

_DECODE_CHUNK = 1 << 15  # columns per float64 decode chunk: bounds the temporary memory


# ---------------------------------------------------------------------------------------------
# CERAR


@dataclass(frozen=True)
class _TorchPlan:
    increments: torch.Tensor  # (L, c), packet dtype
    decode_own: torch.Tensor  # (c, c), float64
    decode_obs: torch.Tensor  # (c, c), float64
    first_observed_round: int


_PLANS: dict[tuple[str, int, torch.dtype, str], _TorchPlan] = {}


def _torch_plan(code: Code, rank: int, dtype: torch.dtype, device: torch.device) -> _TorchPlan:
    key = (code.fingerprint, rank, dtype, str(device))
    if key not in _PLANS:
        plan = Schedule.for_code(code).plan(code, rank)
        c = code.components
        decode = torch.from_numpy(plan.decode).to(device=device, dtype=torch.float64)
        _PLANS[key] = _TorchPlan(
            increments=torch.from_numpy(plan.increments).to(device=device, dtype=dtype),
            decode_own=decode[:, :c].contiguous(),
            decode_obs=decode[:, c:].contiguous(),
            first_observed_round=plan.first_observed_round,
        )
    return _PLANS[key]


def encode_block_size(world_size: int, rounds: int) -> int:
    """Rounds per increment block: two blocks in memory are about ``N`` packets, the
    protocol's storage beyond a rank's own data."""
    return max(1, min(rounds, math.ceil(world_size / 2)))


def run_cerar(
    flat: torch.Tensor, code: Code, ring: Ring, stats: CommStats, flags: FlagChain | None = None
) -> list[int]:
    """Run CERAR on this rank's contiguous 1-d ``flat`` (float32 or float64) and write the
    decoded sum into it. ``stats`` accumulates the call's figures.

    With ``flags``, each rank checks its input for NaN/Inf while round 1 is on the wire and the
    flags travel beside rounds ``2 .. N`` (:class:`cerar.comm.handshake.FlagChain`); if any rank
    is flagged, no rank decodes and ``flat`` keeps its input (the caller raises or falls back).
    Returns the flagged group ranks (empty: ``flat`` holds the sum).
    """
    # Longer than most functions on purpose: the four callbacks of the round engine below share
    # this call's buffers, plan and block bounds; split apart, they would need an object that
    # holds one call's state, and the critical path (prepare) would pay attribute look-ups.
    c, n_ranks = code.components, code.world_size
    d = flat.numel()
    m = math.ceil(d / c)
    dtype, device = flat.dtype, flat.device
    plan = _torch_plan(code, ring.rank, dtype, device)
    rounds = plan.increments.shape[0]
    if d == c * m:
        padded = flat
    else:
        padded = WORKSPACE.get("padded", (c * m,), dtype, device)
        padded[:d].copy_(flat)
        padded[d:].zero_()
    own = padded.view(c, m)

    # Round 1's increment is computed alone (it is on the critical path); later rounds come in
    # blocks, each computed once the first round of the previous block is on the wire, into
    # one of two alternating buffers (the other still feeds the rounds being prepared).
    block = encode_block_size(n_ranks, rounds)
    bounds = [(0, 1)] + [(s, min(s + block, rounds)) for s in range(1, rounds, block)]
    first_round = [start + 1 for start, _ in bounds]
    buffers = [WORKSPACE.get(f"increments{i}", (block, m), dtype, device) for i in range(2)]
    timing = {"encode": 0.0, "decode": 0.0}
    decision: dict[str, list[int]] = {}  # the flagged ranks, once every rank's flag is in

    def encode(k: int) -> torch.Tensor:
        began = time.perf_counter()
        start, stop = bounds[k]
        out = buffers[k % 2][: stop - start]
        torch.mm(plan.increments[start:stop], own, out=out)  # into a kept buffer: no page faults
        timing["encode"] += time.perf_counter() - began
        return out

    observations = WORKSPACE.get("observations", (c, m), dtype, device)
    scratch = WORKSPACE.get("scratch", (2, m), dtype, device)  # receives before the first observation
    send = WORKSPACE.get("send", (2, m), dtype, device)
    blocks = {0: encode(0)}
    block_of_round = [k for k, (start, stop) in enumerate(bounds) for _ in range(start, stop)]

    def target(t: int, a: int, b: int) -> torch.Tensor:
        slot = t - plan.first_observed_round
        return observations[slot, a:b] if slot >= 0 else scratch[t % 2, a:b]

    def prepare(t: int, a: int, b: int) -> torch.Tensor:
        if flags is not None and t > 1 and a == 0:
            flags.step(t)  # this round's hop of the flags, beside its first piece
        k = block_of_round[t - 1]
        increment = blocks[k][t - 1 - bounds[k][0], a:b]
        out = send[t % 2, a:b]
        if t == 1:
            out.copy_(increment)
        else:
            torch.add(target(t - 1, a, b), increment, out=out)
        return out

    def posted(t: int) -> None:
        if flags is not None and t == 1:
            flags.set_own(all_finite(own))  # one pass over the input, while round 1 is on the wire
        k = block_of_round[t - 1]
        if t == first_round[k] and k + 1 < len(bounds):
            blocks.pop(k - 1, None)  # its rounds are all prepared: its buffer is free
            blocks[k + 1] = encode(k + 1)

    def received(t: int, a: int, b: int) -> None:
        if t == rounds and "flagged" not in decision:
            decision["flagged"] = flags.flagged(rounds + 1) if flags is not None else []
        if t == rounds and not decision["flagged"]:  # this piece's observations are complete: decode it
            began = time.perf_counter()
            _decode_into(own[:, a:b], observations[:, a:b], plan)
            timing["decode"] += time.perf_counter() - began

    run_rounds(ring, stats, rounds, segments(m, flat.element_size()), prepare, target, received, posted)
    stats.encode_s += timing["encode"]
    stats.decode_s += timing["decode"]
    stats.peak_extra_bytes = max(stats.peak_extra_bytes, WORKSPACE.held_bytes)
    if "flagged" not in decision:  # no piece at all (an empty tensor): nothing was decoded
        decision["flagged"] = flags.flagged(rounds + 1) if flags is not None else []
    if padded is not flat and not decision["flagged"]:
        flat.copy_(padded[:d])
    return decision["flagged"]


def _decode_into(own: torch.Tensor, observations: torch.Tensor, plan: _TorchPlan) -> None:
    """``own <- decode_own @ own + decode_obs @ observations``, in float64, column chunk by
    column chunk so that the temporaries stay small and the result overwrites ``own``."""
    c, m = own.shape
    width = min(m, _DECODE_CHUNK)
    own64 = WORKSPACE.get("decode_own", (c, width), torch.float64, own.device)
    obs64 = WORKSPACE.get("decode_obs", (c, width), torch.float64, own.device)
    out64 = WORKSPACE.get("decode_out", (c, width), torch.float64, own.device)
    for start in range(0, m, width):
        stop = min(m, start + width)
        n = stop - start
        a, b, out = own64[:, :n], obs64[:, :n], out64[:, :n]
        a.copy_(own[:, start:stop])
        b.copy_(observations[:, start:stop])
        torch.mm(plan.decode_own, a, out=out)
        out.addmm_(plan.decode_obs, b)
        own[:, start:stop].copy_(out)


# ---------------------------------------------------------------------------------------------
# Exact ring


def run_ring(
    flat: torch.Tensor,
    ring: Ring,
    stats: CommStats,
    wire_dtype: torch.dtype | None = None,
    scale: float = 1.0,
) -> torch.Tensor:
    """Exact ring all-reduce (reduce-scatter then all-gather) of the contiguous 1-d ``flat``,
    in place. With ``wire_dtype`` the chunks travel in that dtype and are accumulated in
    ``flat``'s dtype; ``scale`` (a power of two) is applied before the ring and undone after,
    to keep float16 sums in range."""
    n = ring.size
    d = flat.numel()
    chunk = math.ceil(d / n)
    wire = wire_dtype or flat.dtype
    if d == n * chunk:
        padded = flat
    else:
        padded = WORKSPACE.get("ring_padded", (n * chunk,), flat.dtype, flat.device)
        padded[:d].copy_(flat)
        padded[d:].zero_()
    if scale != 1.0:
        padded.mul_(1.0 / scale)
    chunks = padded.view(n, chunk)
    send = WORKSPACE.get("ring_send", (2, chunk), wire, flat.device)
    recv = WORKSPACE.get("ring_recv", (2, chunk), wire, flat.device)
    widened = WORKSPACE.get("ring_widened", (chunk,), flat.dtype, flat.device) if wire != flat.dtype else None
    r = ring.rank
    owned = (r + 1) % n  # fully reduced here after the reduce-scatter

    def prepare(t: int, a: int, b: int) -> torch.Tensor:
        if t == n and wire != flat.dtype:
            # Every rank must end with the same values: the owner keeps what it sends.
            chunks[owned, a:b].copy_(chunks[owned, a:b].to(wire))
        index = (r - t + 1) % n if t < n else (r + 1 - (t - n)) % n
        out = send[t % 2, a:b]
        out.copy_(chunks[index, a:b])
        return out

    def target(t: int, a: int, b: int) -> torch.Tensor:
        return recv[t % 2, a:b]

    def received(t: int, a: int, b: int) -> None:
        arrived = recv[t % 2, a:b]
        if t < n:  # reduce-scatter: accumulate in flat's dtype
            if widened is not None:
                widened[a:b].copy_(arrived)
                arrived = widened[a:b]
            chunks[(r - t) % n, a:b].add_(arrived)
        else:  # all-gather: take the owner's values
            chunks[(r - (t - n)) % n, a:b].copy_(arrived)

    run_rounds(ring, stats, 2 * (n - 1), segments(chunk, flat.element_size()), prepare, target, received)
    if scale != 1.0:
        padded.mul_(scale)
    if padded is not flat:
        flat.copy_(padded[:d])
    stats.peak_extra_bytes = max(stats.peak_extra_bytes, WORKSPACE.held_bytes)
    return flat
