"""The state of cerar's DDP hooks: :class:`CerarState` (settings, per-bucket buffers, statistics).

Built before or after ``init_process_group``, like ``PowerSGDState``: what needs the group is
resolved at the first bucket. The hooks themselves live in :mod:`cerar.comm.ddp.hooks` (the public
``cerar.ddp``), which re-exports everything here.
"""

import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from cerar._checks import check_bool, check_choice, renamed
from cerar.coding.linear_code import MAX_ERROR, Code, check_max_error
from cerar.comm.algorithms.ring.feedback import ErrorFeedback
from cerar.comm.collective.policies import NONFINITE_POLICIES
from cerar.comm.ddp.checkpoint import (
    SETTINGS,
    STATE_DICT_FORMAT,
    check_count,
    check_every,
    check_packet_dtype,
    check_tol,
    from_state_dict,
    to_state_dict,
)
from cerar.comm.ddp.replicas import ReplicaSync
from cerar.comm.runtime.groups import require_initialised
from cerar.comm.runtime.stats import CommStats
from cerar.comm.runtime.torch_groups import new_group_like

__all__ = ["DEFAULT_MIN_BUCKET_BYTES", "CerarState"]

logger = logging.getLogger("cerar.comm.ddp.hooks")


#: :class:`CerarState`'s default ``min_bucket_bytes``: 2 MiB, the crossover below which CERAR's
#: fixed cost per call (its ``c + N - 2`` rounds and the handshake) outweighs the bytes it saves
#: against Gloo's all-reduce on the slow network (``cerar bench --regime slow -N 4 -c 8``; the
#: figures are in ``docs/results.md``). Re-measure it when CERAR's per-call fixed cost changes.
DEFAULT_MIN_BUCKET_BYTES = 2 * 1024 * 1024


