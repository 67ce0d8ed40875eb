"""``method="auto"`` for DDP: :class:`AutoState` and :func:`auto_hook` send each gradient bucket
by the fastest method within the error budget, decided from measured steps, the same on every rank.

    >>> state = cerar.ddp.AutoState(max_error=1e-3)
    >>> ddp_model.register_comm_hook(state, cerar.ddp.auto_hook)  # or get_hook("auto")

The candidates (:mod:`cerar.comm.auto.candidates`): ``exact`` (DDP's default all-reduce),
``fp16`` (torch's ``fp16_compress_hook``), CERAR with float32 and with float16 packets; those
predicted above ``max_error`` are left out. The schedule, the agreement and the decision are
:class:`cerar.comm.auto.engine.AutoEngine`'s: exact warm-up steps, whole trial steps of each
candidate (one whose steps are far slower than an earlier one's is cut short), then per bucket
the smallest predicted time (CERAR only by a margin over the best exact/16-bit ring), verified
online by the steps. A step is timed from the end of the step before to its last bucket's
completion (the moment the ranks' last collective ends, about the same on every rank). The
measured time of a bucket, which fits the cost model, is its share of the link
(:class:`cerar.comm.auto.link.LinkClock`): from when its transport serves it (cerar's thread one
call at a time, Gloo's threads a few) to its completion, with the time it overlapped other calls
split among them. The engine's collectives run on a side Gloo group created with the
hook's own group at the first bucket, never on DDP's group.

``state.last_step`` (an :class:`AutoStep`) lists per bucket the method, the reason, and the
predicted and measured seconds; ``state.plan`` the current choices, ``state.decisions`` every
decision. An error raised when a candidate's call starts (an argument or code check, the same on
every rank), or a :class:`cerar.SettingsMismatchError` from its handshake (raised on every rank
before any data moves, the input intact), sends that bucket through the exact all-reduce instead
(``"fallback"``) and rules the candidate out at the next decision.
"""

# No ``from __future__ import annotations``: DDP inspects the hook's annotations.
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from cerar.coding.code import MAX_ERROR, check_max_error
from cerar.comm.auto.candidates import Candidate, build_candidates
from cerar.comm.auto.engine import AutoConfig, AutoEngine, SideGroup, new_side_group
from cerar.comm.auto.link import LinkClock
from cerar.comm.auto.model import Choice
from cerar.comm.ddp.state import CerarState, logger
from cerar.comm.ring.exact import exact_all_reduce
from cerar.comm.ring.stats import CommStats

__all__ = ["AutoState", "AutoStep", "BucketRecord", "auto_hook"]


@dataclass(frozen=True)
class BucketRecord:
    """What auto did with one bucket of a step."""

    index: int
    numel: int
    bytes: int
    method: str
    reason: str
    predicted_s: float | None
    measured_s: float | None


class AutoStep(CommStats):
    """A step's :class:`CommStats` (the transport's figures, as ``CerarState.last_step``) plus
    ``buckets``, a :class:`BucketRecord` per bucket in completion order."""

    def __init__(self, **counts: Any) -> None:
        super().__init__(**counts)
        self.buckets: list[BucketRecord] = []

    def describe(self) -> list[dict[str, Any]]:
        return [asdict(b) for b in self.buckets]


