"""The ring over torch.distributed point-to-point ops: who talks to whom, scratch memory, and a
pipelined round engine that both algorithms of :mod:`cerar.comm.algorithms` run on.

Every round of a ring algorithm sends one packet to the next rank and receives one from the
previous; round ``t+1``'s packet depends on round ``t``'s only column by column. :func:`run_rounds`
therefore cuts each packet into column segments and keeps the link busy: segment ``s`` of round
``t+1`` is prepared and posted as soon as segment ``s`` of round ``t`` has arrived, while the
other segments are still on the wire. Receives are posted before sends (Gloo's send waits for
the peer's receive). Device-agnostic: CPU tensors on Gloo, CUDA tensors on NCCL.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from cerar.comm.stats import CommStats


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

    def release(self, name: str) -> None:
        """Drop the buffers called ``name`` (of every dtype and device)."""
        for key in [key for key in self._buffers if key[0] == name]:
            del self._buffers[key]

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
    peers: tuple[int, ...] = ()  # global rank of every position (empty: only the neighbours are known)

    @functools.cached_property
    def endpoints(self) -> tuple[dist.ProcessGroup, int, int]:
        """``(process group, group rank of recv_from, group rank of send_to)``: what the process
        group's own ``send``/``recv`` take, worked out once per ring instead of by
        ``dist.isend``/``dist.irecv``'s argument handling on every message."""
        pg = dist.group.WORLD if self.group is None else self.group
        if self.group is None:
            return pg, self.recv_from, self.send_to
        return pg, dist.get_group_rank(self.group, self.recv_from), dist.get_group_rank(self.group, self.send_to)

    def at_distance(self, distance: int) -> Ring:
        """This ring with the ranks ``distance`` positions ahead and behind as the neighbours
        (for :mod:`cerar.comm.handshake`'s dissemination hops); needs ``peers``."""
        if distance % self.size == 1 % self.size:
            return self
        if len(self.peers) != self.size:
            raise ValueError(f"Argument 'distance' other than 1 needs the ring's peers, not {distance!r} on {self!r}.")
        ahead, behind = self.peers[(self.rank + distance) % self.size], self.peers[(self.rank - distance) % self.size]
        return dataclasses.replace(self, send_to=ahead, recv_from=behind)

    @classmethod
    def of(cls, group: dist.ProcessGroup | None) -> Ring | None:
        """The ring of the calling process over ``group``, or None if it is not a member."""
        rank = dist.get_rank(group)
        if rank < 0:
            return None
        size = dist.get_world_size(group)

        def to_global(r: int) -> int:
            return r if group is None else dist.get_global_rank(group, r)

        peers = tuple(to_global(r) for r in range(size))
        return cls(group, rank, size, peers[(rank + 1) % size], peers[(rank - 1) % size], peers)


def group_timeout(group: dist.ProcessGroup | None) -> Any:
    """``group``'s timeout (``init_process_group(timeout=...)``), for the groups cerar creates
    from it: ``dist.new_group`` would otherwise give them its own default (30 minutes), and a
    dead peer would be noticed only then. ``None`` if the backend does not say."""
    pg = dist.group.WORLD if group is None else group
    for device in ("cpu", "cuda"):
        try:
            return pg._get_backend(torch.device(device)).options._timeout
        except (RuntimeError, AttributeError, ValueError):
            continue
    return None


class RingError(RuntimeError):
    """A ring transfer failed: a neighbour died, stalled past the timeout, or closed."""


def _ring_error(ring: Ring, round_index: int, exc: BaseException) -> RingError:
    return RingError(
        f"cerar: ring round {round_index} failed on group rank {ring.rank} (receiving from global "
        f"rank {ring.recv_from}, sending to global rank {ring.send_to}): a peer died or "
        f"stalled past the process group's timeout. Cause: {exc}"
    )


def wait_for(work: dist.Work, ring: Ring, round_index: int) -> None:
    """Wait for one posted message; a failure becomes :class:`RingError` naming the round."""
    try:
        work.wait()
    except RuntimeError as exc:
        raise _ring_error(ring, round_index, exc) from exc


#: The tag of cerar's data messages (a program's own point-to-point messages use 0 by default).
DATA_TAG = 0x0CE0

#: Post CPU tensors' pairs as one ``batch_isend_irecv`` batch too, the branch NCCL takes, so that
#: tests run it on Gloo (where it only adds the coalescing manager's cost). Process-wide.
BATCH_ON_CPU = False