class CerarState(ReplicaSync):
    r"""Settings, per-bucket buffers and statistics of :func:`cerar_hook` / :func:`ring_hook`.

    Build one per DDP model, before or after ``init_process_group``, and register it with
    ``ddp_model.register_comm_hook(state, cerar_hook)``. Only the settings are checked when it is
    built; the group's size, the default code for it, the check that ``code`` fits the group and
    the hook's own process group are resolved at the first bucket, a point every rank of the
    group reaches together (so a code for the wrong number of ranks raises there, in backward).

    The dedicated group (``dist.new_group`` over the same ranks) carries only the hook's ring
    traffic, so its point-to-point messages can never interleave with DDP's own collectives on
    ``process_group`` (the initial broadcast, bucket rebuilds, :func:`replica_divergence`). For
    a group smaller than the world it is created by its members only
    (``use_local_synchronization``), since the other ranks never run the hook.

    Args:
        process_group: the group DDP averages over (``None``: the default group).
        code: the :class:`cerar.Code`; its ``world_size`` must equal the group's size. ``None``:
            the route's one rule (:meth:`cerar.comm.collective.routes.Route.code_for`, the
            default code within ``max_error``), resolved at the first bucket. Ignored by the
            rings' hooks.
        nonfinite: what a bucket holding NaN or Inf on some rank does, for CERAR's and the block
            rings' hooks (``ring-int8``, ``ring-int4``...). ``"exact"`` (default): that bucket
            goes through the exact ring instead (CERAR's mixing would spread one NaN across the
            ``c`` components of its column on every rank, a block ring's to its block; the exact
            ring keeps it where it was, as DDP's default would) and ``stats.fallbacks`` counts
            it. ``"raise"``: backward raises :class:`cerar.comm.collective.api.NonFiniteError`
            on every rank. ``"ignore"``: no check.
        wire_dtype: CERAR's packets on the wire (see :func:`cerar.all_reduce`; the deprecated
            ``packet_dtype`` is accepted with a ``DeprecationWarning``): ``None``
            (float32 for float32 gradients), or ``torch.float16`` / ``torch.bfloat16``, half the
            bytes; the default code is then the one tuned for that precision. Ignored by the
            rings' hooks.
        max_error: as :func:`cerar.all_reduce`'s, for every bucket: a row predicted above it is
            refused, and the default code is bound by it (``ring-int4`` needs more than 0.1).
        resync_every: re-synchronise the replicas every this many optimizer steps (``None``:
            never on a schedule). Each re-sync broadcasts all parameters from the group's rank 0:
            ``4 x parameters`` bytes leave rank 0, about the time of one exact all-reduce.
        divergence_tol: re-synchronise whenever :func:`replica_divergence` exceeds this
            (``None``: never measured by the state). The check runs after every optimizer step
            and costs one pass over the parameters and an all-gather of ``SKETCH_SIZE + 1``
            float64 values per rank (8 KiB), negligible next to a gradient all-reduce.
        min_bucket_bytes: a dense bucket whose buffer holds fewer bytes than this goes to the exact
            all-reduce (``torch.distributed.all_reduce`` on ``process_group``, averaged as
            ``default_hooks.allreduce_hook``: bitwise DDP's default), counted in
            ``exact_buckets``. Below it CERAR's fixed cost per call (its ``c + N - 2`` rounds, the
            per-call agreement) outweighs the bytes it saves, as PowerSGD's
            ``min_compression_rate`` and CGX's ``layer_min_size`` keep small layers
            uncompressed. Default :data:`DEFAULT_MIN_BUCKET_BYTES` (2 MiB, the measured
            crossover on the slow network); ``0`` sends every dense bucket through the hook's ring.
            DDP's first bucket of each pass is capped at 1 MiB, so with the default it is exact.
        start_iter: the first ``start_iter`` backward passes (``iteration < start_iter``) send
            every bucket to the exact all-reduce, as PowerSGD's ``start_powerSGD_iter``: an
            exact warm-up while gradients are large and change fast (default ``0``: none).
            Both rules depend only on the bucket's size and the iteration count, which are the
            same on every rank, so every rank takes the same path for each bucket. The exact
            path does not apply ``nonfinite`` (non-finite values are summed, as DDP's default).
        error_feedback: for the hooks of the flat block rows (``ring-int8``, ``ring-int4``,
            ``direct-int8``, ``direct-int4``...): each bucket keeps the residual of what this
            rank's quantizer rounded away (:class:`cerar.ErrorFeedback`, one per bucket index,
            4 bytes per parameter in all) and adds it to what it sends next step, so the error of
            the sum over steps stays bounded. A bucket's residual is dropped when its layout
            changes (DDP's rebuild after the first iteration) and at every re-synchronisation; it
            is saved and loaded with :meth:`state_dict`. Default ``False``. The hooks of other
            rows refuse a state with it at the first bucket. Whether it pays is measured per row in
            ``docs/results.md``.
        on_step: ``on_step(state, stats)``, called with the step's :class:`CommStats` when the
            last bucket of a backward pass completes. It runs on the communication thread, so
            keep it short; an exception in it fails that backward.

    Re-synchronisation needs the model, so it happens in :meth:`maybe_resync` (call it after
    ``optimizer.step()``) or automatically once :meth:`attach` has registered it as an optimizer
    step hook.

    Attributes (settings): ``process_group``, ``code``, ``nonfinite``, ``packet_dtype``, ``min_bucket_bytes``,
    ``start_iter``, ``resync_every``, ``divergence_tol``, ``on_step`` as given (``code`` resolved
    to the concrete default at the first bucket by :func:`cerar_hook`); ``world_size``: the
    group's size (``None`` until then).

    Attributes (internal buffers, keyed by bucket index): ``bucket_numel``, the last size seen
    for each bucket (a change, as when DDP rebuilds its buckets after the first iteration,
    resets that bucket's statistics); ``bucket_stats``, a :class:`CommStats` per bucket.

    Attributes (statistics of this rank):
        stats: totals over all buckets (measured bytes, rounds, encode/decode seconds, wall
            seconds inside the collective, fallbacks, non-finite events).
        last_step: the :class:`CommStats` of the latest completed backward pass (``None`` before).
        iteration: backward passes seen (counted at each step's last bucket).
        sparse_buckets: sparse gradient buckets averaged by ``torch.distributed.all_reduce``.
        exact_buckets, exact_bytes: dense buckets (and their buffers' bytes) that the bucket
            policy (``min_bucket_bytes``, ``start_iter``) sent to ``torch.distributed.all_reduce``;
            they are not in ``stats``, which counts what cerar's own transport measured.
        steps: optimizer steps seen by :meth:`maybe_resync`.
        resyncs, resync_s: re-synchronisations done and seconds spent in them.
        last_divergence, max_divergence: the latest and the largest divergence measured by the
            state (``None`` if never).

    Checkpoints: :meth:`state_dict` holds plain values only (it loads with
    ``torch.load(..., weights_only=True)``) and this rank's statistics: each rank saves and
    loads its own. The state also pickles, like ``PowerSGDState``, without its process groups
    and ``on_step``: unpickling sets ``process_group`` to the default group and creates the
    dedicated group on the first bucket, on every rank.

    The attributes are ``__slots__``, as ``PowerSGDState``'s: a misspelt setting
    (``state.resync_evry = 10``) raises AttributeError instead of being silently ignored.
    """

    __slots__ = (
        "_comm_group",
        "_lock",
        "_open_buckets",
        "_step",
        "_step_closing",
        "bucket_numel",
        "bucket_stats",
        "code",
        "divergence_tol",
        "error_feedback",
        "exact_buckets",
        "exact_bytes",
        "iteration",
        "last_divergence",
        "last_step",
        "max_divergence",
        "max_error",
        "min_bucket_bytes",
        "nonfinite",
        "on_step",
        "packet_dtype",
        "process_group",
        "residuals",
        "resync_every",
        "resync_s",
        "resyncs",
        "sparse_buckets",
        "start_iter",
        "stats",
        "steps",
        "world_size",
    )
    # Process groups and the lock cannot be pickled, ``on_step`` may not be, a step in flight is
    # nothing to restore (nor are the residuals, which hold locks: state_dict() saves those), and
    # the group's size is resolved again with the group.
    _NOT_PICKLED = (
        "process_group", "_comm_group", "_lock", "_open_buckets", "_step", "_step_closing", "on_step", "residuals",
    )  # fmt: skip
    _RESOLVED_AGAIN = ("world_size",)
    #: The record of one backward pass (``last_step``); :class:`cerar.comm.auto.ddp.AutoState`'s adds its buckets.
    _STEP_RECORD: type[CommStats] = CommStats
    #: What a state_dict of this class is called and which settings it holds (cerar.comm.ddp.checkpoint).
    _FORMAT = STATE_DICT_FORMAT
    _SETTINGS = SETTINGS
    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        code: Code | None = None,
        *,
        nonfinite: str = "exact",
        wire_dtype: torch.dtype | None = None,
        max_error: float | None = MAX_ERROR,
        min_bucket_bytes: int = DEFAULT_MIN_BUCKET_BYTES,
        start_iter: int = 0,
        resync_every: int | None = None,
        divergence_tol: float | None = None,
        on_step: Callable[["CerarState", CommStats], None] | None = None,
        packet_dtype: torch.dtype | None = None,
        error_feedback: bool = False,
    ) -> None:
        if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
            raise TypeError(
                f"Argument 'process_group' must be a ProcessGroup or None, not {type(process_group).__name__}."
            )
        if code is not None and not isinstance(code, Code):
            raise TypeError(f"Argument 'code' must be a cerar.Code or None, not {type(code).__name__}.")
        if on_step is not None and not callable(on_step):
            raise TypeError(f"Argument 'on_step' must be a callable or None, not {type(on_step).__name__}.")
        # Settings.
        self.process_group: dist.ProcessGroup | None = process_group
        self.code: Code | None = code
        self.world_size: int | None = None  # resolved at the first bucket
        self.nonfinite: str = check_choice("nonfinite", nonfinite, NONFINITE_POLICIES)
        # The attribute keeps the name a state_dict saves it under (format 3).
        self.packet_dtype: torch.dtype | None = check_packet_dtype(
            renamed("packet_dtype", packet_dtype, "wire_dtype", wire_dtype), "wire_dtype"
        )
        self.max_error: float | None = check_max_error(max_error)
        self.min_bucket_bytes: int = check_count("min_bucket_bytes", min_bucket_bytes)
        self.start_iter: int = check_count("start_iter", start_iter)
        self.resync_every: int | None = check_every("resync_every", resync_every)
        self.divergence_tol: float | None = check_tol("divergence_tol", divergence_tol)
        self.on_step = on_step
        self.error_feedback: bool = check_bool("error_feedback", error_feedback)
        # Internal buffers, keyed by bucket index.
        self.residuals: dict[int, tuple[str, ErrorFeedback]] = {}  # (the bucket's layout, its residual)
        self.bucket_numel: dict[int, int] = {}
        self.bucket_stats: dict[int, CommStats] = {}
        # Statistics.
        self.stats = CommStats()
        self.last_step: CommStats | None = None
        self.iteration = 0
        self.sparse_buckets = 0
        self.exact_buckets = 0
        self.exact_bytes = 0
        self.steps = 0
        self.resyncs = 0
        self.resync_s = 0.0
        self.last_divergence: float | None = None
        self.max_divergence: float | None = None
        self._comm_group: dist.ProcessGroup | None = None  # created at the first bucket
        self._new_step()

    # ----------------------------------------------------------------------------------------
    # Checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Settings and this rank's statistics, as plain values: ``torch.save`` it per rank, it
        loads with ``weights_only=True``. ``code`` is :meth:`cerar.Code.to_dict` (``None`` before
        the default is resolved); ``rank``, ``world_size``: the saving rank's (``None`` without a
        group). See :mod:`cerar.comm.ddp.checkpoint`."""
        with self._lock:
            size = self.world_size or _size(self.process_group)
            return to_state_dict(self, _rank(self.process_group), size, self._FORMAT, self._SETTINGS)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved, on the rank that saved it.

        The saved code must equal this state's (a state without a code adopts it); the saved
        ``rank`` and ``world_size`` must be this process's where both are known; the settings
        are taken from ``state_dict``. Errors name the bad key, and leave the state unchanged.
        """
        size = self.world_size or _size(self.process_group)
        values = from_state_dict(state_dict, self.code, _rank(self.process_group), size, self._FORMAT, self._SETTINGS)
        with self._lock:
            for name, value in values.items():
                setattr(self, name, value)

    def __getstate__(self) -> dict[str, Any]:
        """Everything but the process groups, ``on_step`` and a step in flight (a subclass's own
        attributes too: each class lists only its own ``__slots__``)."""
        name = type(self).__name__
        logger.warning("NOTE: process groups are not serialisable and are left out of the saved %s.", name)
        names = [name for cls in reversed(type(self).__mro__) for name in getattr(cls, "__slots__", ())]
        return {k: getattr(self, k) for k in names if k not in self._NOT_PICKLED + self._RESOLVED_AGAIN}

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Restore settings and statistics; the process group becomes the default group."""
        for key, value in state.items():
            setattr(self, key, value)
        self.process_group = None
        self.world_size = None
        self.on_step = None
        self._comm_group = None  # created on the first bucket (every rank runs it at the same point)
        self.residuals = {}  # a checkpoint's state_dict() keeps them; a pickle starts afresh
        self._new_step()
        logger.warning(
            "NOTE: CerarState's process group is set to the default group; set "
            "`state.process_group` (before the first bucket) if another group is desired."
        )

    # ----------------------------------------------------------------------------------------
    # Used by the hooks
    def exact_path(self, buffer: torch.Tensor) -> bool:
        """Whether the hooks send the dense bucket ``buffer`` to the exact all-reduce now: in the
        first ``start_iter`` backward passes, or when it holds fewer than ``min_bucket_bytes``
        bytes. Call it before the hook sees the bucket (the last bucket of a pass advances
        ``iteration``); every rank gets the same answer for the same bucket."""
        nbytes = buffer.numel() * buffer.element_size()
        return self.iteration < self.start_iter or nbytes < self.min_bucket_bytes

    # ----------------------------------------------------------------------------------------
    # The hook protocol: what a hook calls on its state for each bucket, in this order
    # (as PowerSGD's hook calls ``PowerSGDState.maybe_increase_iter``):
    #   group = state.resolve_group()               the hook's group, made once
    #   exact = state.exact_path(buffer)            the bucket policy, before bucket_started
    #   figures = state.note_bucket(index, numel)   the bucket's own statistics (coded buckets)
    #   state.bucket_started(bucket.is_last())      the step's bookkeeping
    #   state.bucket_done(call, figures)            once the bucket's future completes (or fails)
    # (hooks.launch_bucket makes the last two calls for every hook, auto's included).

    def resolve_group(self) -> dist.ProcessGroup:
        """The hook's group, created at the first bucket (the hook then checks the code, or
        defaults it by the route's one rule, :meth:`cerar.comm.collective.routes.Route.code_for`)."""
        if self._comm_group is None:
            require_initialised("CerarState")
            self.world_size = dist.get_world_size(self.process_group)
            self._comm_group = new_group_like(self.process_group)
        return self._comm_group

    @property
    def code_ranks(self) -> int | None:
        """The ranks the code is for: the group's (known from the first bucket)."""
        return self.world_size

    def call_settings(self) -> dict[str, Any]:
        """Every setting of the state's that a call takes, for each bucket: the route decides
        what applies to it (and refuses what does not)."""
        return {"code": self.code, "nonfinite": self.nonfinite, "wire_dtype": self.packet_dtype,
                "max_error": self.max_error}  # fmt: skip

    def feedback_for(self, index: int, layout: str) -> ErrorFeedback:
        """Bucket ``index``'s error-feedback store; a new one where the bucket's ``layout`` (the
        row and its parameters' shapes) changed, as when DDP rebuilds its buckets."""
        with self._lock:  # state_dict() may read the residuals from another thread
            held = self.residuals.get(index)
            if held is None or held[0] != layout:
                held = self.residuals[index] = (layout, ErrorFeedback())
            return held[1]

    @property
    def feedback_bytes(self) -> int:
        """Bytes the error-feedback residuals hold on this rank (4 per parameter once every bucket
        has run)."""
        return sum(store.nbytes for _, store in self.residuals.values())

    def after_resync(self) -> None:
        """The replicas were made equal again: every residual is dropped (it was this replica's)."""
        self.residuals.clear()

    def note_bucket(self, index: int, numel: int) -> CommStats:
        """The statistics kept for bucket ``index`` (started afresh when DDP's rebuilt buckets
        give the index another size)."""
        # DDP rebuilds its buckets after the first iteration: an index may now hold other
        # parameters, so figures kept under it start again.
        if self.bucket_numel.get(index) != numel:
            self.bucket_numel[index] = numel
            self.bucket_stats[index] = CommStats()
        return self.bucket_stats[index]

    def _new_step(self) -> None:
        # Buckets complete on the communication thread, sparse ones on Gloo's: hence the lock.
        self._lock = threading.Lock()
        self._open_buckets = 0
        self._step_closing = False
        self._step = self._STEP_RECORD()

    def bucket_started(self, last: bool) -> None:
        """A bucket was handed to the hook (``last``: the pass's last bucket, which advances
        ``iteration``)."""
        with self._lock:
            self._open_buckets += 1
            self._step_closing = self._step_closing or last
            if last:
                self.iteration += 1

    def bucket_done(self, call: CommStats | None, bucket_stats: CommStats | None) -> bool:
        """Count a finished bucket in; the step is over once its last bucket has started and
        every started bucket has finished (a sparse one may finish after a later dense one).
        Returns whether this bucket ended the step."""
        with self._lock:
            if call is not None and bucket_stats is not None:
                self.stats.add(call)
                bucket_stats.add(call)
                self._step.add(call)
            self._open_buckets -= 1
            if not (self._step_closing and self._open_buckets == 0):
                return False
            record, self._step, self._step_closing = self._step, self._STEP_RECORD(), False
            self.last_step = record
        if self.on_step is not None:
            self.on_step(self, record)
        return True

    def __repr__(self) -> str:
        return (
            f"CerarState({self.code!r}, nonfinite={self.nonfinite!r}, wire_dtype={self.packet_dtype}, "
            f"min_bucket_bytes={self.min_bucket_bytes}, "
            f"start_iter={self.start_iter}, resync_every={self.resync_every}, "
            f"divergence_tol={self.divergence_tol}, error_feedback={self.error_feedback}, "
            f"iteration={self.iteration}, resyncs={self.resyncs})"
        )


def _rank(process_group: dist.ProcessGroup | None) -> int | None:
    return dist.get_rank(process_group) if dist.is_available() and dist.is_initialized() else None


def _size(process_group: dist.ProcessGroup | None) -> int | None:
    return dist.get_world_size(process_group) if dist.is_available() and dist.is_initialized() else None
