"""``method="auto"`` for DDP: :func:`auto_hook` sends every bucket of a step by the step's
candidate in :class:`AutoState`'s tournament over whole steps (``docs/auto.md``).

    >>> state = cerar.ddp.AutoState(max_error=1e-3)
    >>> ddp_model.register_comm_hook(state, cerar.ddp.auto_hook)

A step is timed from the end of the step before to its last bucket's completion: what the method
costs the step, CERAR's coding competing with backward for the cores included.
``state.last_step.buckets`` says where each bucket went and why.
"""

# No ``from __future__ import annotations``: DDP inspects the hook's annotations.
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from cerar.coding.linear_code import MAX_ERROR, check_max_error
from cerar.comm.auto.candidates import Candidate, build_candidates
from cerar.comm.auto.side import SideGroup
from cerar.comm.auto.tournament import AutoConfig, Run, Tournament
from cerar.comm.ddp.checkpoint import SETTINGS, Setting
from cerar.comm.ddp.hooks import Started, launch_bucket
from cerar.comm.ddp.state import CerarState, logger
from cerar.comm.runtime.handshake import SettingsMismatchError
from cerar.comm.runtime.stats import CommStats
from cerar.comm.runtime.torch_groups import torch_all_reduce

__all__ = ["AUTO_STATE_DICT_FORMAT", "AutoState", "AutoStep", "BucketRecord", "auto_hook"]

AUTO_STATE_DICT_FORMAT = "cerar.comm.auto.ddp.AutoState/1"


@dataclass(frozen=True)
class BucketRecord:
    """What auto did with one bucket of a step: its method, why (``warmup``, ``trial``, ``duel``,
    ``decided``, ``small``, ``pinned``, ``fallback``, ``sparse``) and its own wall time."""

    index: int
    numel: int
    bytes: int
    method: str
    reason: str
    seconds: float | None


class AutoStep(CommStats):
    """A step's :class:`CommStats` plus ``buckets``, a :class:`BucketRecord` per bucket."""

    def __init__(self, **counts: Any) -> None:
        super().__init__(**counts)
        self.buckets: list[BucketRecord] = []

    def describe(self) -> list[dict[str, Any]]:
        return [asdict(b) for b in self.buckets]


def _config_dict(config: AutoConfig) -> dict[str, Any]:
    return {**asdict(config), "pins": config.pins.text(), "candidates": list(config.candidates)}


def _config_from(value: Any) -> AutoConfig:
    if not isinstance(value, dict):
        raise TypeError(f"expected the dict of an AutoConfig, not {type(value).__name__}")
    return AutoConfig(**{**value, "candidates": tuple(value.get("candidates", ()))})


