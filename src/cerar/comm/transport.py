"""The ring over torch.distributed point-to-point ops: who talks to whom, scratch memory, and a
pipelined round engine that both algorithms of :mod:`cerar.comm.algorithms` run on.

Every round of a ring algorithm sends one packet to the next rank and receives one from the
previous; round ``t+1``'s packet depends on round ``t``'s only column by column. :func:`run_program`
therefore cuts each packet into column segments and keeps the link busy: segment ``s`` of round
``t+1`` is prepared and posted as soon as segment ``s`` of round ``t`` has arrived, while the
other segments are still on the wire. Receives are posted before sends (Gloo's send waits for
the peer's receive). Device-agnostic: CPU tensors on Gloo, CUDA tensors on NCCL.

The engine runs a :class:`Program`: every piece of every round as its views and the torch ops
that fill them, bound once (by :class:`cerar.comm.algorithms.CerarRun`, once per layout), so
that a round costs the engine a few Python calls per piece rather than a few dozen; the
communication thread holds the GIL that long less, and backward gets it back.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from cerar.comm.stats import CommStats


class Workspace:
    """Named scratch buffers reused across calls.

    Fresh multi-megabyte allocations cost more than the arithmetic done in them (every page is
    faulted in on first touch), so buffers are kept and only grown. ``held_bytes`` is what the
    workspace holds now: the collective's extra memory beyond the caller's tensor. ``bound``
    keeps objects built on views of the buffers (a layout's :class:`Program`), and drops them
    whenever a buffer is replaced or released: they never hold memory the workspace gave up.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.dtype, str], torch.Tensor] = {}
        self.bound: dict[Any, Any] = {}  # e.g. CerarRun by layout (cerar.comm.algorithms)

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        key = (name, dtype, str(device))
        size = math.prod(shape)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < size:
            buffer = torch.empty(size, dtype=dtype, device=device)
            self._buffers[key] = buffer
            self._replaced()
        return buffer[:size].view(shape)

    def release(self, name: str) -> None:
        """Drop the buffers called ``name`` (of every dtype and device)."""
        for key in [key for key in self._buffers if key[0] == name]:
            del self._buffers[key]
            self._replaced()

    @property
    def held_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def clear(self) -> None:
        self._buffers.clear()
        self._replaced()

    def _replaced(self) -> None:
        self.bound.clear()


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
    peers: tuple[int, ...] = ()  # global rank of every position (the handshake needs them)

    @functools.cached_property
    def endpoints(self) -> tuple[dist.ProcessGroup, int, int]:
        """``(process group, group rank of recv_from, group rank of send_to)``: what the process
        group's own ``send``/``recv`` take, worked out once per ring instead of by
        ``dist.isend``/``dist.irecv``'s argument handling on every message."""
        pg = dist.group.WORLD if self.group is None else self.group
        if self.group is None:
            return pg, self.recv_from, self.send_to
        return pg, dist.get_group_rank(self.group, self.recv_from), dist.get_group_rank(self.group, self.send_to)

    @functools.cached_property
    def _at_distance(self) -> dict[int, Ring]:
        return {}

    def at_distance(self, distance: int) -> Ring:
        """This ring with the ranks ``distance`` positions ahead and behind as the neighbours
        (for :mod:`cerar.comm.handshake`'s dissemination hops); needs ``peers``. Remembered, with
        its :attr:`endpoints`: every call's handshake takes the same hops."""
        if distance % self.size == 1 % self.size:
            return self
        known = self._at_distance.get(distance)
        if known is not None:
            return known
        if len(self.peers) != self.size:
            raise ValueError(f"Argument 'distance' other than 1 needs the ring's peers, not {distance!r} on {self!r}.")
        ahead, behind = self.peers[(self.rank + distance) % self.size], self.peers[(self.rank - distance) % self.size]
        ring = self._at_distance[distance] = dataclasses.replace(self, send_to=ahead, recv_from=behind)
        return ring

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


Post = Callable[[torch.Tensor, torch.Tensor, int], tuple[dist.Work, dist.Work]]


