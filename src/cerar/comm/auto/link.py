"""What a DDP bucket's call cost the link, when calls of two transports overlap.

``method="auto"`` times every bucket to verify its plan. A transport serves its calls in the
order they came, a few at a time at most, so a call may wait for another before it is served. A
plan that mixes transports (16-bit CERAR for the large buckets, torch's float16 ring for a small
one) runs calls of both at once on one link: timed from its start to its end, each would be
charged the other's bytes too, and the verification would send a CERAR bucket back to its
baseline although the mix was at fault.

:class:`LinkClock` charges each call its share instead. Each transport serves its calls in the
order they came, ``servers[transport]`` at a time: cerar's communication thread one; torch's
collectives on Gloo as many as the process group's threads (two by default), on NCCL one (its
stream). A call is in service from the moment it gets a server to its completion, and every
moment of that is split evenly among the calls in service then (processor sharing): the shares of
a step's calls add up to the time the link was busy with them.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["LinkClock"]

#: Completed service intervals kept for later calls' shares: far more than one step's buckets
#: can overlap.
_KEPT = 256


@dataclass
class _Call:
    transport: str
    served_from: float | None  # when it got a server (None: still waiting for one)


class LinkClock:
    """Shares of the link per call: :meth:`launch` when a call starts, :meth:`done` when it
    completes (any thread; times from ``time.perf_counter()``, in seconds). ``servers``: calls
    served at once per transport (1 for one not named)."""

    __slots__ = ("_counter", "_in_flight", "_lock", "_served", "servers")

    def __init__(self, servers: Mapping[str, int] | None = None) -> None:
        self.servers = dict(servers or {})
        self._lock = threading.Lock()
        self._counter = itertools.count()
        self._in_flight: dict[int, _Call] = {}  # launch order: the dict keeps it
        self._served: list[tuple[float, float]] = []

    def launch(self, transport: str, now: float) -> int:
        """A call on ``transport`` started at ``now``; returns its token for :meth:`done`."""
        with self._lock:
            token = next(self._counter)
            busy = sum(1 for c in self._in_flight.values() if c.transport == transport and c.served_from is not None)
            self._in_flight[token] = _Call(transport, now if busy < self.servers.get(transport, 1) else None)
            return token

    def done(self, token: int, now: float) -> float:
        """The call ``token`` completed at ``now``: its share of the link, in seconds."""
        with self._lock:
            call = self._in_flight.pop(token)
            begin = now if call.served_from is None else min(now, call.served_from)
            others = [(b, e) for b, e in self._served if e > begin and b < now]
            others += [(c.served_from, now) for c in self._in_flight.values() if c.served_from is not None]
            share = _shared(begin, now, others)
            self._served.append((begin, now))
            del self._served[:-_KEPT]
            # Its server goes to the oldest call of its transport still waiting.
            waiting = next(
                (c for c in self._in_flight.values() if c.transport == call.transport and c.served_from is None), None
            )
            if waiting is not None:
                waiting.served_from = now
            return share


def _shared(begin: float, end: float, others: list[tuple[float, float]]) -> float:
    """The length of ``[begin, end]`` with each moment divided by 1 + the intervals of
    ``others`` that cover it."""
    edges = sorted({begin, end, *(t for interval in others for t in interval if begin < t < end)})
    share = 0.0
    for a, b in itertools.pairwise(edges):
        covering = sum(1 for lo, hi in others if lo <= a and hi >= b)
        share += (b - a) / (1 + covering)
    return share
