"""``cerar.all_reduce(tensor, ..., method="auto")``: each call by the fastest method within the
error budget, decided from the calls themselves, the same on every rank.

The calls of one size (and dtype, op, budget) on one group form a stream that an
:class:`cerar.comm.auto.engine.AutoEngine` drives, one slot per call: the first ``warmup`` calls
exact, then ``trials`` calls of each candidate (twelve by default, :data:`COLLECTIVE_CONFIG`),
in turns (rounds of one call each, the first fewest bytes first, every other one reversed; a
16-bit CERAR call after another method's takes its packet scale from its data, except a counted
trial call, which takes the one its call of the round before left), a hopeless one
cut once two counted calls showed it
(:mod:`cerar.comm.auto.candidates`, collective context: ``exact`` is
``torch.distributed.all_reduce``, ``fp16`` ``cerar.ring_all_reduce`` with a float16 wire, CERAR
with float32 and float16 packets), then the decision, agreed on a side
Gloo group that the first ``method="auto"`` call on the group creates (every rank makes its
calls in the same order, so every rank creates it there). A call's measured time is its own
wall time (``async_op=True``: from its start, or the previous completion if later, to its
completion); before the ranks agree, the calls still in flight are waited for, so that every
measurement is in.

:func:`auto_status` lists each stream's phase and choice. An error raised when a candidate
starts (argument or code checks, the same on every rank) or a handshake mismatch makes that call
exact (``"fallback"``, on the side group for a mismatch, whose input is intact) and rules the
candidate out at the next decision.
"""

from __future__ import annotations

import functools
import math
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from cerar.coding.code import MAX_ERROR, check_max_error
from cerar.comm.auto.candidates import Candidate, build_candidates
from cerar.comm.auto.engine import AutoConfig, AutoEngine, SideGroup, new_side_group
from cerar.comm.collective.api import register_method
from cerar.comm.collective.call import cerar_call, ring_call
from cerar.comm.collective.checks import check_bool, check_op, check_stats, check_tensor
from cerar.comm.collective.policies import NONFINITE_POLICIES
from cerar.comm.ring.exact import exact_all_reduce
from cerar.comm.ring.groups import ring_of
from cerar.comm.ring.stats import CommStats
from cerar.comm.ring.thread import COMM

__all__ = ["COLLECTIVE_CONFIG", "AutoWork", "auto_all_reduce", "auto_status"]

_PACKETS = {"fp32": None, "fp16": torch.float16, "bf16": torch.bfloat16}

#: The collective's default knobs: ``AutoConfig()`` but for eleven counted trial calls per
#: candidate, not two. One call's time scatters far more than a DDP step's (a step sums many
#: buckets: at 1 MB on a 400 Mbit/s link calls of one method range over 2x), so that a median
#: of a few calls often ranks two close methods the wrong way round; a hopeless candidate is
#: still cut after three calls, so the extra ones are calls of methods close to the best.
COLLECTIVE_CONFIG = AutoConfig(trials=12)


class AutoWork:
    """Handle of an async ``method="auto"`` call, shaped like ``torch.distributed.Work``."""

    def __init__(self, future: torch.futures.Future[list[torch.Tensor]]) -> None:
        self._future = future

    def wait(self, timeout: float | None = None) -> bool:
        self._future.wait()
        return True

    def is_completed(self) -> bool:
        return self._future.done()

    def get_future(self) -> torch.futures.Future[list[torch.Tensor]]:
        return self._future


class _GroupAuto:
    """One group's side group, its streams (one engine per size) and the calls in flight."""

    __slots__ = ("lock", "outstanding", "side", "streams", "transport_done")

    def __init__(self, side: SideGroup) -> None:
        self.side = side
        self.streams: dict[tuple[Any, ...], tuple[AutoEngine, list[int]]] = {}  # key -> (engine, [calls])
        self.outstanding: list[torch.futures.Future[Any]] = []
        self.transport_done = 0.0
        self.lock = threading.Lock()


_GROUPS: weakref.WeakKeyDictionary[Any, _GroupAuto] = weakref.WeakKeyDictionary()