def pair_poster(ring: Ring, device: torch.device, tag: int = DATA_TAG) -> Post:
    """``post(send, recv, round_index) -> (recv_work, send_work)``: posts one piece's receive and
    send together, for tensors on ``device``; worked out once per call, not per message.

    On an accelerator (NCCL) as one batch: NCCL's maintainers advise grouping a ring step's send
    with the receive it pairs with (``batch_isend_irecv`` runs them under one NCCL group), as
    separate ``isend``/``irecv`` calls create two-rank communicators lazily and can deadlock in a
    ring. On the CPU (Gloo, which has no coalescing) ``batch_isend_irecv`` only adds its
    coalescing manager around the same two calls, which costs a sizeable share of a small hop
    (``docs/results.md``). So CPU tensors take the two plain calls, receive first (Gloo's send
    waits for the peer's receive), straight on the process group (:attr:`Ring.endpoints`: what
    ``dist.irecv``/``dist.isend`` call after checking their arguments, which a call's dozens of
    messages would otherwise repeat). Posting to a pair whose peer has gone raises at once, not on
    wait: :class:`RingError`.
    """
    apart = apart_posters(ring, device, tag)
    if apart is not None:
        post_recv, post_send = apart

        def post_cpu(send: torch.Tensor, recv: torch.Tensor, round_index: int) -> tuple[dist.Work, dist.Work]:
            return post_recv(recv, round_index), post_send(send, round_index)

        return post_cpu

    def post_batch(send: torch.Tensor, recv: torch.Tensor, round_index: int) -> tuple[dist.Work, dist.Work]:
        ops = [
            dist.P2POp(dist.irecv, recv, ring.recv_from, ring.group, tag),
            dist.P2POp(dist.isend, send, ring.send_to, ring.group, tag),
        ]
        try:
            works = dist.batch_isend_irecv(ops)
        except RuntimeError as exc:
            raise _ring_error(ring, round_index, exc) from exc
        if len(works) == 1:  # NCCL may return one handle for the coalesced batch: it covers both
            return works[0], works[0]
        recv_work, send_work = works
        return recv_work, send_work

    return post_batch


def post_pair(
    send: torch.Tensor, recv: torch.Tensor, ring: Ring, round_index: int, tag: int = DATA_TAG
) -> tuple[dist.Work, dist.Work]:
    """Post one message pair (:func:`pair_poster`): ``(recv_work, send_work)``."""
    return pair_poster(ring, send.device, tag)(send, recv, round_index)


PostOne = Callable[[torch.Tensor, int], dist.Work]


def apart_posters(ring: Ring, device: torch.device, tag: int = DATA_TAG) -> tuple[PostOne, PostOne] | None:
    """``(post_recv, post_send)``, each ``post(tensor, round_index) -> work``, for a receive and a
    send posted apart (CPU tensors on Gloo: :func:`pair_poster`, :func:`run_program`); None
    where a receive must go with its send in one batch (NCCL's, :func:`pair_poster`)."""
    if device.type != "cpu" or BATCH_ON_CPU:
        return None
    pg, source, destination = ring.endpoints
    recv_on, send_on = pg.recv, pg.send

    def post_recv(recv: torch.Tensor, round_index: int) -> dist.Work:
        try:
            return recv_on([recv], source, tag)
        except RuntimeError as exc:
            raise _ring_error(ring, round_index, exc) from exc

    def post_send(send: torch.Tensor, round_index: int) -> dist.Work:
        try:
            return send_on([send], destination, tag)
        except RuntimeError as exc:
            raise _ring_error(ring, round_index, exc) from exc

    return post_recv, post_send


_SEGMENT_BYTES = 256 * 1024
_MAX_SEGMENTS = 16


