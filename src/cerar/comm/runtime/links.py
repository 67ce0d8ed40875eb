"""Who talks to whom on cerar's ring, and how one message pair is posted and waited for.

:class:`Ring` is this rank's place on a one-directional ring over a process group; the posters
send a piece to the next rank and receive one from the previous over torch.distributed's
point-to-point ops (Gloo on CPU, NCCL on CUDA), with cerar's own tags, and turn a failure into a
:class:`RingError` that names the round and the peers. Device-agnostic.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "BATCH_ON_CPU", "DATA_TAG", "Ring", "RingError", "apart_posters", "group_timeout", "pair_poster", "post_pair",
    "wait_for",
]  # fmt: skip


@dataclass(frozen=True)
class Ring:
    """This rank's place on a one-directional ring over ``group``, in the group's own numbering
    (what its ``send``/``recv`` take): the ring needs nothing of torch's registry of groups, so it
    runs on a group torch does not know (as fault-tolerant trainers build them).

    Attributes:
        group: the process group the messages go over (``None``: the default group).
        rank: this rank's position on the ring.
        size: the ring's positions.
        send_to, recv_from: the group ranks of the positions after and before this one.
        peers: the group rank of every position (the handshake's hops need them).
    """

    group: dist.ProcessGroup | None
    rank: int
    size: int
    send_to: int
    recv_from: int
    peers: tuple[int, ...] = ()

    @functools.cached_property
    def endpoints(self) -> tuple[dist.ProcessGroup, int, int]:
        """``(process group, recv_from, send_to)``: what the group's own ``send``/``recv`` take."""
        return dist.group.WORLD if self.group is None else self.group, self.recv_from, self.send_to

    @functools.cached_property
    def _at_distance(self) -> dict[int, Ring]:
        return {}

    def at_distance(self, distance: int) -> Ring:
        """This ring with the ranks ``distance`` positions ahead and behind as the neighbours
        (for :mod:`cerar.comm.runtime.handshake`'s dissemination hops); needs ``peers``. Remembered, with
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
        """The ring of the calling process over ``group`` (positions are group ranks), or None
        if it is not a member; its rank and size are the group object's own."""
        if group is not None and not isinstance(group, dist.ProcessGroup):
            return None  # the marker dist.new_group returns to non-members
        pg = dist.group.WORLD if group is None else group
        rank, size = pg.rank(), pg.size()
        if rank < 0:
            return None
        return cls(group, rank, size, (rank + 1) % size, (rank - 1) % size, tuple(range(size)))


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
        f"cerar: ring round {round_index} failed at position {ring.rank} (receiving from group "
        f"rank {ring.recv_from}, sending to group rank {ring.send_to}): a peer died or "
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

    source, destination = _peers(ring)

    def post_batch(send: torch.Tensor, recv: torch.Tensor, round_index: int) -> tuple[dist.Work, dist.Work]:
        ops = [dist.P2POp(dist.irecv, recv, group=ring.group, tag=tag, **source),
               dist.P2POp(dist.isend, send, group=ring.group, tag=tag, **destination)]  # fmt: skip
        try:
            works = dist.batch_isend_irecv(ops)
        except RuntimeError as exc:
            raise _ring_error(ring, round_index, exc) from exc
        if len(works) == 1:  # NCCL may return one handle for the coalesced batch: it covers both
            return works[0], works[0]
        recv_work, send_work = works
        return recv_work, send_work

    return post_batch


#: torch 2.6 and newer name a P2POp's peer by its rank in the group (no registry needed).
_GROUP_PEER = "group_peer" in inspect.signature(dist.P2POp.__init__).parameters


def _peers(ring: Ring) -> tuple[dict[str, int], dict[str, int]]:
    """A P2POp's peer arguments for ``ring``'s predecessor and successor."""
    if _GROUP_PEER:
        return {"group_peer": ring.recv_from}, {"group_peer": ring.send_to}
    def to_global(rank: int) -> dict[str, int]:
        return {"peer": rank if ring.group is None else dist.get_global_rank(ring.group, rank)}

    return to_global(ring.recv_from), to_global(ring.send_to)


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