class AutoState(CerarState):
    """A :class:`CerarState` whose hook decides each bucket's method (see the module doc).

    Args:
        process_group, nonfinite, resync_every, divergence_tol, on_step: as :class:`CerarState`
            (``nonfinite`` applies to the CERAR candidates).
        max_error: the error budget: candidates whose predicted worst-rank error exceeds it are
            left out (``None``: none); default :data:`cerar.coding.code.MAX_ERROR` (0.1), which
            admits 16-bit CERAR. ``1e-3`` keeps the exact and float16 rings and float32 CERAR.
        auto: an :class:`cerar.comm.auto.engine.AutoConfig` (schedule, margin, hysteresis,
            candidates, pinned table); default ``AutoConfig()``.

    Attributes: those of :class:`CerarState` (``min_bucket_bytes`` is 0: every bucket is decided),
    plus ``max_error``, ``auto``, ``candidates`` and ``refused`` (the candidates within and
    beyond the budget, known from the first bucket), ``engine``, ``torch_buckets`` and
    ``torch_bytes`` (buckets sent by torch's all-reduce, and their bytes by the ring formula).
    """

    __slots__ = (
        "_agreement", "_in_pass", "_last_method", "_link", "auto", "candidates", "engine", "max_error", "refused",
        "torch_buckets", "torch_bytes",
    )  # fmt: skip
    _NOT_PICKLED = (
        *CerarState._NOT_PICKLED, "_agreement", "_last_method", "_link", "candidates", "engine", "refused",
    )  # fmt: skip
    _STEP_RECORD = AutoStep

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        *,
        max_error: float | None = MAX_ERROR,
        auto: AutoConfig | None = None,
        **settings: Any,
    ) -> None:
        for name in ("code", "packet_dtype", "min_bucket_bytes", "start_iter"):
            if name in settings:
                raise TypeError(f"Argument {name!r} does not apply to method 'auto' (it decides per bucket).")
        if auto is not None and not isinstance(auto, AutoConfig):
            raise TypeError(f"Argument 'auto' must be a cerar.ddp.AutoConfig or None, not {type(auto).__name__}.")
        super().__init__(process_group, None, min_bucket_bytes=0, **settings)
        self.max_error = check_max_error(max_error)
        self.auto: AutoConfig = auto if auto is not None else AutoConfig()
        self._forget()
        self.torch_buckets = 0
        self.torch_bytes = 0

    def _forget(self) -> None:
        """What is rebuilt at the first bucket (after unpickling too)."""
        self.candidates: list[Candidate] | None = None
        self.refused: list[Candidate] = []
        self.engine: AutoEngine | None = None
        self._agreement: SideGroup | None = None
        self._in_pass = False
        self._link = LinkClock()
        self._last_method: dict[int, int] = {}  # bucket index -> the candidate of its last call

    def resolve_group(self, coded: bool = True, dtype: torch.dtype = torch.float32) -> dist.ProcessGroup:
        """The hook's group and, created right after it at the first bucket on every rank, the
        side group, the candidates for the group's size and the engine."""
        group = super().resolve_group(False, dtype)
        if self.engine is None:
            assert self.world_size is not None
            self._agreement = new_side_group(self.process_group)
            self.candidates, self.refused = build_candidates(self.world_size, self.max_error, self.auto.candidates)
            self.engine = AutoEngine(self.candidates, self.auto, self._agreement)
            self._link = LinkClock({"cerar": 1, "torch": _torch_servers(group)})
        return group

    @property
    def plan(self) -> list[dict[str, Any]]:
        """The current choice per bucket (empty before the first decision)."""
        return [] if self.engine is None else [self.engine.describe(s) for s in sorted(self.engine.plan)]

    @property
    def decisions(self) -> list[dict[str, Any]]:
        """Every calibration, decision and verification so far, as plain values."""
        return [] if self.engine is None else self.engine.history

    def __getstate__(self) -> dict[str, Any]:
        names = CerarState.__slots__ + AutoState.__slots__
        skip = self._NOT_PICKLED + self._RESOLVED_AGAIN
        logger.warning("NOTE: process groups are not serialisable and are left out of the saved AutoState.")
        return {k: getattr(self, k) for k in names if k not in skip}

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._forget()  # the engine calibrates again, at the first bucket

    def __repr__(self) -> str:
        names = None if self.candidates is None else [c.label for c in self.candidates]
        return (
            f"AutoState(max_error={self.max_error}, candidates={names}, nonfinite={self.nonfinite!r}, "
            f"resync_every={self.resync_every}, iteration={self.iteration}, resyncs={self.resyncs})"
        )


# ---------------------------------------------------------------------------------------------
# The candidates' calls on one bucket: ``(state, candidate, bucket, comm group, stats) -> future``.

Start = Callable[[AutoState, Candidate, dist.GradBucket, dist.ProcessGroup, CommStats], torch.futures.Future[Any]]


def _exact(state: AutoState, candidate: Candidate, bucket: dist.GradBucket, group: Any, call: CommStats) -> Any:
    """DDP's default: divide, then ``dist.all_reduce`` on DDP's group."""
    return exact_all_reduce(bucket.buffer(), state.process_group, average=True, async_op=True)


def _compressed(hook: Callable[[Any, dist.GradBucket], Any]) -> Start:
    def start(state: AutoState, candidate: Candidate, bucket: dist.GradBucket, group: Any, call: CommStats) -> Any:
        return hook(state.process_group, bucket)  # torch's fp16/bf16_compress_hook

    return start


def _cerar(state: AutoState, candidate: Candidate, bucket: dist.GradBucket, group: Any, call: CommStats) -> Any:
    from cerar.comm.collective.api import all_reduce

    packet = {"fp32": None, "fp16": torch.float16, "bf16": torch.bfloat16}[candidate.wire]
    # 16-bit packets after another method ran the bucket (a trial, a verification's change):
    # the scale remembered from its last CERAR call may no longer fit the gradients, and the call
    # would be redone, so this one takes its scale from its data. Every rank switches at the
    # same step (the engine's schedule is agreed), so every rank passes the same flag.
    fresh = packet is not None and state._last_method.get(bucket.index()) != state.candidates.index(candidate)
    work = all_reduce(
        bucket.buffer(), "avg", group, True, code=candidate.code, nonfinite=state.nonfinite, packet_dtype=packet,
        max_error=None, stats=call, fresh_scale=fresh,
    )  # fmt: skip
    return work.get_future()


#: How each candidate runs on a bucket, by name.
STARTS: dict[str, Start] = {
    "exact": _exact,
    "fp16": _compressed(default_hooks.fp16_compress_hook),
    "bf16": _compressed(default_hooks.bf16_compress_hook),
    "cerar": _cerar,
    "cerar-fp16": _cerar,
    "cerar-bf16": _cerar,
}