def segments(values: int, itemsize: int) -> list[tuple[int, int]]:
    """Column ranges ``[a, b)`` that cut a packet of ``values`` values into pieces of about
    256 KiB (at most 16): enough pieces to keep the link busy between rounds, few enough that
    per-message overhead stays small."""
    count = max(1, min(_MAX_SEGMENTS, (values * itemsize) // _SEGMENT_BYTES))
    edges = [round(values * k / count) for k in range(count + 1)]
    return [(a, b) for a, b in itertools.pairwise(edges) if b > a]


Action = Callable[[], object]


class Piece(NamedTuple):
    """One piece of one round as :func:`run_program` runs it: the views it posts and the ops
    bound to them (each ``None`` if there is nothing to do)."""

    send: torch.Tensor  # posted as the round's send, once ``prepare`` has filled it
    recv: torch.Tensor  # posted as the round's receive
    prepare: Action | None = None  # fills ``send`` (may read the same piece of the round before)
    received: Action | None = None  # once ``recv`` has arrived, before the next round's prepare
    landed: Action | None = None  # once the next round's piece is on the wire (or, last, arrived)


@dataclass
class Program:
    """Every round's pieces (the same column ranges in every round), and what runs once a round
    is all on the wire (``posted``, by round number from 1)."""

    rounds: list[list[Piece]]
    device: torch.device
    posted: dict[int, Action] = field(default_factory=dict)
    bytes_sent: int = field(init=False)
    bytes_received: int = field(init=False)

    def __post_init__(self) -> None:
        pieces = [piece for pieces in self.rounds for piece in pieces]
        self.bytes_sent = sum(p.send.numel() * p.send.element_size() for p in pieces)
        self.bytes_received = sum(p.recv.numel() * p.recv.element_size() for p in pieces)


def run_program(
    ring: Ring, stats: CommStats, program: Program, tag: int = DATA_TAG, gate: Action | None = None
) -> None:
    """Run ``program``'s rounds on ``ring``, each piece posted as soon as it can be.

    For round ``t`` and piece ``s``: once piece ``s`` of round ``t - 1`` has arrived, its
    ``received`` runs (on the critical path: keep it to what the next ``prepare`` needs); once
    round ``t - 2``'s send of the piece is done (its send buffer alternates with the round's
    parity), ``prepare`` fills ``send``, and ``send`` is posted (with round ``t``'s receive,
    unless that was posted a round ahead); then round ``t - 1``'s ``landed`` runs, while round
    ``t``'s piece is on the wire, so compute placed there overlaps the transfers (it may still
    read what arrived in round ``t - 1``). ``posted[t]`` runs once all of round ``t`` is on the
    wire.

    On Gloo a send waits until its peer has posted the matching receive (the receiver tells the
    sender so, a message back across the link), so a receive posted only beside the round's own
    send leaves that notice on the critical path of every piece. CPU tensors therefore post each
    receive a round ahead: all of round 2's once round 1 is on the wire (and past ``gate``), and
    round ``t + 1``'s piece ``s`` once round ``t``'s piece ``s`` is posted and its ``landed`` has
    run, when nothing reads the buffer it lands in any more (the receives stay in the order the
    peer sends, which Gloo matches them by).

    ``gate`` (a handshake's last hops) runs once round 1 is on the wire, before anything waits
    for it; if it raises, the messages already posted are waited for first (their peers posted
    them too), so no receive is left pending when the error leaves.
    """
    rounds = program.rounds
    post = pair_poster(ring, program.device, tag)
    apart = apart_posters(ring, program.device, tag)  # None: receives go with their sends
    last = len(rounds)
    width = len(rounds[0]) if rounds else 0
    recvs: list[Any] = [None] * width  # round t's receives while round t runs
    upcoming: list[Any] = [None] * width  # round t + 1's, posted ahead
    sends: list[list[Any]] = [[None] * width, [None] * width]
    stats.bytes_sent += program.bytes_sent
    stats.bytes_received += program.bytes_received
    previous: list[Piece] = []
    for t, pieces in enumerate(rounds, start=1):
        pending = sends[t % 2]
        early = apart is not None and t >= 2  # this round's receives went out a round ago
        for s, piece in enumerate(pieces):
            if previous:
                wait_for(recvs[s], ring, t - 1)
                if previous[s].received is not None:
                    previous[s].received()
            if pending[s] is not None:
                wait_for(pending[s], ring, t - 2)
            if piece.prepare is not None:
                piece.prepare()
            if early:
                assert apart is not None
                recvs[s] = upcoming[s]
                pending[s] = apart[1](piece.send, t)
            else:
                recvs[s], pending[s] = post(piece.send, piece.recv, t)
            if previous and previous[s].landed is not None:
                previous[s].landed()
            if early and t < last:
                upcoming[s] = apart[0](rounds[t][s].recv, t + 1)
        stats.rounds += 1
        after = program.posted.get(t)
        if after is not None:
            after()
        if t == 1 and gate is not None:
            try:
                gate()
            except BaseException:
                _drain(ring, [*recvs, *sends[1]])
                raise
        if t == 1 and apart is not None and last >= 2:
            upcoming = [apart[0](piece.recv, 2) for piece in rounds[1]]  # round 2's buffers are free
        previous = pieces
    for s, piece in enumerate(previous):
        wait_for(recvs[s], ring, last)
        if piece.received is not None:
            piece.received()
        if piece.landed is not None:
            piece.landed()
    for t in (last - 1, last):
        for work in sends[t % 2]:
            if work is not None:
                wait_for(work, ring, t)


def _drain(ring: Ring, works: list[Any]) -> None:
    """Wait for ``works`` on an error path: a failure among them must not hide the error."""
    for work in works:
        if work is not None:
            try:
                work.wait()
            except RuntimeError:
                pass


def settle_round(ring: Ring, pieces: list[Piece], *, send: bool, recv: bool, then: Action, tag: int = DATA_TAG) -> None:
    """Post only the sends (to the successor) and/or the receives (from the predecessor) of one
    round's ``pieces``, as they are (what they carry is discarded), run ``then``, and wait for
    what was posted, also when ``then`` raises: a rank whose handshake agreed with one neighbour
    and not the other completes the messages that neighbour posted to it, or expects from it."""
    works = []
    try:
        for piece in pieces:
            if recv:
                works.append(dist.irecv(piece.recv, src=ring.recv_from, group=ring.group, tag=tag))
            if send:
                works.append(dist.isend(piece.send, dst=ring.send_to, group=ring.group, tag=tag))
        then()
    finally:
        _drain(ring, works)