class AutoState(CerarState):
    """A :class:`CerarState` whose hook (:func:`auto_hook`) chooses the method (see the module doc).

    Args:
        process_group, nonfinite, resync_every, divergence_tol, on_step: as :class:`CerarState`
            (``nonfinite`` holds whichever candidate runs: under ``"raise"`` a ring's non-finite
            sum, the same on every rank, raises :class:`cerar.NonFiniteError`).
        max_error: the error budget: candidates predicted above it are left out (``None``: none);
            default :data:`cerar.coding.linear_code.MAX_ERROR` (0.1), which admits 16-bit CERAR.
            ``1e-3`` keeps the exact and float16 rings and float32 CERAR.
        auto: an :class:`cerar.comm.auto.tournament.AutoConfig` (trials, margin, recheck_every,
            pins, candidates); default ``AutoConfig()``.
        min_bucket_bytes: buckets smaller than this go exact (default 0: every bucket competes).

    Attributes: those of :class:`CerarState`, plus ``max_error``, ``auto``, ``candidates`` (within
    the budget, known from the first bucket), ``tournament``, ``plan`` (the current method),
    ``decisions`` (the tournament's history) and ``torch_bytes`` (what torch's collectives sent
    for the exact and 16-bit ring candidates, by the ring formula; ``stats`` has cerar's).
    """

    __slots__ = (
        "_in_pass", "_last", "_run", "_step_end", "auto", "candidates", "side", "torch_bytes",
        "tournament",
    )  # fmt: skip
    _NOT_PICKLED = (
        *CerarState._NOT_PICKLED, "_in_pass", "_last", "_run", "_step_end", "candidates", "side", "tournament",
    )  # fmt: skip
    _STEP_RECORD = AutoStep
    _FORMAT = AUTO_STATE_DICT_FORMAT
    _SETTINGS: ClassVar[dict[str, Setting]] = {
        **{k: SETTINGS[k] for k in ("nonfinite", "min_bucket_bytes", "resync_every", "divergence_tol")},
        "max_error": (lambda v: v, check_max_error),
        "auto": (_config_dict, _config_from),
    }

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        *,
        max_error: float | None = MAX_ERROR,
        auto: AutoConfig | None = None,
        min_bucket_bytes: int = 0,
        **settings: Any,
    ) -> None:
        for name in ("code", "wire_dtype", "packet_dtype", "start_iter", "error_feedback"):
            if name in settings:
                raise TypeError(f"Argument {name!r} does not apply to AutoState (it chooses the method).")
        if auto is not None and not isinstance(auto, AutoConfig):
            raise TypeError(f"Argument 'auto' must be a cerar.ddp.AutoConfig or None, not {type(auto).__name__}.")
        super().__init__(process_group, None, min_bucket_bytes=min_bucket_bytes, **settings)
        self.max_error = check_max_error(max_error)
        self.auto: AutoConfig = auto if auto is not None else AutoConfig()
        self.torch_bytes = 0  # what torch's collectives sent for it (the exact and 16-bit rings), by the ring formula
        self._forget()

    def _forget(self, keep_side: bool = False) -> None:
        """What the first bucket builds again (after unpickling or loading settings too; a
        state that loaded settings keeps its side group)."""
        self.candidates: list[Candidate] | None = None
        self.tournament: Tournament | None = None
        self.side: SideGroup | None = self.side if keep_side else None
        self._run = Run(0, -1, 0)
        self._in_pass = False  # a bucket of this backward pass was handed to the hook
        self._step_end: float | None = None
        self._last: dict[int, int] = {}  # bucket index -> the candidate of its last call

    def resolve_group(self) -> dist.ProcessGroup:
        """The hook's group, and at the first bucket on every rank: the side group, the settings
        agreed on it, the candidates and the tournament."""
        group = super().resolve_group()
        if self.tournament is None:
            assert self.world_size is not None
            if self.side is None:
                self.side = SideGroup(self.process_group)
            settings = {"max_error": self.max_error, "nonfinite": self.nonfinite, **_config_dict(self.auto)}
            self.side.check("cerar.ddp.AutoState", {**settings, "min_bucket_bytes": self.min_bucket_bytes})
            self.candidates, _ = build_candidates(self.world_size, self.max_error, self.auto.candidates)
            self.auto.pins.check(self.candidates)
            trials = self.auto.trials_for(steps=True)
            self.tournament = Tournament(self.candidates, trials, self.auto.margin, self.auto.recheck_every)
        return group

    def load_state_dict(self, state_dict: Any) -> None:
        super().load_state_dict(state_dict)
        self._forget(keep_side=True)  # the loaded settings take effect, agreed again, at the next bucket

    @property
    def plan(self) -> dict[str, Any]:
        """The tournament's state (empty before the first bucket)."""
        return {} if self.tournament is None else self.tournament.describe()

    @property
    def decisions(self) -> list[dict[str, Any]]:
        return [] if self.tournament is None else self.tournament.history

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._forget()

    def __repr__(self) -> str:
        return (
            f"AutoState(max_error={self.max_error}, auto={self.auto!r}, nonfinite={self.nonfinite!r}, "
            f"plan={self.plan}, iteration={self.iteration}, resyncs={self.resyncs})"
        )

    # -- one step --------------------------------------------------------------------------

    def begin_step(self) -> None:
        """At a pass's first bucket: the round's agreement if due, then the step's run."""
        assert self.tournament is not None and self.side is not None
        if self.tournament.agree_due():
            self.tournament.close_round(self.side.max)
        self._run = self.tournament.next()

    def candidate_for(self, nbytes: int) -> tuple[int, str]:
        """The bucket's candidate and why: small, pinned, or the step's."""
        assert self.tournament is not None and self.candidates is not None
        if nbytes < self.min_bucket_bytes:
            return 0, "small"
        allowed, pinned = self.auto.pins.allowed(self.candidates, nbytes)
        if pinned and self._run.candidate not in allowed:
            return allowed[0], "pinned"
        return self._run.candidate, self.tournament.phase

    def end_step(self) -> None:
        """The step's time, from the end of the step before (the warm-up step's is not used)."""
        assert self.tournament is not None
        now = time.perf_counter()
        previous, self._step_end = self._step_end, now
        self.tournament.measured(self._run, math.inf if previous is None else now - previous)