def auto_hook(state: AutoState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average ``bucket`` by the method the state's engine chooses for it, asynchronously.

    1. At a pass's first bucket the engine begins the step (at its decision points the ranks
       agree their measurements on the side group and decide).
    2. The engine names the bucket's candidate; it starts; a start that raises ValueError or
       TypeError goes exact instead.
    3. When it completes, its service time is measured and recorded, a handshake mismatch is
       redone exactly on the side group, and the bucket's record joins ``state.last_step``.
    """
    if not isinstance(state, AutoState):
        raise TypeError(
            f"Argument 'state' of cerar's auto hook must be a cerar.ddp.AutoState, not {type(state).__name__}."
        )
    buffer = bucket.buffer()
    group = state.resolve_group(True, buffer.dtype)
    engine = state.engine
    assert engine is not None and state.candidates is not None
    step = state.iteration
    if buffer.layout != torch.strided:  # sparse: DDP's default, as cerar_hook does
        state.bucket_started(bucket.is_last())
        state.sparse_buckets += 1
        return _chain(state, bucket, _exact(state, state.candidates[0], bucket, group, CommStats()), step)
    if not state._in_pass:
        state._in_pass = True
        engine.begin_step(step, time.perf_counter())
    nbytes = buffer.numel() * buffer.element_size()
    choice = engine.choose(step, bucket.index(), buffer.numel(), nbytes)
    state.bucket_started(bucket.is_last())
    state._in_pass = not bucket.is_last()
    bucket_stats = state.note_bucket(bucket.index(), buffer.numel())
    call = CommStats()
    started = time.perf_counter()
    try:
        candidate = state.candidates[choice.candidate]
        try:
            future = STARTS[candidate.name](state, candidate, bucket, group, call)
        except (ValueError, TypeError) as exc:  # before any data moved, the same on every rank
            logger.warning("cerar auto: %s failed to start (%s); this bucket goes exact.", candidate.label, exc)
            engine.measured(step, bucket.index(), choice.candidate, math.inf)
            choice, candidate = Choice(0, "fallback"), state.candidates[0]
            future = _exact(state, candidate, bucket, group, call)
    except BaseException:
        state.bucket_done(None, None)
        raise
    state._last_method[bucket.index()] = state.candidates.index(candidate)
    if candidate.transport == "torch":
        state.torch_buckets += 1
        state.torch_bytes += round(candidate.bytes_per_value * buffer.numel())
    token = state._link.launch(candidate.transport, started)
    return _chain(state, bucket, future, step, (choice, token, call, bucket_stats))


def _chain(
    state: AutoState, bucket: dist.GradBucket, future: Any, step: int, launched: Any = None
) -> torch.futures.Future[Any]:
    """The bookkeeping after a bucket's future: measurement, record, the step's statistics, and
    the step's end for the engine when this bucket was its last (``launched`` None: sparse)."""

    def close(call: CommStats | None, bucket_stats: CommStats | None) -> None:
        if state.bucket_done(call, bucket_stats) and state.engine is not None:
            state.engine.end_step(step, time.perf_counter())

    def finish(fut: torch.futures.Future[Any]) -> torch.Tensor:
        if launched is None:  # sparse
            try:
                return _tensor(fut.value())
            finally:
                close(None, None)
        choice, token, call, bucket_stats = launched
        share = state._link.done(token, time.perf_counter())  # also when the call failed
        engine = state.engine
        try:
            try:
                result = _tensor(fut.value())
                seconds = share
            except Exception as exc:
                from cerar.comm.ring.handshake import SettingsMismatchError

                if not isinstance(exc, SettingsMismatchError):
                    raise
                result, seconds = _exact_on_side_group(state, bucket.buffer()), math.inf
                choice = Choice(0, "fallback", baseline=choice.baseline)
                engine.measured(step, bucket.index(), launched[1].candidate, seconds)
            else:
                engine.measured(step, bucket.index(), choice.candidate, seconds)
            record = BucketRecord(
                bucket.index(), bucket.buffer().numel(), bucket.buffer().numel() * bucket.buffer().element_size(),
                state.candidates[choice.candidate].label, choice.reason, choice.predicted_s,
                seconds if math.isfinite(seconds) else None,
            )  # fmt: skip
            with state._lock:
                state._step.buckets.append(record)  # type: ignore[attr-defined]
            return result
        finally:
            close(call, bucket_stats)

    return future.then(finish)


def _torch_servers(group: dist.ProcessGroup) -> int:
    """How many of torch's collectives on ``group`` run at once: Gloo's threads (two by
    default), one on a backend without that option (NCCL's stream)."""
    try:
        return max(1, int(group._get_backend(torch.device("cpu")).options._threads))
    except (AttributeError, RuntimeError, TypeError, ValueError):
        return 1


def _tensor(value: Any) -> torch.Tensor:
    return value[0] if isinstance(value, list) else value


def _exact_on_side_group(state: AutoState, buffer: torch.Tensor) -> torch.Tensor:
    """The exact average on the side group (the failed call ran on cerar's thread, whose order
    is the same on every rank; DDP's group may be busy with other buckets from another thread)."""
    assert state._agreement is not None
    exact_all_reduce(buffer, state._agreement.group, average=True)
    return buffer
