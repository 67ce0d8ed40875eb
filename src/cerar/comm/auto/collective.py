"""``cerar.all_reduce(tensor, ..., method="auto")``: the calls of one size by the winner of a
:class:`cerar.comm.auto.tournament.Tournament` over those calls, the same on every rank.

Every call agrees everything that decides it (size, dtype, op, budget, policy, settings, the
candidate, and the count of calls on the group) in the handshake of cerar's transport that opens
the candidate's call (the exact candidate's is a handshake alone, then torch's all-reduce): a rank
that differs makes every rank raise :class:`cerar.SettingsMismatchError` naming the setting,
before any data moves. The calls
of one size (and dtype, op, budget) form a stream with its own tournament; the least recently
used of more than ``AutoConfig.max_streams`` goes, so a workload of ever-changing sizes gets the
exact warm-up call for each. The candidates (:mod:`cerar.comm.auto.candidates`, collective
context): ``exact`` is ``torch.distributed.all_reduce`` on the caller's group, ``fp16``
``cerar.ring_all_reduce`` with a float16 wire, CERAR with float32 and 16-bit packets. A call's
time is its own wall time (async calls: from its start, or the previous completion if later, to
its completion); before a round's agreement the calls in flight are waited for. A candidate that
fails to start (the same error on every rank, before any data moved) makes that call exact and
is out. ``nonfinite="raise"`` holds whichever candidate runs: the rings' sums are the same on
every rank, so a non-finite one raises :class:`cerar.NonFiniteError` on every rank.
"""

from __future__ import annotations

import functools
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from cerar.coding.code import MAX_ERROR, check_max_error
from cerar.comm.auto.candidates import Candidate, build_candidates
from cerar.comm.auto.side import SideGroup
from cerar.comm.auto.tournament import AutoConfig, Run, Tournament
from cerar.comm.collective.api import register_method
from cerar.comm.collective.call import NonFiniteError, agree_call, cerar_call, ring_call
from cerar.comm.collective.checks import check_bool, check_op, check_stats, check_tensor
from cerar.comm.collective.policies import NONFINITE_POLICIES
from cerar.comm.ring.exact import exact_all_reduce
from cerar.comm.ring.groups import ring_of
from cerar.comm.ring.handshake import SettingsMismatchError
from cerar.comm.ring.stats import CommStats
from cerar.comm.ring.thread import COMM

__all__ = ["AutoWork", "auto_all_reduce", "auto_status"]

_PACKETS = {"fp32": None, "fp16": torch.float16, "bf16": torch.bfloat16}


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


class _Stream:
    __slots__ = ("key", "last", "tournament")

    def __init__(self, key: tuple[Any, ...], tournament: Tournament) -> None:
        self.key, self.tournament, self.last = key, tournament, -1  # the last call's candidate


class _GroupAuto:
    """One group's side group, its streams and the calls in flight."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.side = SideGroup(group)
        self.streams: OrderedDict[tuple[Any, ...], _Stream] = OrderedDict()
        self.outstanding: list[torch.futures.Future[Any]] = []
        self.transport_done = 0.0
        self.lock = threading.Lock()


_GROUPS: weakref.WeakKeyDictionary[Any, _GroupAuto] = weakref.WeakKeyDictionary()


@functools.lru_cache(maxsize=64)
def _candidates(world_size: int, budget: float | None, config: AutoConfig) -> list[Candidate]:
    candidates, _ = build_candidates(world_size, budget, config.candidates, "collective")
    return candidates


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
    size (see the module doc); ``max_error`` is the error budget, ``config`` the settings.
    Returns None, an :class:`AutoWork` with ``async_op``, and None on ranks outside ``group``."""
    check_tensor(tensor)
    reduce_op = check_op(op)
    async_op = check_bool("async_op", async_op)
    check_stats(stats)
    budget = check_max_error(max_error)
    if nonfinite not in NONFINITE_POLICIES:
        raise ValueError(f"Argument 'nonfinite' must be one of {NONFINITE_POLICIES}, not {nonfinite!r}.")
    config = AutoConfig() if config is None else config
    if not isinstance(config, AutoConfig):
        raise TypeError(f"Argument 'config' must be a cerar.ddp.AutoConfig or None, not {type(config).__name__}.")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("cerar: torch.distributed is not initialised; call init_process_group first.")
    if dist.get_rank(group) < 0:
        return None
    shared = _group_auto(group)
    key = (tensor.numel(), str(tensor.dtype), reduce_op, budget, nonfinite, config)
    stream = _stream(shared, key, tensor.numel() * tensor.element_size(), group, budget, config)
    tournament = stream.tournament
    if tournament.agree_due():
        _drain(shared)  # every measurement of the round must be in
        tournament.close_round(shared.side.max)
    run = tournament.next()
    candidate = tournament.candidates[run.candidate]
    # Everything that decides the call, agreed in the candidate's own handshake (the exact one's
    # is a handshake alone): a rank that differs makes every rank raise, naming the setting.
    names = ("size", "dtype", "op", "max_error", "nonfinite", "config")
    context = {**dict(zip(names, key, strict=True)), "method": "auto", "candidate": candidate.label}
    # 16-bit CERAR after another method's calls takes its packet scale from its data, since the
    # scale its last call left may no longer fit (every rank switches at the same call).
    fresh = run.candidate != stream.last
    started = time.perf_counter()
    try:
        call = _start(candidate, tensor, reduce_op, group, nonfinite, stats, fresh, context)
    except SettingsMismatchError:  # ranks that differ: raised on every rank
        raise
    except (ValueError, TypeError):  # before any data moved, the same on every rank
        tournament.failed(run.candidate)
        run, candidate = Run(0, -1, 0), tournament.candidates[0]
        call = _start(candidate, tensor, reduce_op, group, nonfinite, stats, fresh, {**context, "candidate": "exact"})
    stream.last = run.candidate

    def settle(wait: Callable[[], Any]) -> None:
        wait()
        done = time.perf_counter()
        with shared.lock:
            seconds, shared.transport_done = done - max(started, shared.transport_done), done
        tournament.measured(run, seconds)
        if nonfinite == "raise" and candidate.baseline and not bool(torch.isfinite(tensor).all()):
            raise NonFiniteError(
                f"cerar.all_reduce(method='auto'): the {candidate.label} sum of a tensor of {tensor.numel()} values "
                "is not finite (some rank's input held NaN or Inf, or the sum overflowed)."
            )

    if not async_op:
        settle(call.wait)
        return None

    def finish(fut: torch.futures.Future[Any]) -> list[torch.Tensor]:
        settle(fut.value)
        return [tensor]

    chained = call.get_future().then(finish)
    with shared.lock:
        shared.outstanding = [f for f in shared.outstanding if not f.done()] + [chained]
    return AutoWork(chained)


