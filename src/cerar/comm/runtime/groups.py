"""What cerar keeps per process group, under one key.

A group's state (its call counter, statistics, remembered packet scales and hierarchical node
groups) is keyed by the group object itself, weakly: ``None`` and ``dist.group.WORLD`` are the
same group (the default one), and a group that ``destroy_process_group`` released takes its state
with it, so a new group can never inherit an old one's call count, even where the allocator reuses
the old object's address (an ``id()`` key did, on some ranks and not others, and the next call
raised a spurious "different call counts" on every rank).
"""

from __future__ import annotations

import hashlib
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from cerar.comm.runtime.links import Ring
from cerar.comm.runtime.stats import CommStats

__all__ = [
    "ORIGIN",
    "CallNumber",
    "GroupState",
    "count_call",
    "group_state",
    "require_initialised",
    "ring_of",
    "thread_key",
]

#: The thread a call came from, as :func:`thread_key` names it: set by the communication thread
#: while it runs the call (:mod:`cerar.comm.runtime.thread`), read by :func:`count_call`.
ORIGIN = threading.local()


def thread_key(thread: threading.Thread | None = None) -> str:
    """A name for a thread that is the same on every rank of an SPMD program: ``"MainThread"``,
    ``"native"`` for threads Python did not start (autograd's device threads, where DDP's and
    FSDP2's hooks run on an accelerator), else the Python thread's name (``Thread-3 (work)``
    unless the program named it: ranks that started different numbers of threads before
    disagree on the number and raise naming both, which naming the threads mends)."""
    thread = threading.current_thread() if thread is None else thread
    if isinstance(thread, threading._DummyThread):  # type: ignore[attr-defined]
        return "native"
    return thread.name


@dataclass(frozen=True)
class CallNumber:
    """A call's number on its group: the group's count, and its thread's own (:func:`thread_key`).

    The handshake compares ``float(number)``, a 48-bit digest of the three: ranks agree only on
    the same call of the group *from the same thread*. Calls that several threads make on one
    group at once reach the ranks in different orders; without the thread in the number, calls
    of equal settings from different threads would pair up and sum different tensors silently.
    """

    group: int
    thread: str
    in_thread: int

    def __float__(self) -> float:
        digest = hashlib.sha256(f"{self.group}|{self.thread}|{self.in_thread}".encode()).digest()
        return float(int.from_bytes(digest[:6], "big"))

    def __str__(self) -> str:
        return f"{self.group} (from thread {self.thread!r}, its call {self.in_thread})"



@dataclass
class GroupState:
    """One group's bookkeeping on this process.

    Attributes:
        calls: cerar calls accepted on the group so far (the handshake compares it).
        thread_calls: per thread (:func:`thread_key`), its calls on the group so far.
        stats: the group's cumulative :class:`CommStats` (``cerar.get_stats(group)``).
        scale_exponents: per ``(send_to, recv_from, size, packet precision)``, the packet scale
            exponent the last CERAR call of that size ended with.
        agreed: the ``(key, settings hash)`` pairs (the same key) of the CERAR calls that every
            rank completed: a later call of one of them is of an agreed layout
            (:class:`cerar.comm.runtime.handshake.OpenHandshake`), also when calls of other settings at
            that size came between (two codes, or methods a benchmark runs in turns).
        nodes: per ``ranks_per_node``, the hierarchical path's node groups.
        ring: this process's :class:`cerar.comm.runtime.links.Ring` over the group (``False`` if it
            is not a member), worked out by the first call (the group's membership is fixed).
    """

    calls: int = 0
    stats: CommStats = field(default_factory=CommStats)
    scale_exponents: dict[tuple[Any, ...], int] = field(default_factory=dict)
    agreed: set[tuple[tuple[Any, ...], float]] = field(default_factory=set)
    thread_calls: dict[str, int] = field(default_factory=dict)
    nodes: dict[int, Any] = field(default_factory=dict)
    ring: Ring | bool | None = None


_STATES: weakref.WeakKeyDictionary[Any, GroupState] = weakref.WeakKeyDictionary()
_MARKERS: dict[Any, GroupState] = {}
_BEFORE_INIT = GroupState()  # get_stats() before init_process_group: nothing runs there
_LOCK = threading.Lock()


def group_state(group: dist.ProcessGroup | None) -> GroupState:
    """The :class:`GroupState` of ``group`` (``None``: the default group)."""
    pg = dist.group.WORLD if group is None else group
    if pg is None:  # not initialised
        return _BEFORE_INIT
    with _LOCK:
        try:
            states: Any = _STATES
            state = states.get(pg)
        except TypeError:  # not weakly referable: the non-member marker new_group returns (an int)
            states = _MARKERS
            state = states.get(pg)
        if state is None:
            state = states[pg] = GroupState()
        return state


def count_call(group: dist.ProcessGroup | None) -> CallNumber:
    """Count a call on ``group`` and return its :class:`CallNumber`, its thread the one the
    communication thread runs it for (:data:`ORIGIN`; see
    :func:`cerar.comm.collective.call.call_context`)."""
    state = group_state(group)
    origin = getattr(ORIGIN, "key", None) or thread_key()
    with _LOCK:
        state.calls += 1
        state.thread_calls[origin] = state.thread_calls.get(origin, 0) + 1
        return CallNumber(state.calls, origin, state.thread_calls[origin])


def require_initialised(who: str | None = None) -> None:
    """Raise RuntimeError unless torch.distributed is initialised: every way into cerar that needs
    a process group opens with it. ``who``: the class that needs it, named in the message."""
    if dist.is_available() and dist.is_initialized():
        return
    if who is None:
        raise RuntimeError("cerar: torch.distributed is not initialised; call init_process_group first.")
    raise RuntimeError(f"{who} needs torch.distributed initialised; call init_process_group first.")


def ring_of(group: dist.ProcessGroup | None) -> Ring | None:
    """This process's :class:`Ring` over ``group`` (None if it is not a member), worked out once
    per group: its members and their global ranks do not change."""
    require_initialised()
    state = group_state(group)
    if state.ring is None:
        state.ring = Ring.of(group) or False
    return state.ring or None
