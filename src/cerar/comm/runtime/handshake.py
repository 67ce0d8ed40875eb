"""How the ranks of one call agree, over the ring's own point-to-point links: no collective.

Every call runs a *handshake*: ``ceil(log2 N)`` hops of a small fixed-size header. Hop 1
exchanges it with both ring neighbours; hop ``k > 1`` sends to the rank ``2^(k-1)`` positions
ahead and receives from the one as far behind, each rank keeping the element-wise maximum of
what it holds and what it received (a dissemination pattern: the maximum ignores the overlaps),
so that after the last hop every rank holds the maximum over all ranks (N = 4: 2 hops instead
of the ring's 3; N = 8: 3 instead of 7). The header is ``[h, -h, k, -k, max|x|, e]``:

* ``h``: a 48-bit hash of the call's settings (code, dtype, size, op, policy). All ranks agree
  iff ``max(h) == -max(-h)``, i.e. the largest hash equals the smallest.
* ``k``: this rank's number of the call (:class:`cerar.comm.runtime.groups.CallNumber`: its count
  of cerar calls on the group, counted when the call is made, before its checks, so that a call
  one rank abandoned still counts there, with the calling thread and that thread's own count).
  Equal numbers mean every rank is at the same call of the same thread; different ones mean one
  rank skipped or added one, or that calls several threads made at once met in different orders.
* ``max|x|``: the largest magnitude (``inf`` if non-finite), for the packet scaling of a
  call that has no previous scale to go by (the float16 ring, CERAR's first call of a size).
* ``e``: the exponent of the packet scale this rank proposes (its previous call's); every rank
  takes the largest, so the scale is the same on every rank even if their histories differ.

A mismatch raises :class:`SettingsMismatchError` on every rank with the same message (each
rank's settings, gathered around the ring the same way). Only point-to-point messages, with
cerar's own tag, so the handshake can never pair with a collective the program runs on the same
group from another thread (an all-reduce there aborted ranks with Gloo's "Received data size
doesn't match expected size").

*Once per layout.* The first call of a layout (group, size, settings) runs all hops before any
data: no rank ever receives a packet of the wrong size (Gloo aborts the receiving process when
a message is larger than the posted receive, ``op.preamble.length <= op.nbytes``; it does not
raise, and torch's ``Work`` can neither be cancelled nor tell a received length). A later call
of a layout every rank has agreed (:class:`OpenHandshake`) hashes the agreement and its packet
scale into ``h``, and after hop 1 posts its first data round on each link whose two ends sent
the same header, since both ends decide alike from the same two headers, every message posted
is received and no size can differ; the remaining hops then overlap that round, and a mismatch
found there raises on every rank once the posted messages have completed (their data is
discarded). A skipped, extra or mismatched call thus still raises everywhere; what the agreed
call saves is the latency of all hops but the first.

CERAR checks finiteness and magnitude later, overlapped: :class:`cerar.comm.runtime.maxima.MaximaChain`
carries every rank's ``max|x|`` inside data rounds ``2 .. N``, so the check costs one pass over the
input while round 1 is on the wire instead of a pass before the call.

The handshake's time is added to the call's ``CommStats.handshake_s`` (the ``stats`` argument).
"""

from __future__ import annotations

import functools
import hashlib
import json
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch

from cerar.comm.runtime.links import Ring, post_pair, wait_for
from cerar.comm.runtime.stats import CommStats

__all__ = [
    "HANDSHAKE_TAG",
    "Agreed",
    "OpenHandshake",
    "Proposal",
    "SettingsMismatchError",
    "dissemination_distances",
    "gather_text",
    "handshake",
    "max_around",
    "open_handshake",
    "settings_hash",
]

#: Point-to-point tags of cerar's messages (a program's own p2p on the group uses tag 0 by default).
HANDSHAKE_TAG = 0x0CE1  # 0x0CE2 is the maxima chain's (cerar.comm.runtime.maxima)
GATHER_TAG = 0x0CE3
_TEXT_BYTES = 2048  # one rank's settings summary on the failure path


class SettingsMismatchError(ValueError):
    """Ranks called the collective with different codes, dtypes, sizes or options, or one rank
    is a call ahead of or behind the others."""


