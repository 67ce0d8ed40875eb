"""The ring schedule as data: what every rank does in every round.

One source of truth for the protocol. The single-process simulator (:mod:`cerar.protocol.simulate`) and
the real transport (:mod:`cerar.comm.runtime.transport`) both execute a :class:`RankPlan` built here; neither
re-derives the rounds. Pure numpy: never imports torch.

The protocol (ranks ``i = 0..N-1``; rank ``i`` sends to ``i+1 mod N``; rounds ``t = 1..L``,
``L = c + N - 2``): rank ``i`` injects ``a_i(t) = F(t - i) X_i`` and sends

    p_i(t) = r_i(t-1) + a_i(t) - a_i(t-N)      (r_i(0) = 0; a_i(t) = 0 for t <= 0)

where ``r_i(t-1)`` is the packet it received in the previous round. In rounds ``t >= N-1`` the
received packet, less ``a_j(t-N+1)``, is observation slot ``t - (N-1)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cerar._checks import check_int
from cerar.coding.linear_code import Code


@dataclass(frozen=True)
class RoundStep:
    """What rank ``rank`` does in round ``round`` (1-based).

    Attributes:
        add: exponent ``n`` of the injection ``F(n) X`` added to the outgoing packet.
        remove: exponent of the own injection from one lap ago that is taken out, or None.
        slot: observation slot (0..c-1) that the packet received this round fills, or None.
        slot_remove: exponent of the own injection subtracted from that received packet to turn
            it into an observation, or None (nothing of ours in it yet).
    """

    rank: int
    round: int
    add: int
    remove: int | None
    slot: int | None
    slot_remove: int | None


class Schedule:
    """The round-by-round schedule of CERAR on an ``N``-rank ring with ``c`` components."""

    def __init__(self, world_size: int, components: int) -> None:
        self.world_size = check_int("world_size", world_size, minimum=2)
        self.components = check_int("components", components, minimum=1)
        self.rounds = self.components + self.world_size - 2

    @classmethod
    def for_code(cls, code: Code) -> Schedule:
        return cls(code.world_size, code.components)

    def step(self, rank: int, round_index: int) -> RoundStep:
        """The :class:`RoundStep` of ``rank`` in round ``round_index`` (``1..L``)."""
        n_ranks = self.world_size
        j = check_int("rank", rank, minimum=0)
        t = check_int("round_index", round_index, minimum=1)
        if j >= n_ranks:
            raise ValueError(f"Argument 'rank' must be less than world_size={n_ranks}, not {j}.")
        if t > self.rounds:
            raise ValueError(f"Argument 'round_index' must be at most L={self.rounds}, not {t}.")
        observed = t >= n_ranks - 1
        own_in_packet = t - n_ranks + 1  # round of our injection still inside the received packet
        return RoundStep(
            rank=j,
            round=t,
            add=t - j,
            remove=(t - n_ranks - j) if t - n_ranks >= 1 else None,
            slot=(t - (n_ranks - 1)) if observed else None,
            slot_remove=(own_in_packet - j) if observed and own_in_packet >= 1 else None,
        )

    def steps(self, rank: int) -> list[RoundStep]:
        """All rounds of ``rank`` in order."""
        return [self.step(rank, t) for t in range(1, self.rounds + 1)]

    def decode_gain(self, code: Code) -> float:
        """``H``: the largest row 1-norm of any rank's decode matrix (:attr:`RankPlan.decode`), the
        same number on every rank; it bounds how far the decode's products exceed the packets
        (:func:`cerar.coding.scaling.scale_window`)."""
        return max(float(np.abs(self.plan(code, r).decode).sum(axis=1).max()) for r in range(self.world_size))

    def plan(self, code: Code, rank: int) -> RankPlan:
        """The matrices that execute this schedule with ``code`` on ``rank``."""
        if (code.world_size, code.components) != (self.world_size, self.components):
            raise ValueError(
                f"Argument 'code' has N={code.world_size}, c={code.components} but the schedule "
                f"has N={self.world_size}, c={self.components}."
            )
        c = self.components
        steps = self.steps(rank)
        increments = np.zeros((self.rounds, c))
        correction = np.zeros((c, c))
        for k, step in enumerate(steps):
            increments[k] = code.F(step.add)
            if step.remove is not None:
                increments[k] -= code.F(step.remove)
            if step.slot is not None and step.slot_remove is not None:
                correction[step.slot] = code.F(step.slot_remove)
        # A code that spreads its seam injects F(n) T X instead of F(n) X: fold T in here.
        transform = code.input_transform(rank)
        increments = increments @ transform
        correction = correction @ transform
        w = code.decoder(rank)
        # S_hat = X + W (R - C X) = (I - W C) X + W R: one product with the stacked [X; R].
        decode = np.concatenate([np.eye(c) - w @ correction, w], axis=1)
        first_slot_round = self.world_size - 1
        return RankPlan(
            rank=rank,
            rounds=self.rounds,
            increments=increments,
            decode=decode,
            first_observed_round=first_slot_round,
        )


@dataclass(frozen=True)
class RankPlan:
    """One rank's whole part in a call, as matrices (float64).

    Attributes:
        increments: ``(L, c)``. Row ``t-1`` times ``X`` (``c x m``) is what round ``t`` adds to the
            packet received in round ``t-1`` before sending it: ``a(t) - a(t-N)`` folded into one
            row, so each round's critical path is one add and one send.
        decode: ``(c, 2c)``. ``S_hat = decode @ [X; R]`` where ``R`` stacks the packets received
            in rounds ``N-1 .. L`` (observation slots ``0..c-1``) as they arrived.
        first_observed_round: ``N-1``, the first round whose received packet is kept.
    """

    rank: int
    rounds: int
    increments: np.ndarray
    decode: np.ndarray
    first_observed_round: int

    def slot(self, round_index: int) -> int | None:
        """Observation slot filled by the packet received in round ``round_index``, or None."""
        t = round_index
        return t - self.first_observed_round if t >= self.first_observed_round else None