def _stream(
    shared: _GroupAuto, key: tuple[Any, ...], nbytes: int, group: dist.ProcessGroup | None, budget: float | None,
    config: AutoConfig,
) -> _Stream:  # fmt: skip
    """The stream of ``key``, made the most recently used; a new one drops the least recently used
    past ``config.max_streams``. Its tournament runs among the candidates the pins allow."""
    stream = shared.streams.get(key)
    if stream is None:
        candidates = _candidates(dist.get_world_size(group), budget, config)
        allowed, _ = config.pins.allowed(candidates, nbytes)
        trials = config.trials_for(steps=False)
        tournament = Tournament(candidates, trials, config.margin, config.recheck_every, allowed)
        stream = shared.streams[key] = _Stream(key, tournament)
        while len(shared.streams) > config.max_streams:
            shared.streams.popitem(last=False)
    shared.streams.move_to_end(key)
    return stream


def auto_status(group: dist.ProcessGroup | None = None) -> list[dict[str, Any]]:
    """Each ``method="auto"`` stream on ``group``, least recently used first: size, dtype, op,
    budget, the tournament's state, the candidates and the choice (None before it), as plain values."""
    shared = _GROUPS.get(dist.group.WORLD if group is None else group)
    if shared is None:
        return []
    out = []
    for (numel, dtype, op, budget, _, _), stream in shared.streams.items():
        t = stream.tournament
        choice = None if t.winner is None else {"method": t.label(t.winner)}
        out.append({
            "numel": numel, "dtype": dtype, "op": op, "max_error": budget, **t.describe(),
            "decided": t.winner is not None, "choice": choice,
            "candidates": [c.describe() for c in t.candidates], "history": t.history,
        })  # fmt: skip
    return out


def _group_auto(group: dist.ProcessGroup | None) -> _GroupAuto:
    pg = dist.group.WORLD if group is None else group
    shared = _GROUPS.get(pg)
    if shared is None:
        shared = _GROUPS[pg] = _GroupAuto(group)
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


def _start(
    candidate: Candidate, tensor: torch.Tensor, op: str, group: dist.ProcessGroup | None, nonfinite: str,
    stats: CommStats | None, fresh: bool, context: dict[str, Any],
) -> Any:  # fmt: skip
    """Start ``candidate`` on ``tensor`` (in place): a handle with ``wait()`` and ``get_future()``.
    The exact one agrees ``context`` on cerar's thread (in order with the calls in flight), then
    runs torch's all-reduce on the caller's thread, in order with the caller's own collectives."""
    ring = ring_of(group)
    assert ring is not None  # a member: checked by the caller
    if candidate.name == "exact":
        sent = round(2 * (ring.size - 1) / ring.size * tensor.numel() * tensor.element_size())
        COMM.submit(functools.partial(agree_call, ring, context, tensor.device, stats, sent), tensor, False)
        future = exact_all_reduce(tensor, group, average=op == "avg", async_op=True)
        assert future is not None
        return AutoWork(future)
    packet = _PACKETS[candidate.wire]
    if candidate.components is None:
        job = functools.partial(ring_call, tensor.detach(), op, ring, packet, stats, context)
    else:
        fresh = fresh and packet is not None
        code = candidate.code
        job = functools.partial(cerar_call, tensor.detach(), op, ring, code, nonfinite, stats, packet, fresh, context)
    return COMM.submit(job, tensor, True)


register_method("auto", auto_all_reduce)