# -- the hook ------------------------------------------------------------------------------


def _start(
    state: AutoState, candidate: Candidate, bucket: dist.GradBucket, group: Any, call: CommStats, fresh: bool
) -> torch.futures.Future[Any]:
    """Start ``candidate`` on the bucket (averaged in place): torch's rows on DDP's own group,
    cerar's on the hook's."""
    target = state.process_group if candidate.route.transport == "torch" else group
    return candidate.start(bucket.buffer(), "avg", target, state.nonfinite, call, fresh=fresh).future


def auto_hook(state: AutoState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average ``bucket`` by the method of the state's tournament for this step, asynchronously.

    1. At a pass's first bucket the state begins the step (the ranks agree a finished round).
    2. The bucket's candidate starts; one that raises ValueError or TypeError starting (the same
       on every rank, before any data moved) is out, and the bucket goes exact.
    3. When it completes, a handshake mismatch (every input intact) is redone exactly on the side
       group and the candidate is out; the bucket's record joins ``state.last_step``, and the
       step's last bucket ends the step's time.
    """
    if not isinstance(state, AutoState):
        raise TypeError(f"Argument 'state' of cerar's auto hook must be an AutoState, not {type(state).__name__}.")
    buffer = bucket.buffer()
    group = state.resolve_group()
    tournament, candidates = state.tournament, state.candidates
    assert tournament is not None and candidates is not None
    index, call = bucket.index(), CommStats()
    if buffer.layout != torch.strided:  # sparse: DDP's default, as cerar_hook does

        def sparse() -> Started:
            state.sparse_buckets += 1
            future = _start(state, candidates[0], bucket, group, call, False)
            return future, _finish(state, bucket, candidates[0], "sparse")

        return launch_bucket(state, bucket, sparse, step_ended=state.end_step)
    if not state._in_pass:
        state.begin_step()
    state._in_pass = not bucket.is_last()
    if index in state.bucket_numel and state.bucket_numel[index] != buffer.numel():
        tournament.recheck()  # DDP rebuilt its buckets: the winner duels again from the next step
    bucket_stats = state.note_bucket(index, buffer.numel())

    def begin() -> Started:
        k, reason = state.candidate_for(buffer.numel() * buffer.element_size())
        try:
            future = _start(state, candidates[k], bucket, group, call, state._last.get(index) != k)
        except (ValueError, TypeError) as exc:  # before any data moved, the same on every rank
            logger.warning("cerar auto: %s failed to start (%s); this bucket goes exact.", candidates[k].label, exc)
            tournament.failed(k)
            k, reason = 0, "fallback"
            future = _start(state, candidates[0], bucket, group, call, False)
        state._last[index] = k
        if candidates[k].route.transport == "torch":  # cerar's transport measures its own bytes
            state.torch_bytes += round(candidates[k].bytes_per_value * buffer.numel())
        return future, _finish(state, bucket, candidates[k], reason)

    return launch_bucket(state, bucket, begin, (call, bucket_stats), state.end_step)


def _finish(
    state: AutoState, bucket: dist.GradBucket, candidate: Candidate, reason: str
) -> Callable[[torch.futures.Future[Any]], torch.Tensor]:
    """What makes the bucket's result once its call completes: the fall-back after a mismatch,
    the non-finite check of a ring's sum, and the bucket's record."""
    started = time.perf_counter()

    def finish(fut: torch.futures.Future[Any]) -> torch.Tensor:
        nonlocal reason
        try:
            value = fut.wait()
            result = value[0] if isinstance(value, list) else value
        except SettingsMismatchError:  # raised on every rank before any data moved
            assert state.side is not None and state.tournament is not None and state.candidates is not None
            state.tournament.failed(state.candidates.index(candidate))
            result, reason = bucket.buffer(), "fallback"
            torch_all_reduce(result, state.side.group, average=True)
        candidate.check_finite(result, state.nonfinite, f"average of bucket {bucket.index()}")
        record = BucketRecord(
            bucket.index(), result.numel(), result.numel() * result.element_size(),
            candidate.label if reason != "fallback" else "exact", reason, time.perf_counter() - started,
        )  # fmt: skip
        with state._lock:
            state._step.buckets.append(record)  # type: ignore[attr-defined]
        return result

    return finish
