"""Communication statistics: what a collective call sent, how long it took, what it held.

Bytes are counted at the transport, from the tensors actually handed to send/receive, not
from the formula. A :class:`CommStats` is both one call's record and a running total.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any


@dataclass
class CommStats:
    """Counters of one or more collective calls on one rank.

    Attributes:
        calls: collective calls counted.
        rounds: ring rounds run.
        bytes_sent, bytes_received: bytes handed to / received from point-to-point ops (and
            ``method="auto"``'s exact candidate's torch all-reduce, by the ring's formula).
        encode_s: time spent computing injections (the packets' increments).
        decode_s: time spent decoding observations into the result.
        coding_cpu_s: CPU time the coding thread spent in the encode and the decode
            (``time.thread_time``); ``encode_s + decode_s`` less this is time the coding waited
            for a core, where ranks share the cores (it counts the calling thread only: on a GPU,
            or with torch's intra-op threads, it is not the coding's work).
        handshake_s: time in the call's handshake (settings, call number, scale).
        wall_s: wall-clock time inside the calls.
        peak_extra_bytes: most memory the call allocated beyond the caller's tensor (max, not sum).
        fallbacks: calls that fell back to the exact ring (non-finite input, ``nonfinite="exact"``).
        nonfinite_events: calls whose input held NaN or Inf on some rank.
        rescales: CERAR calls redone at a new packet scale because their data left the packet
            format's safe range at the previous one (:mod:`cerar.coding.scaling`).
        agreed_calls: CERAR calls of a layout every rank had agreed before, whose first data
            round went out beside the handshake's last hops (:mod:`cerar.comm.runtime.handshake`).
    """

    calls: int = 0
    rounds: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    encode_s: float = 0.0
    decode_s: float = 0.0
    coding_cpu_s: float = 0.0
    handshake_s: float = 0.0
    wall_s: float = 0.0
    peak_extra_bytes: int = 0
    fallbacks: int = 0
    nonfinite_events: int = 0
    rescales: int = 0
    agreed_calls: int = 0

    def add(self, other: CommStats) -> CommStats:
        """Accumulate ``other`` into ``self`` (peaks take the max) and return ``self``."""
        for f in fields(self):
            if f.name == "peak_extra_bytes":
                self.peak_extra_bytes = max(self.peak_extra_bytes, other.peak_extra_bytes)
            else:
                setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        return self

    def reset(self) -> None:
        for f in fields(self):
            setattr(self, f.name, f.default)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