def auto_all_reduce(
    tensor: torch.Tensor,
    op: Any = "sum",
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
    *,
    max_error: float | None = MAX_ERROR,
    nonfinite: str = "raise",
    stats: CommStats | None = None,
    config: AutoConfig | None = None,
) -> AutoWork | None:
    """Sum (or average) ``tensor`` over ``group`` in place by the method auto chooses for its
    size (see the module doc); ``max_error`` is the error budget, ``config`` the schedule and
    knobs (default :data:`COLLECTIVE_CONFIG`). Returns None, an :class:`AutoWork` with ``async_op``, and
    None on ranks outside ``group``."""
    check_tensor(tensor)
    reduce_op = check_op(op)
    async_op = check_bool("async_op", async_op)
    check_stats(stats)
    budget = check_max_error(max_error)
    if nonfinite not in NONFINITE_POLICIES:
        raise ValueError(f"Argument 'nonfinite' must be one of {NONFINITE_POLICIES}, not {nonfinite!r}.")
    config = config if config is not None else COLLECTIVE_CONFIG
    if not isinstance(config, AutoConfig):
        raise TypeError(f"Argument 'config' must be a cerar.ddp.AutoConfig or None, not {type(config).__name__}.")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("cerar: torch.distributed is not initialised; call init_process_group first.")
    if dist.get_rank(group) < 0:
        return None
    shared = _group_auto(group)
    key = (tensor.numel(), str(tensor.dtype), reduce_op, budget, nonfinite, config)
    if key not in shared.streams:
        candidates, _ = build_candidates(dist.get_world_size(group), budget, config.candidates, "collective")
        shared.streams[key] = (AutoEngine(candidates, config, shared.side, steps=False), [0, -1])
    engine, counter = shared.streams[key]  # [the next call's step, the last call's candidate]
    step = counter[0]
    counter[0] += 1
    if engine.agreement_due(step):  # every measurement must be in before the ranks agree
        _drain(shared)
    engine.begin_step(step)
    choice = engine.choose(step, 0, tensor.numel(), tensor.numel() * tensor.element_size())
    candidate = engine.candidates[choice.candidate]
    started = time.perf_counter()
    # 16-bit CERAR after another method's calls takes its scale from the data (see the DDP hook),
    # but not in a counted trial call: there it takes the scale its own call of the round before
    # left, as a stream of its calls would, since a fresh scale costs a blocking exchange of
    # maxima that the decided method does not pay (a call whose data outgrew it is redone).
    kind, _, trial = engine.phase(step)
    fresh = choice.candidate != counter[1] and not (kind == "trial" and trial > 0)
    try:
        call = _start(candidate, tensor, reduce_op, group, nonfinite, stats, fresh)
    except (ValueError, TypeError):  # before any data moved, the same on every rank
        engine.measured(step, 0, choice.candidate, math.inf)
        candidate, choice = engine.candidates[0], None
        call = _start(candidate, tensor, reduce_op, group, nonfinite, stats, fresh)
    counter[1] = engine.candidates.index(candidate)

    def redo_exactly() -> None:  # a handshake mismatch: every rank's input is intact
        _exact_on(shared.side.group, tensor, reduce_op)
        engine.measured(step, 0, engine.candidates.index(candidate), math.inf)

    def measure() -> None:
        done = time.perf_counter()
        with shared.lock:
            seconds = done - max(started, shared.transport_done)
            shared.transport_done = done
        if choice is not None:
            engine.measured(step, 0, choice.candidate, seconds)

    def settle(wait: Callable[[], Any]) -> None:
        from cerar.comm.ring.handshake import SettingsMismatchError

        try:
            wait()
        except SettingsMismatchError:
            redo_exactly()
        else:
            measure()

    if not async_op:  # waited for here and measured inline: no callbacks to hand over between threads
        settle(call.wait)
        return None

    def finish(fut: torch.futures.Future[Any]) -> list[torch.Tensor]:
        settle(fut.value)
        return [tensor]

    chained = call.future().then(finish)
    with shared.lock:
        shared.outstanding = [f for f in shared.outstanding if not f.done()] + [chained]
    return AutoWork(chained)


