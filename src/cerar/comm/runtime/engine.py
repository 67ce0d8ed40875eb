"""The pipelined round engine both runs (:mod:`cerar.comm.algorithms`) run on.

Every round of a ring algorithm sends one packet to the next rank and receives one from the
previous; round ``t+1``'s packet depends on round ``t``'s only column by column. :func:`run_program`
therefore cuts each packet into column segments and keeps the link busy: segment ``s`` of round
``t+1`` is prepared and posted as soon as segment ``s`` of round ``t`` has arrived, while the
other segments are still on the wire. Receives are posted before sends (Gloo's send waits for
the peer's receive). Device-agnostic: CPU tensors on Gloo, CUDA tensors on NCCL.

The engine runs a :class:`Program`: every piece of every round as its views and the torch ops
that fill them, bound once (by :class:`cerar.comm.algorithms.cerar.run.CerarRun`, once per layout), so
that a round costs the engine a few Python calls per piece rather than a few dozen; the
communication thread holds the GIL that long less, and backward gets it back.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import torch

from cerar.comm.runtime.links import DATA_TAG, Ring, apart_posters, pair_poster, wait_for
from cerar.comm.runtime.stats import CommStats

__all__ = ["Action", "Gate", "Piece", "Program", "run_program", "segments", "settle_round"]

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


class Gate(Protocol):
    """What :func:`run_program` needs of a handshake still open beside round 1
    (:class:`cerar.comm.runtime.handshake.OpenHandshake`)."""

    @property
    def predecessor_agrees(self) -> bool: ...
    @property
    def successor_agrees(self) -> bool: ...
    def finish(self) -> object: ...


def run_program(
    ring: Ring, stats: CommStats, program: Program, tag: int = DATA_TAG, gate: Gate | None = None
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

    ``gate``, a handshake whose first hop is done, finishes once round 1 is on the wire, before
    anything waits for it; if it raises, the messages already posted are waited for first (their
    peers posted them too), so no receive is left pending when the error leaves. Where a
    neighbour's header differed from this rank's (the gate will raise), only the messages of
    round 1 that an agreeing neighbour posts to or expects from this rank are posted, and
    completed before the error leaves (:func:`settle_round`).
    """
    if gate is not None:
        if not (gate.predecessor_agrees and gate.successor_agrees):
            first = program.rounds[0] if program.rounds else []
            send, recv = gate.successor_agrees, gate.predecessor_agrees
            settle_round(ring, first, send=send, recv=recv, then=gate.finish, tag=tag)
            raise AssertionError("cerar: the handshake agreed although a neighbour's header differed")
        stats.agreed_calls += 1
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
                gate.finish()
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
    pg, source, destination = ring.endpoints
    works = []
    try:
        for piece in pieces:
            if recv:
                works.append(pg.recv([piece.recv], source, tag))
            if send:
                works.append(pg.send([piece.send], destination, tag))
        then()
    finally:
        _drain(ring, works)