@functools.lru_cache(maxsize=1024)
def settings_hash(identity: Sequence[Any]) -> float:
    """A 48-bit hash of ``identity`` (hashable) as a float64 (exact), remembered: a bucket's
    calls repeat their settings every step."""
    digest = hashlib.sha256(repr(tuple(identity)).encode()).digest()
    return float(int.from_bytes(digest[:6], "big"))


def dissemination_distances(size: int) -> list[int]:
    """The hop distances ``1, 2, 4, ...`` (``ceil(log2 size)`` of them) after which every rank has
    heard, directly or through others, from every rank."""
    distances = []
    while (distance := 1 << len(distances)) < size:
        distances.append(distance)
    return distances


def max_around(ring: Ring, total: torch.Tensor, tag: int, distances: Sequence[int] | None = None) -> torch.Tensor:
    """Fold into ``total`` the element-wise maximum over the hops at ``distances`` (each hop
    sends what the rank holds and keeps the maximum with what arrived; hop ``k`` at distance
    ``2^(k-1)``). ``None``: all of :func:`dissemination_distances`, after which every rank holds
    the maximum over every rank's ``total``."""
    distances = dissemination_distances(ring.size) if distances is None else distances
    received = torch.empty_like(total)
    for distance in distances:
        hop = distance.bit_length()
        peer = ring.at_distance(distance)
        # total is sent as it is: it changes only once the send is done.
        recv_work, send_work = post_pair(total, received, peer, hop, tag)
        wait_for(recv_work, peer, hop)
        wait_for(send_work, peer, hop)
        torch.maximum(total, received, out=total)
    return total


class Proposal(NamedTuple):
    """The packet scale fields of this rank's header (:class:`cerar.comm.algorithms.cerar.scale.PacketScale`)."""

    max_abs: float = 0.0  # the data's ``max|x|`` where the call measured it (0: not measured)
    scale_exponent: int = 0  # the exponent this rank proposes
    nonfinite_rank: int = 0  # 1 + this rank's group rank where its input is not finite, else 0


NO_PROPOSAL = Proposal()  # a call with nothing to scale (the exact ring in its wire dtype)

#: A call's settings as its mismatch message shows them: text, or a function that makes the text
#: or a mapping of named settings (the message then names the first that differs), made only then.
Summary = str | Callable[[], str | Mapping[str, Any]]


class Agreed(NamedTuple):
    """What the handshake found, the same on every rank."""

    max_abs: float  # the largest ``max|x|`` sent
    scale_exponent: int  # the largest exponent proposed
    nonfinite_rank: int = 0  # 1 + the highest group rank whose input is not finite, else 0