def auto_status(group: dist.ProcessGroup | None = None) -> list[dict[str, Any]]:
    """Each ``method="auto"`` stream on ``group``: size, dtype, op, budget, calls made, phase,
    the candidates and the current choice (None before the decision) as plain values."""
    shared = _GROUPS.get(dist.group.WORLD if group is None else group)
    if shared is None:
        return []
    out = []
    for (numel, dtype, op, budget, _, _), (engine, counter) in shared.streams.items():
        kind, _, _ = engine.phase(counter[0])
        out.append(
            {
                "numel": numel,
                "dtype": dtype,
                "op": op,
                "max_error": budget,
                "calls": counter[0],
                "phase": kind,
                "decided": bool(engine.plan),
                "candidates": [c.describe() for c in engine.candidates],
                "choice": engine.describe(0) if 0 in engine.plan else None,
                "history": engine.history,
            }
        )
    return out


def _group_auto(group: dist.ProcessGroup | None) -> _GroupAuto:
    pg = dist.group.WORLD if group is None else group
    shared = _GROUPS.get(pg)
    if shared is None:
        shared = _GROUPS[pg] = _GroupAuto(new_side_group(group))
    return shared


def _drain(shared: _GroupAuto) -> None:
    """Wait for the calls in flight (their errors reach their own handles, not here)."""
    with shared.lock:
        pending, shared.outstanding = shared.outstanding, []
    for future in pending:
        try:
            future.wait()
        except Exception:
            pass


class _Started:
    """A candidate's call, started: :meth:`wait` completes it in the caller's thread (its error
    raised there), :meth:`future` hands it to a ``torch.futures.Future`` instead (one or the other)."""

    __slots__ = ("finish", "handle", "tensor")

    def __init__(self, handle: Any, tensor: torch.Tensor, finish: Callable[[], None] | None = None) -> None:
        self.handle, self.tensor, self.finish = handle, tensor, finish

    def wait(self) -> None:
        self.handle.wait()
        if self.finish is not None:
            self.finish()

    def future(self) -> torch.futures.Future[Any]:
        future = self.handle.get_future()
        if self.finish is None:
            return future
        finish, tensor = self.finish, self.tensor

        def done(fut: torch.futures.Future[Any]) -> list[torch.Tensor]:
            fut.value()
            finish()
            return [tensor]

        return future.then(done)


def _start(
    candidate: Candidate,
    tensor: torch.Tensor,
    op: str,
    group: dist.ProcessGroup | None,
    nonfinite: str,
    stats: CommStats | None,
    switched: bool = False,
) -> _Started:
    """Start ``candidate`` on ``tensor`` (the result lands in place). The cerar candidates run
    as ``cerar.all_reduce`` / ``ring_all_reduce`` run them (one call on the communication
    thread), their settings already checked: the code is auto's own, for the group. A 16-bit
    CERAR call that follows another method's (``switched``) takes its packet scale from its data."""
    if candidate.name == "exact":
        future = exact_all_reduce(tensor, group, average=op == "avg", async_op=True)
        assert future is not None
        return _Started(_FutureHandle(future), tensor)
    ring = ring_of(group)
    assert ring is not None  # a member: checked by the caller
    if candidate.components is None:
        job = functools.partial(ring_call, tensor.detach(), op, ring, _PACKETS[candidate.wire], stats)
    else:
        packet = _PACKETS[candidate.wire]
        fresh = switched and packet is not None
        job = functools.partial(cerar_call, tensor.detach(), op, ring, candidate.code, nonfinite, stats, packet, fresh)
    return _Started(COMM.submit(job, tensor, True), tensor)


def _exact_on(group: dist.ProcessGroup | None, tensor: torch.Tensor, op: str) -> None:
    """The exact sum (or average) on ``group``, blocking: a failed call's redo."""
    exact_all_reduce(tensor, group, average=op == "avg")


class _FutureHandle:
    """A future as the handle :class:`_Started` waits on."""

    def __init__(self, future: torch.futures.Future[Any]) -> None:
        self._future = future

    def wait(self) -> None:
        self._future.wait()

    def get_future(self) -> torch.futures.Future[Any]:
        return self._future


register_method("auto", auto_all_reduce)
