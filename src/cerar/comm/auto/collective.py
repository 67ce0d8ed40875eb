"""``cerar.all_reduce(tensor, ..., method="auto")``: the calls of one size, dtype, op and budget
(a stream; the ``AutoConfig.max_streams`` most recently used are kept) by the winner of their
own :class:`cerar.comm.auto.tournament.Tournament` (``docs/auto.md``). Everything that decides
a call is agreed in the handshake that opens its candidate's call, so ranks that differ raise
:class:`cerar.SettingsMismatchError` together, before any data moves. A call is timed from its
start, or from the previous call's completion if later (calls queue on one thread), to its own.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from cerar.coding.linear_code import MAX_ERROR
from cerar.comm.auto.candidates import Candidate, build_candidates
from cerar.comm.auto.side import SideGroup
from cerar.comm.auto.tournament import AutoConfig, Run, Tournament
from cerar.comm.collective.routes import Call, Route, register_route, start
from cerar.comm.runtime.groups import ring_of
from cerar.comm.runtime.handshake import SettingsMismatchError
from cerar.comm.runtime.stats import CommStats
from cerar.comm.runtime.work import Work, forward

__all__ = ["AUTO", "auto_all_reduce", "auto_status"]


@dataclass
class _Stream:
    tournament: Tournament
    last: int = -1  # the last call's candidate


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
) -> Work | None:
    """Sum (or average) ``tensor`` over ``group`` in place by the method auto chooses for its
    size (see the module doc); ``max_error`` is the error budget, ``config`` the settings.
    Returns None, a :class:`Work` with ``async_op``, and None on ranks outside ``group``."""
    if config is not None and not isinstance(config, AutoConfig):
        raise TypeError(f"Argument 'config' must be a cerar.ddp.AutoConfig or None, not {type(config).__name__}.")
    route = AUTO if config is None else replace(AUTO, start=functools.partial(_start_auto, config=config))
    return start(route, tensor, op, group, async_op, max_error=max_error, nonfinite=nonfinite, stats=stats)


def _start_auto(route: Route, c: Call, config: AutoConfig | None = None) -> Work | None:
    """One call by its stream's tournament (the route's start; the arguments checked)."""
    config = AutoConfig() if config is None else config
    ring = ring_of(c.group)  # refuses an uninitialised torch.distributed
    if ring is None:
        return None
    r = c.resolve(route, ring.size)
    shared, tensor = _group_auto(r.group), r.tensor
    key = (tensor.numel(), str(tensor.dtype), r.op, r.max_error, r.nonfinite, config)
    stream = _stream(shared, key, tensor.numel() * tensor.element_size(), ring.size, r.max_error, config)
    tournament = stream.tournament
    if tournament.agree_due():
        _drain(shared)  # every measurement of the round must be in
        tournament.close_round(shared.side.max)
    run = tournament.next()
    candidate = tournament.candidates[run.candidate]
    # Everything that decides the call, agreed in the candidate's own handshake (the exact one's
    # is a handshake alone): a rank that differs makes every rank raise, naming the setting.
    names = ("size", "dtype", "op", "max_error", "nonfinite", "config")
    context = {**(r.context or {}), **dict(zip(names, key, strict=True))}
    context.update(method="auto", candidate=candidate.label)
    started = time.perf_counter()
    try:
        call = candidate.start(tensor, r.op, r.group, r.nonfinite, r.stats, context, run.candidate != stream.last)
    except SettingsMismatchError:  # ranks that differ: raised on every rank
        raise
    except (ValueError, TypeError):  # before any data moved, the same on every rank
        tournament.failed(run.candidate)
        run, candidate = Run(0, -1, 0), tournament.candidates[0]
        call = candidate.start(tensor, r.op, r.group, r.nonfinite, r.stats, {**context, "candidate": "exact"})
    stream.last = run.candidate

    def settle(value: Any) -> list[torch.Tensor]:
        done = time.perf_counter()
        with shared.lock:
            seconds, shared.transport_done = done - max(started, shared.transport_done), done
        tournament.measured(run, seconds)
        candidate.check_finite(tensor, r.nonfinite, f"sum of a tensor of {tensor.numel()} values")
        return [tensor]

    devices = [tensor.device] if tensor.device.type == "cuda" else None
    chained = forward(call.future, settle, devices)
    with shared.lock:
        shared.outstanding = [f for f in shared.outstanding if not f.done()] + [chained]
    work = Work(chained)
    if r.async_op:
        return work
    work.wait()
    return None


def _stream(
    shared: _GroupAuto, key: tuple[Any, ...], nbytes: int, world_size: int, budget: float | None, config: AutoConfig
) -> _Stream:
    """The stream of ``key``, made the most recently used; a new one drops the least recently used
    past ``config.max_streams``. Its tournament runs among the candidates the pins allow."""
    stream = shared.streams.get(key)
    if stream is None:
        candidates = _candidates(world_size, budget, config)
        allowed, _ = config.pins.allowed(candidates, nbytes)
        trials = config.trials_for(steps=False)
        tournament = Tournament(candidates, trials, config.margin, config.recheck_every, allowed)
        stream = shared.streams[key] = _Stream(tournament)
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
        with contextlib.suppress(Exception):
            future.wait()


#: ``method="auto"``'s row: the fastest of the rows its candidates name, within ``max_error``.
AUTO = register_route(Route(
    "auto", "auto", None, _start_auto, identical=False,
    description="the fastest row within max_error, decided from its own calls, the same on every rank",
))  # fmt: skip
