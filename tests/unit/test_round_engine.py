"""cerar.comm.runtime.transport.run_program's order of posts on the CPU, against a recording process group.

Gloo matches a peer's messages of one tag in the order they were posted, and a send waits until
the peer has posted its receive: the engine posts each receive a round ahead, in the order the
peer sends, and only once nothing reads the buffer it lands in.
"""

from __future__ import annotations

import torch

from cerar.comm.runtime.engine import Piece, Program, run_program
from cerar.comm.runtime.links import Ring
from cerar.comm.runtime.stats import CommStats


class _Done:
    """A posted message that has completed."""

    def wait(self) -> bool:
        return True


class _Recording:
    """A process group whose sends and receives complete at once and are written to ``events``
    as ``("send" | "recv", round, piece)``, told by the tensor posted (its first value)."""

    def __init__(self, events: list[tuple[str, int, int]]) -> None:
        self.events = events

    def send(self, tensors: list[torch.Tensor], peer: int, tag: int) -> _Done:
        self.events.append(("send", *self._label(tensors[0])))
        return _Done()

    def recv(self, tensors: list[torch.Tensor], peer: int, tag: int) -> _Done:
        self.events.append(("recv", *self._label(tensors[0])))
        return _Done()

    @staticmethod
    def _label(tensor: torch.Tensor) -> tuple[int, int]:
        return int(tensor[0]) // 10, int(tensor[0]) % 10


def _run(rounds: int, pieces: int) -> list[tuple[str, int, int]]:
    events: list[tuple[str, int, int]] = []
    ring = Ring(group=None, rank=0, size=2, send_to=1, recv_from=1)
    ring.__dict__["endpoints"] = (_Recording(events), 1, 1)  # what the cached property would hold
    program = []
    for t in range(1, rounds + 1):
        round_pieces = []
        for s in range(pieces):
            # Each tensor holds its label; a buffer's reuse is seen by the ops that read it.
            send, recv = torch.full((1,), 10.0 * t + s), torch.full((1,), 10.0 * t + s)
            landed = lambda t=t, s=s: events.append(("landed", t, s))  # noqa: E731
            round_pieces.append(Piece(send, recv, None, None, landed))
        program.append(round_pieces)
    run_program(ring, CommStats(), Program(program, torch.device("cpu")))
    return events


def test_receives_go_a_round_ahead_in_the_order_the_peer_sends() -> None:
    events = _run(rounds=3, pieces=2)
    assert events == [
        ("recv", 1, 0), ("send", 1, 0), ("recv", 1, 1), ("send", 1, 1),
        ("recv", 2, 0), ("recv", 2, 1),  # round 2's once round 1 is on the wire
        ("send", 2, 0), ("landed", 1, 0), ("recv", 3, 0),  # round 3's buffer after round 1's landed
        ("send", 2, 1), ("landed", 1, 1), ("recv", 3, 1),
        ("send", 3, 0), ("landed", 2, 0), ("send", 3, 1), ("landed", 2, 1),
        ("landed", 3, 0), ("landed", 3, 1),
    ]  # fmt: skip
    # The peer's sends and this rank's receives, in one order: Gloo pairs them by it.
    assert [e[1:] for e in events if e[0] == "recv"] == [e[1:] for e in events if e[0] == "send"]


def test_one_round_posts_each_receive_with_its_send() -> None:
    assert _run(rounds=1, pieces=2) == [
        ("recv", 1, 0), ("send", 1, 0), ("recv", 1, 1), ("send", 1, 1), ("landed", 1, 0), ("landed", 1, 1)
    ]  # fmt: skip
