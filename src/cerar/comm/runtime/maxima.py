"""Every rank's largest input magnitude, carried inside CERAR's data packets (:class:`MaximaChain`):
the non-finite decision and the packet scale's check, the same on every rank, at no message of
their own."""

from __future__ import annotations

import math

import torch

from cerar.comm.runtime.links import Ring, post_pair, wait_for

__all__ = ["FLAG_TAG", "MaximaChain", "max_abs"]

#: Point-to-point tag of the chain's hops that the data rounds do not carry.
FLAG_TAG = 0x0CE2


class MaximaChain:
    """Every rank's largest input magnitude, carried inside CERAR's data packets of rounds ``2 .. N``.

    Rank ``r`` puts its ``max|x|`` (``inf`` if its input holds NaN/Inf) in slot ``r`` while round
    1 is on the wire (:meth:`set_own_from`); each round ``t = 2 .. N`` then carries, in a
    :attr:`front` of ``8 N`` bytes ahead of its first piece's values, the element-wise maximum of
    everything the rank has heard so far (:meth:`write`), and the receiver folds in what arrived
    (:meth:`absorb`). After ``N - 1`` hops every rank holds the same vector (:meth:`maxima`),
    before any decoding: the non-finite decision and the packet-scale check are the same on
    every rank. Riding in the data messages costs no message of its own (a separate message per
    hop cost about as much as a data round's on an oversubscribed host); hops the data rounds do
    not carry (fewer than ``N`` rounds, ``c = 1``, or no values) run as messages of their own in
    :meth:`maxima`.
    """

    def __init__(self, ring: Ring, device: torch.device, packet_dtype: torch.dtype = torch.float64) -> None:
        self.ring = ring
        self.own = torch.zeros(ring.size, dtype=torch.float64, device=device)
        self.known = torch.zeros(ring.size, dtype=torch.float64, device=device)  # own, then the max heard
        self.arrived = torch.zeros(ring.size, dtype=torch.float64, device=device)
        #: Elements of ``packet_dtype`` the vector takes at the front of a packet (``8 N`` bytes).
        self.front = ring.size * 8 // torch.empty((), dtype=packet_dtype).element_size()
        self.sent = 0  # hops posted
        self.heard = 0  # hops folded in

    def reset(self) -> None:
        """Forget the previous call's values (a run kept for its layout reuses its chain)."""
        self.own.zero_()
        self.sent = self.heard = 0

    def set_own_from(self, tensor: torch.Tensor) -> None:
        """This rank's slot from ``tensor``'s ``max|x|`` (``inf`` for NaN/Inf), computed where the
        tensor lives: no host synchronisation (the value is read only in :meth:`maxima`)."""
        if not tensor.numel():
            return  # the slot holds 0
        low, high = torch.aminmax(tensor)
        largest = torch.maximum(-low, high).to(torch.float64)
        self.own[self.ring.rank] = torch.nan_to_num(largest, nan=math.inf, posinf=math.inf)

    def carries(self, round_index: int, rounds: int) -> bool:
        """Whether round ``round_index``'s first piece carries a hop: rounds ``2 .. min(N, L)``."""
        return 2 <= round_index <= min(self.ring.size, rounds)

    def write(self, front: torch.Tensor) -> None:
        """The next hop's message into ``front`` (the first :attr:`front` elements of a packet)."""
        if not self.sent:
            self.known.copy_(self.own)
        front.view(torch.uint8).copy_(self.known.view(torch.uint8))
        self.sent += 1

    def absorb(self, front: torch.Tensor) -> None:
        """Fold the hop that arrived in ``front`` into what this rank knows."""
        self.arrived.view(torch.uint8).copy_(front.view(torch.uint8))
        torch.maximum(self.known, self.arrived, out=self.known)
        self.heard += 1

    def maxima(self, next_round: int) -> list[float]:
        """Every group rank's ``max|x|`` (``inf``: NaN/Inf), once every hop has arrived; hops the
        data rounds did not carry run here as messages of their own, numbered from ``next_round``."""
        if not self.sent:
            self.known.copy_(self.own)
        while self.heard < self.ring.size - 1:
            recv_work, send_work = post_pair(self.known.clone(), self.arrived, self.ring, next_round, FLAG_TAG)
            wait_for(recv_work, self.ring, next_round)
            wait_for(send_work, self.ring, next_round)
            torch.maximum(self.known, self.arrived, out=self.known)
            self.sent, self.heard, next_round = self.sent + 1, self.heard + 1, next_round + 1
        return self.known.cpu().tolist()


def max_abs(tensor: torch.Tensor) -> float:
    """``max|x|`` in one pass (``inf`` if ``tensor`` holds NaN or Inf; 0 if it is empty)."""
    if not tensor.numel():
        return 0.0
    low, high = torch.aminmax(tensor)
    value = max(-float(low), float(high))
    return value if math.isfinite(value) else math.inf