class OpenHandshake:
    """A handshake whose first hop is done: each rank has exchanged its header with both ring
    neighbours, and knows whether each agrees with it (:attr:`predecessor_agrees`,
    :attr:`successor_agrees`: the same answer on both ends of a link). :meth:`finish` runs the
    remaining hops and raises on a mismatch anywhere on the ring.

    A call whose layout the ranks have agreed before may post its first data round between the
    two, on the links whose ends agree (both ends decide alike, so every message posted is
    received): the remaining hops then overlap that round instead of preceding it.
    """

    def __init__(
        self,
        ring: Ring,
        own: torch.Tensor,
        counter: Any,
        summary: Summary,
        device: torch.device | None,
        stats: CommStats | None = None,
    ) -> None:
        began = time.perf_counter()
        self.ring, self.counter, self.summary, self.device, self.stats = ring, counter, summary, device, stats
        self.own, self.total = own, own.clone()
        # Hop 1 both ways (the successor's header too: a link's two ends then know the same), then
        # dissemination hops 2, 4, ...: the maximum ignores the overlaps.
        self.rest = dissemination_distances(ring.size)[1:]
        behind, ahead = ring.at_distance(-1), ring
        from_predecessor, from_successor = torch.empty_like(own), torch.empty_like(own)
        works = [
            (*post_pair(own, from_predecessor, ahead, 1, HANDSHAKE_TAG), ahead),
            (*post_pair(own, from_successor, behind, 1, HANDSHAKE_TAG), behind),
        ]
        for recv_work, send_work, peer in works:
            wait_for(recv_work, peer, 1)
            wait_for(send_work, peer, 1)
        torch.maximum(self.total, from_predecessor, out=self.total)
        torch.maximum(self.total, from_successor, out=self.total)
        self.neighbours = (from_predecessor, from_successor)  # the headers of hop 1
        self._timed(began)

    def _timed(self, began: float) -> None:
        if self.stats is not None:
            self.stats.handshake_s += time.perf_counter() - began

    # Read only when asked (on an accelerator, reading them waits for the device).
    @property
    def predecessor_agrees(self) -> bool:
        return bool(torch.equal(self.neighbours[0][:4], self.own[:4]))

    @property
    def successor_agrees(self) -> bool:
        return bool(torch.equal(self.neighbours[1][:4], self.own[:4]))

    def finish(self) -> Agreed:
        """The remaining hops; :class:`SettingsMismatchError` on every rank if the settings
        hashes or call counts differ anywhere, with every rank's summary."""
        began = time.perf_counter()
        try:
            total = max_around(self.ring, self.total, HANDSHAKE_TAG, self.rest).tolist()
        finally:
            self._timed(began)
        self.rest = []
        if total[0] != -total[1] or total[2] != -total[3]:
            made = self.summary if isinstance(self.summary, str) else self.summary()
            what = (
                "different settings" if total[0] != -total[1]
                else "different call counts (a rank skipped a call, or calls from different threads met)"
            )  # fmt: skip
            if isinstance(made, Mapping):  # settings by name: the message names the first that differs
                fields = {**{k: str(v) for k, v in made.items()}, "call": str(self.counter)}
                raise SettingsMismatchError(_named(gather_text(self.ring, json.dumps(fields), self.device), what))
            texts = gather_text(self.ring, f"{made}, call #{self.counter}", self.device)
            lines = "; ".join(f"rank {r}: {text}" for r, text in enumerate(texts))
            raise SettingsMismatchError(f"cerar: ranks called the collective with {what}: {lines}")
        return Agreed(total[4], int(total[5]), int(total[6]))


def open_handshake(
    ring: Ring,
    settings: float,
    counter: Any,
    summary: Summary,
    proposal: Proposal = NO_PROPOSAL,
    *,
    device: torch.device | None = None,
    stats: CommStats | None = None,
) -> OpenHandshake:
    """Run the handshake's first hop (:class:`OpenHandshake`); ``finish()`` completes it."""
    fields = [settings, -settings, float(counter), -float(counter), proposal.max_abs, float(proposal.scale_exponent)]
    fields.append(float(proposal.nonfinite_rank))
    own = torch.tensor(fields, dtype=torch.float64, device=device or "cpu")
    return OpenHandshake(ring, own, counter, summary, device, stats)


def handshake(
    ring: Ring,
    settings: float,
    counter: Any,
    summary: Summary,
    proposal: Proposal = NO_PROPOSAL,
    *,
    device: torch.device | None = None,
    stats: CommStats | None = None,
) -> Agreed:
    """Run the handshake and return what every rank :class:`Agreed` on.

    Raises :class:`SettingsMismatchError` on every rank if the settings hashes or call counts
    differ, with every rank's ``summary`` (text, or a function that makes it: built only then).
    Non-finite inputs are found later, overlapped (:class:`cerar.comm.runtime.maxima.MaximaChain`).
    """
    return open_handshake(ring, settings, counter, summary, proposal, device=device, stats=stats).finish()


def _named(texts: list[str], what: str) -> str:  # what: the fallback's words
    """The message of a mismatch whose ranks sent their settings as JSON: the first setting that
    differs, with every rank's value (the whole listing if a text did not survive the 2 KiB cut)."""
    try:
        settings = [json.loads(text) for text in texts]
    except ValueError:
        return f"cerar: ranks called the collective with {what}: " + "; ".join(texts)
    keys = list(dict.fromkeys(k for s in settings for k in s))
    key = next((k for k in keys if len({s.get(k) for s in settings}) > 1), "call")
    values = "; ".join(f"rank {r}: {s.get(key)}" for r, s in enumerate(settings))
    named = "call counts (a rank skipped a call, or calls from different threads met)" if key == "call" else key
    return f"cerar: ranks called the collective with different {named}: {values}"


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