def post_pair(
    send: torch.Tensor, recv: torch.Tensor, ring: Ring, round_index: int, tag: int = DATA_TAG
) -> tuple[dist.Work, dist.Work]:
    """Post one piece's receive and send together: ``(recv_work, send_work)``.

    On an accelerator (NCCL) as one batch: NCCL's maintainers advise grouping a ring step's send
    with the receive it pairs with (``batch_isend_irecv`` runs them under one NCCL group), as
    separate ``isend``/``irecv`` calls create two-rank communicators lazily and can deadlock in a
    ring. On the CPU (Gloo, which has no coalescing) ``batch_isend_irecv`` only adds its
    coalescing manager around the same two calls, which costs a sizeable share of a small hop
    (``docs/results.md``). So CPU tensors take the two plain calls, receive first (Gloo's send
    waits for the peer's receive), straight on the process group (:attr:`Ring.endpoints`: what
    ``dist.irecv``/``dist.isend`` call after checking their arguments, which a call's dozens of
    messages would otherwise repeat).
    """
    try:
        if send.device.type == "cpu" and not BATCH_ON_CPU:
            pg, source, destination = ring.endpoints
            recv_work = pg.recv([recv], source, tag)
            return recv_work, pg.send([send], destination, tag)
        ops = [
            dist.P2POp(dist.irecv, recv, ring.recv_from, ring.group, tag),
            dist.P2POp(dist.isend, send, ring.send_to, ring.group, tag),
        ]
        works = dist.batch_isend_irecv(ops)
    except RuntimeError as exc:  # posting to a pair whose peer has gone raises at once, not on wait
        raise _ring_error(ring, round_index, exc) from exc
    if len(works) == 1:  # NCCL may return one handle for the coalesced batch: it covers both
        return works[0], works[0]
    recv_work, send_work = works
    return recv_work, send_work


_SEGMENT_BYTES = 256 * 1024
_MAX_SEGMENTS = 16


def segments(values: int, itemsize: int) -> list[tuple[int, int]]:
    """Column ranges ``[a, b)`` that cut a packet of ``values`` values into pieces of about
    256 KiB (at most 16): enough pieces to keep the link busy between rounds, few enough that
    per-message overhead stays small."""
    count = max(1, min(_MAX_SEGMENTS, (values * itemsize) // _SEGMENT_BYTES))
    edges = [round(values * k / count) for k in range(count + 1)]
    return [(a, b) for a, b in itertools.pairwise(edges) if b > a]


#: ``f(t, a, b)``: the view of round ``t``'s packet columns ``[a, b)`` to send (``prepare``) or
#: to receive into (``target``), handed to :func:`run_rounds`.
PieceSource = Callable[[int, int, int], torch.Tensor]


def run_rounds(
    ring: Ring,
    stats: CommStats,
    rounds: int,
    pieces: list[tuple[int, int]],
    prepare: PieceSource,
    target: PieceSource,
    received: Callable[[int, int, int], None] | None = None,
    posted: Callable[[int], None] | None = None,
    landed: Callable[[int, int, int], None] | None = None,
) -> None:
    """Run ``rounds`` ring rounds, each cut into the column ranges ``pieces``.

    For round ``t`` and piece ``[a, b)``: ``prepare(t, a, b)`` returns the view to send (it may
    read what arrived in round ``t-1`` for the same piece, which has arrived by then, and must
    write into a buffer that alternates with the round's parity: the engine waits for round
    ``t-2``'s send of the piece before calling it); ``target(t, a, b)`` returns the view to
    receive into; ``received(t, a, b)`` runs once that piece has arrived, before the next
    round's piece is prepared from it (on the critical path: keep it to what ``prepare``
    needs); ``landed(t, a, b)`` runs after that, once round ``t + 1``'s piece is on the wire
    (for the last round: once the piece has arrived), so compute placed there overlaps the
    transfers, and it may still read what arrived in round ``t`` (its buffer is reused only by
    round ``t + 2``); ``posted(t)`` runs once all of round ``t`` is on the wire.
    """
    recvs: dict[tuple[int, int], dist.Work] = {}
    sends: dict[tuple[int, int], dist.Work] = {}
    for t in range(1, rounds + 1):
        for s, (a, b) in enumerate(pieces):
            if t > 1:
                wait_for(recvs.pop((t - 1, s)), ring, t - 1)
                if received is not None:
                    received(t - 1, a, b)
            old = sends.pop((t - 2, s), None)
            if old is not None:
                wait_for(old, ring, t - 2)
            send = prepare(t, a, b)
            recv = target(t, a, b)
            recvs[(t, s)], sends[(t, s)] = post_pair(send, recv, ring, t)
            stats.bytes_sent += send.numel() * send.element_size()
            stats.bytes_received += recv.numel() * recv.element_size()
            if t > 1 and landed is not None:
                landed(t - 1, a, b)
        stats.rounds += 1
        if posted is not None:
            posted(t)
    for s, (a, b) in enumerate(pieces):
        wait_for(recvs.pop((rounds, s)), ring, rounds)
        if received is not None:
            received(rounds, a, b)
        if landed is not None:
            landed(rounds, a, b)
    for (t, _), work in sorted(sends.items()):
        wait_for(work, ring, t)
