"""How the ranks of one call agree, over the ring's own point-to-point links: no collective.

Before its data rounds, every call runs a *handshake*: ``N - 1`` hops of a small fixed-size
header around the ring, each rank forwarding the element-wise maximum of its own header and the
one it just received, so that after the last hop every rank holds the maximum over all ranks.
The header is ``[h, -h, k, -k, max|x|, flag_0, ..., flag_{N-1}]``:

* ``h``: a 48-bit hash of the call's settings (code, dtype, size, op, policy). All ranks agree
  iff ``max(h) == -max(-h)``, i.e. the largest hash equals the smallest.
* ``k``: this rank's count of cerar calls on the group (counted when the call is made, before
  its checks, so that a call one rank abandoned still counts there). Equal counts mean every
  rank is at the same call; different counts mean one rank skipped or added one.
* ``max|x|``: for the float16 ring's scaling, the largest magnitude (``inf`` if non-finite).
* ``flag_r``: rank ``r``'s input holds NaN/Inf, where the call checks that up front.

A mismatch raises :class:`SettingsMismatchError` on every rank with the same message (each
rank's settings, gathered around the ring the same way), before any data has moved: no rank
ever receives a packet of the wrong size. Only point-to-point messages, with cerar's own tag,
so the handshake can never pair with a collective the program runs on the same group from
another thread (an all-reduce there aborted ranks with Gloo's "Received data size doesn't match
expected size"). Its cost is ``N - 1`` one-way latencies of a ~100-byte message.

CERAR checks finiteness later, overlapped: :class:`FlagChain` carries the flags beside data
rounds ``2 .. N`` (see :func:`cerar.comm.algorithms.run_cerar`), so the check costs one pass over
the input while round 1 is on the wire instead of a pass before the call.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from cerar.comm.transport import Ring, post_pair, wait_for

__all__ = [
    "HANDSHAKE_TAG",
    "FlagChain",
    "SettingsMismatchError",
    "all_finite",
    "gather_text",
    "handshake",
    "settings_hash",
]

#: Point-to-point tags of cerar's messages (a program's own p2p on the group uses tag 0 by default).
HANDSHAKE_TAG = 0x0CE1
FLAG_TAG = 0x0CE2
GATHER_TAG = 0x0CE3
_FIELDS = 5  # h, -h, k, -k, max|x|; then one flag per rank
_TEXT_BYTES = 2048  # one rank's settings summary on the failure path


class SettingsMismatchError(ValueError):
    """Ranks called the collective with different codes, dtypes, sizes or options, or one rank
    is a call ahead of or behind the others."""


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` holds no NaN/Inf, in one pass in the common case: a NaN/Inf makes the
    sum non-finite, so a finite sum proves a finite input; a non-finite sum (or an overflow of
    finite values) is confirmed element-wise."""
    if torch.isfinite(tensor.sum()):
        return True
    return bool(torch.isfinite(tensor).all())


def settings_hash(identity: Sequence[Any]) -> float:
    """A 48-bit hash of ``identity`` as a float64 (exact)."""
    digest = hashlib.sha256(repr(tuple(identity)).encode()).digest()
    return float(int.from_bytes(digest[:6], "big"))


def _max_around(ring: Ring, own: torch.Tensor, tag: int, first_round: int) -> torch.Tensor:
    """The element-wise maximum of ``own`` over the ring: ``N - 1`` forwarding hops."""
    total = own.clone()
    received = torch.empty_like(own)
    for hop in range(1, ring.size):
        recv_work, send_work = post_pair(total.clone(), received, ring, first_round + hop, tag)
        wait_for(recv_work, ring, first_round + hop)
        wait_for(send_work, ring, first_round + hop)
        torch.maximum(own, received, out=total)
    return total


