"""The ring over torch.distributed point-to-point ops, executing the core's schedule.

Two algorithms share one :class:`Ring` (who sends to whom, in group-local order) and one
``exchange`` step (receive posted first, then send, as Gloo needs):

* :func:`run_cerar` executes a :class:`cerar.schedule.RankPlan`: each round adds the precomputed
  increment to the packet received last round and sends it on; packets of the observation
  rounds land directly in the observation buffer; one decode at the end.
* :func:`run_ring` is the exact reduce-scatter + all-gather ring, optionally with a 16-bit wire.

Increments are computed in blocks of rounds, one matrix product per block, while a round's
transfer is in flight (Gloo and NCCL progress transfers on their own threads), so each round's
critical path is one add and one send.
Device-agnostic: the tensors' device is used throughout (CPU on Gloo, CUDA on NCCL).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from cerar.code import Code
from cerar.schedule import Schedule
from cerar.stats import CommStats

_DECODE_CHUNK = 1 << 15  # columns per float64 decode chunk: bounds the temporary memory


class Workspace:
    """Named scratch buffers reused across calls.

    Fresh multi-megabyte allocations cost more than the arithmetic done in them (every page is
    faulted in on first touch), so buffers are kept and only grown. ``held_bytes`` is what the
    workspace holds now: the collective's extra memory beyond the caller's tensor.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.dtype, str], torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        key = (name, dtype, str(device))
        size = math.prod(shape)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < size:
            buffer = torch.empty(size, dtype=dtype, device=device)
            self._buffers[key] = buffer
        return buffer[:size].view(shape)

    @property
    def held_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def clear(self) -> None:
        self._buffers.clear()


#: One workspace for the process: all cerar calls run on one communication thread.
WORKSPACE = Workspace()


@dataclass(frozen=True)
class Ring:
    """This rank's place on a one-directional ring over ``group`` (group-local numbering)."""

    group: dist.ProcessGroup | None
    rank: int
    size: int
    send_to: int  # global rank of rank + 1
    recv_from: int  # global rank of rank - 1

    @classmethod
    def of(cls, group: dist.ProcessGroup | None) -> Ring | None:
        """The ring of the calling process over ``group``, or None if it is not a member."""
        rank = dist.get_rank(group)
        if rank < 0:
            return None
        size = dist.get_world_size(group)

        def to_global(r: int) -> int:
            return r if group is None else dist.get_global_rank(group, r)

        return cls(group, rank, size, to_global((rank + 1) % size), to_global((rank - 1) % size))


def _start(ring: Ring, send: torch.Tensor, recv: torch.Tensor, stats: CommStats) -> list[dist.Work]:
    ops = [
        dist.P2POp(dist.irecv, recv, ring.recv_from, ring.group),
        dist.P2POp(dist.isend, send, ring.send_to, ring.group),
    ]
    stats.bytes_sent += send.numel() * send.element_size()
    stats.bytes_received += recv.numel() * recv.element_size()
    stats.rounds += 1
    return dist.batch_isend_irecv(ops)


class RingError(RuntimeError):
    """A ring transfer failed: a neighbour died, stalled past the timeout, or closed."""


def _finish(works: list[dist.Work], ring: Ring, round: int) -> None:
    try:
        for work in works:
            work.wait()
    except RuntimeError as exc:
        raise RingError(
            f"cerar: ring round {round} failed on group rank {ring.rank} (receiving from global "
            f"rank {ring.recv_from}, sending to global rank {ring.send_to}): a peer died or "
            f"stalled past the process group's timeout. Cause: {exc}"
        ) from exc


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


def run_cerar(flat: torch.Tensor, code: Code, ring: Ring, stats: CommStats) -> torch.Tensor:
    """Run CERAR on this rank's contiguous 1-d ``flat`` (float32 or float64) and write the
    decoded sum into it. Returns ``flat``. ``stats`` accumulates the call's figures."""
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
    # blocks, each computed while the first round of the previous block is on the wire, into
    # one of two alternating buffers (the other still feeds the rounds in flight).
    block = encode_block_size(n_ranks, rounds)
    bounds = [(0, 1)] + [(s, min(s + block, rounds)) for s in range(1, rounds, block)]
    buffers = [WORKSPACE.get(f"increments{i}", (block, m), dtype, device) for i in range(2)]
    encode_s = 0.0

    def encode(k: int) -> torch.Tensor:
        nonlocal encode_s
        began = time.perf_counter()
        start, stop = bounds[k]
        out = buffers[k % 2][: stop - start]
        torch.mm(plan.increments[start:stop], own, out=out)  # into a kept buffer: no page faults
        encode_s += time.perf_counter() - began
        return out

    observations = WORKSPACE.get("observations", (c, m), dtype, device)
    scratch = WORKSPACE.get("scratch", (m,), dtype, device)  # receives before the first observation
    send = WORKSPACE.get("send", (m,), dtype, device)
    blocks = {0: encode(0)}
    received: torch.Tensor | None = None
    k = 0
    for t in range(1, rounds + 1):
        if t - 1 >= bounds[k][1]:
            blocks.pop(k)
            k += 1
        offset = t - 1 - bounds[k][0]
        increment = blocks[k][offset]
        if received is None:
            send.copy_(increment)
        else:
            torch.add(received, increment, out=send)
        slot = t - plan.first_observed_round
        target = observations[slot] if slot >= 0 else scratch
        works = _start(ring, send, target, stats)
        if offset == 0 and k + 1 < len(bounds):
            blocks[k + 1] = encode(k + 1)  # overlaps this round's transfer
        _finish(works, ring, t)
        received = target
    began = time.perf_counter()
    _decode_into(own, observations, plan)
    stats.decode_s += time.perf_counter() - began
    stats.encode_s += encode_s
    stats.peak_extra_bytes = max(stats.peak_extra_bytes, WORKSPACE.held_bytes)
    if padded is not flat:
        flat.copy_(padded[:d])
    return flat


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
    send = WORKSPACE.get("ring_send", (chunk,), wire, flat.device)
    recv = WORKSPACE.get("ring_recv", (chunk,), wire, flat.device)
    widened = WORKSPACE.get("ring_widened", (chunk,), flat.dtype, flat.device) if wire != flat.dtype else recv
    r = ring.rank
    for step in range(n - 1):  # reduce-scatter
        send.copy_(chunks[(r - step) % n])
        _finish(_start(ring, send, recv, stats), ring, step + 1)
        if widened is not recv:
            widened.copy_(recv)
        chunks[(r - step - 1) % n].add_(widened)
    owned = (r + 1) % n
    if wire != flat.dtype:
        # Every rank must end with the same values: the owner keeps what it sends.
        chunks[owned].copy_(chunks[owned].to(wire))
    for step in range(n - 1):  # all-gather
        send.copy_(chunks[(r + 1 - step) % n])
        _finish(_start(ring, send, recv, stats), ring, n + step)
        chunks[(r - step) % n].copy_(recv)
    if scale != 1.0:
        padded.mul_(scale)
    if padded is not flat:
        flat.copy_(padded[:d])
    stats.peak_extra_bytes = max(stats.peak_extra_bytes, WORKSPACE.held_bytes)
    return flat