def handshake(
    ring: Ring,
    settings: float,
    counter: int,
    summary: str,
    *,
    max_abs: float = 0.0,
    finite: bool | None = None,
    device: torch.device | None = None,
) -> tuple[float, list[int]]:
    """Run the handshake; returns ``(max|x| over ranks, group ranks whose flag is set)``.

    Raises :class:`SettingsMismatchError` on every rank if the settings hashes or call counts
    differ. ``finite=None`` sends no flag (the call checks later or not at all).
    """
    own = torch.zeros(_FIELDS + ring.size, dtype=torch.float64)
    own[0], own[1], own[2], own[3], own[4] = settings, -settings, float(counter), -float(counter), max_abs
    if finite is False:
        own[_FIELDS + ring.rank] = 1.0
    total = _max_around(ring, own.to(device or "cpu"), HANDSHAKE_TAG, 0).cpu()
    if total[0] != -total[1] or total[2] != -total[3]:
        texts = gather_text(ring, f"{summary}, call #{counter}", device)
        lines = "; ".join(f"rank {r}: {text}" for r, text in enumerate(texts))
        what = "different settings" if total[0] != -total[1] else "different call counts (a rank skipped a call)"
        raise SettingsMismatchError(f"cerar: ranks called the collective with {what}: {lines}")
    flagged = [r for r in range(ring.size) if total[_FIELDS + r] > 0]
    return float(total[4]), flagged


def gather_text(ring: Ring, text: str, device: torch.device | None = None) -> list[str]:
    """Every rank's ``text`` (cut to 2 KiB), in group-rank order, on every rank: a ring
    all-gather of fixed-size byte blocks (``N - 1`` hops)."""
    blocks = torch.zeros(ring.size, _TEXT_BYTES, dtype=torch.uint8, device=device or "cpu")
    raw = text.encode()[:_TEXT_BYTES]
    blocks[ring.rank, : len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    for hop in range(1, ring.size):
        send_index, recv_index = (ring.rank - hop + 1) % ring.size, (ring.rank - hop) % ring.size
        recv_work, send_work = post_pair(blocks[send_index].clone(), blocks[recv_index], ring, hop, GATHER_TAG)
        wait_for(recv_work, ring, hop)
        wait_for(send_work, ring, hop)
    return [bytes(row.cpu().tolist()).rstrip(b"\0").decode(errors="replace") for row in blocks]


class FlagChain:
    """The non-finite flags carried beside CERAR's data rounds ``2 .. N``.

    Rank ``r`` sets its flag while round 1 is on the wire (:meth:`set_own`), then in each round
    ``t = 2 .. N`` forwards the maximum of its flags and what arrived in round ``t - 1``
    (:meth:`step`); after round ``N`` arrives every rank holds every rank's flag
    (:meth:`flagged`), before any decoding. Needs ``rounds >= N`` (``c >= 2``).
    """

    def __init__(self, ring: Ring, device: torch.device) -> None:
        self.ring = ring
        self.own = torch.zeros(ring.size, dtype=torch.float64, device=device)
        self.received = torch.zeros(ring.size, dtype=torch.float64, device=device)
        self.pending: tuple[dist.Work, dist.Work, int] | None = None
        self.hops = 0

    def set_own(self, finite: bool) -> None:
        self.own[self.ring.rank] = 0.0 if finite else 1.0

    def step(self, round_index: int) -> None:
        """Post this round's hop (rounds ``2 .. N``); the previous hop's message has arrived."""
        if self.hops >= self.ring.size - 1:
            return
        message = self.own.clone()
        if self.pending is not None:
            self._finish()
            torch.maximum(message, self.received, out=message)
        self.pending = (*post_pair(message, self.received, self.ring, round_index, FLAG_TAG), round_index)
        self.hops += 1

    def flagged(self, next_round: int) -> list[int]:
        """Group ranks whose input held NaN/Inf. Waits for the last hop; hops the data rounds
        did not carry (fewer than ``N`` rounds) run here, numbered from ``next_round``."""
        while self.hops < self.ring.size - 1:
            self.step(next_round)
            next_round += 1
        if self.pending is not None:
            self._finish()
        total = torch.maximum(self.own, self.received).cpu()
        return [r for r in range(self.ring.size) if total[r] > 0]

    def _finish(self) -> None:
        recv_work, send_work, round_index = self.pending
        wait_for(recv_work, self.ring, round_index)
        wait_for(send_work, self.ring, round_index)
        self.pending = None
