"""DDP communication hooks that average gradients with CERAR or with the exact ring.

Register one on a :class:`torch.nn.parallel.DistributedDataParallel` model::

    >>> state = cerar.ddp.CerarState(code=cerar.codes.perturbed(4, 8), resync_every=100)
    >>> ddp_model.register_comm_hook(state, cerar.ddp.cerar_hook)  # or cerar.ddp.get_hook("cerar")
    >>> state.attach(ddp_model, optimizer)  # optional: automatic re-synchronisation

The state may be built before ``init_process_group`` (as ``PowerSGDState``; Lightning's
``DDPStrategy(ddp_comm_state=CerarState(), ...)`` does so): what needs the group is resolved at
the first bucket, which every rank reaches at the same point.

:func:`cerar_hook` hands every gradient bucket to :func:`cerar.all_reduce` with ``async_op=True``
and returns at once: the collective's single communication thread runs the buckets in the
order DDP launches them, which is the same on every rank, while the autograd thread carries on
with the rest of backward. DDP waits for the bucket futures only when backward's computation
is done, so communication overlaps computation as with DDP's own all-reduce. A sparse gradient
(``nn.Embedding(..., sparse=True)``), which DDP hands over alone in its bucket, is averaged by
``torch.distributed.all_reduce`` exactly as DDP's default does. So are, by the bucket policy of
:class:`CerarState`, buckets smaller than ``min_bucket_bytes`` (where CERAR's fixed cost per call
outweighs the bytes it saves) and every bucket of the first ``start_iter`` backward passes.

Results are **not bitwise identical across ranks**. CERAR's ranks decode slightly different
approximations of the sum (within the code's error bound, see :attr:`cerar.Code.error_bound`),
so the model replicas drift apart slowly. :func:`replica_divergence` measures the drift from a
shared random sketch, and :class:`CerarState` re-synchronises the parameters (a broadcast from
the group's rank 0) every ``resync_every`` steps or whenever the divergence exceeds
``divergence_tol``.

:func:`ring_hook` is the exact ring on the same transport, for comparison: the same thread, the
same point-to-point ops, ``2(N-1)/N`` values sent per value instead of CERAR's ``1 + (N-2)/c``.
"""

# No ``from __future__ import annotations`` here: DDP's register_comm_hook inspects the hooks'
# annotations and accepts only the real ``dist.GradBucket`` / ``Future[Tensor]`` objects.
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from cerar.comm.collective.policies import NONFINITE_POLICIES
from cerar.comm.collective.request import Settings
from cerar.comm.collective.routes import Route, get_route, start
from cerar.comm.ddp.checkpoint import STATE_DICT_FORMAT
from cerar.comm.ddp.hierarchical import HierarchicalState
from cerar.comm.ddp.replicas import SKETCH_SIZE, Replicas, replica_divergence, resync
from cerar.comm.ddp.state import DEFAULT_MIN_BUCKET_BYTES, CerarState
from cerar.comm.runtime.stats import CommStats
from cerar.comm.runtime.torch_groups import torch_all_reduce
from cerar.comm.runtime.work import chain, for_torch

__all__ = [
    "DEFAULT_MIN_BUCKET_BYTES",
    "NONFINITE_POLICIES",
    "SKETCH_SIZE",
    "STATE_DICT_FORMAT",
    "CerarState",
    "HierarchicalState",
    "Replicas",
    "cerar_hook",
    "hier_cerar_hook",
    "hier_ring_hook",
    "replica_divergence",
    "resync",
    "ring_hook",
    "route_hook",
]

#: What a hook's start gives :func:`launch_bucket`: the call's future, and what makes the bucket's
#: result of it once it completes.
Started = tuple[torch.futures.Future[Any], Callable[[torch.futures.Future[Any]], torch.Tensor]]


def cerar_hook(state: CerarState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average ``bucket`` over the state's group with CERAR, asynchronously; see the module doc.

    Returns at once with a future that completes with the averaged bucket (decoded by this rank,
    within the code's error bound of the exact mean). A bucket with NaN/Inf on some rank goes
    through the exact ring under ``nonfinite="exact"`` (the default) instead of failing; a sparse
    bucket, one below ``state.min_bucket_bytes`` and every bucket of the first
    ``state.start_iter`` passes are averaged by ``torch.distributed.all_reduce``, as DDP's
    default does.
    """
    return _launch(state, bucket, get_route("cerar"))


def ring_hook(state: CerarState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average ``bucket`` with the exact ring on cerar's transport (the comparison baseline).

    Same thread, same point-to-point ops and statistics as :func:`cerar_hook`; the result is the
    same on every rank. ``state.code`` and ``state.nonfinite`` are not used (the ring, like DDP's
    default, leaves non-finite values where they are). The bucket policy (``min_bucket_bytes``,
    ``start_iter``) applies as in :func:`cerar_hook`.
    """
    return _launch(state, bucket, get_route("ring"))


def hier_cerar_hook(state: HierarchicalState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average ``bucket`` with :func:`cerar.hierarchical_all_reduce`, asynchronously: exact inside
    each node, CERAR (``state.code``, for the group's ``M`` nodes) between nodes. The bucket
    policy and ``nonfinite`` work as in :func:`cerar_hook`; ``state`` must be a
    :class:`HierarchicalState`."""
    return _launch(state, bucket, get_route("hier-cerar"))


def hier_ring_hook(state: HierarchicalState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average ``bucket`` with :func:`cerar.hierarchical_ring_all_reduce` (the exact ring between
    nodes): the comparison baseline of :func:`hier_cerar_hook`."""
    return _launch(state, bucket, get_route("hier-ring"))


def route_hook(name: str) -> Any:
    """The hook that averages every bucket by the route table's row ``name`` (``"ring-fp16"``...):
    :func:`cerar_hook` and the others above for the families' own rows."""
    own = {"cerar": cerar_hook, "ring": ring_hook, "hier-cerar": hier_cerar_hook, "hier-ring": hier_ring_hook}
    if name in own:
        return own[name]
    route = get_route(name)

    def hook(state: CerarState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        return _launch(state, bucket, route)

    hook.__name__ = hook.__qualname__ = f"{name.replace('-', '_')}_hook"
    hook.__doc__ = f"Average each bucket by the route table's row {name!r}: {route.description}."
    return hook


def _launch(state: CerarState, bucket: dist.GradBucket, route: Route) -> torch.futures.Future[torch.Tensor]:
    """Submit one bucket by ``route`` (a sparse one, and one the bucket policy picks, to torch's
    all-reduce) and chain the bookkeeping after it."""
    if not isinstance(state, CerarState):
        raise TypeError(
            f"Argument 'state' of the cerar DDP hook must be a cerar.ddp.CerarState, not {type(state).__name__}: "
            "register it with ddp_model.register_comm_hook(CerarState(...), hook)."
        )
    if route.hierarchical and not isinstance(state, HierarchicalState):
        raise TypeError(
            f"Argument 'state' of the hierarchical DDP hooks must be a cerar.ddp.HierarchicalState, not "
            f"{type(state).__name__}: its code is for the number of nodes, and it knows ranks_per_node."
        )
    buffer = bucket.buffer()
    first = state.code_ranks is None  # known once the first bucket has made the group
    group = state.resolve_group()
    if route.coded and (first or state.code is None):
        # The given code checked, or the default by the one rule (kept for state_dict), at the
        # first bucket, even one the bucket policy sends to torch's all-reduce: a wrong code
        # raises at the first backward, not at the first bucket large enough.
        state.code = route.code_for(state.code_ranks, buffer.dtype, Settings(**route.applicable(state.call_settings())))
    if state.error_feedback and not route.takes_feedback:
        raise ValueError(
            f"Argument 'error_feedback' of the CerarState applies to the hooks of the flat block rows "
            f"(ring-int8, direct-int4...), not to the hook of {route.name!r}."
        )
    call = CommStats()
    sparse = buffer.layout != torch.strided
    exact = not sparse and state.exact_path(buffer)  # before the last bucket advances iteration
    bucket_stats = None if sparse or exact else state.note_bucket(bucket.index(), buffer.numel())

    def begin() -> Started:
        if sparse or exact:
            if sparse:
                state.sparse_buckets += 1
            else:
                state.exact_buckets += 1
                state.exact_bytes += buffer.numel() * buffer.element_size()
            return torch_all_reduce(buffer, state.process_group, average=True, async_op=True), _averaged
        settings = route.applicable(state.call_settings())
        if state.error_feedback:  # the bucket's residual, new where its parameters changed
            # A resumed run by another row, or DDP's rebuilt buckets, start a fresh residual.
            layout = route.name + ":" + ";".join("x".join(map(str, p.shape)) for p in bucket.parameters())
            settings["error_feedback"] = state.feedback_for(bucket.index(), layout)
        work = start(route, buffer, "avg", group, True, stats=call, **settings)
        assert work is not None
        return work.future, _averaged

    return launch_bucket(state, bucket, begin, figures=(call, bucket_stats))


def _averaged(done: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
    # wait() re-raises a failure with its own type (e.g. NonFiniteError under nonfinite="raise"),
    # which DDP then raises in backward.
    return done.wait()[0]


def launch_bucket(
    state: CerarState,
    bucket: dist.GradBucket,
    begin: Callable[[], Started],
    figures: tuple[CommStats | None, CommStats | None] = (None, None),
    step_ended: Callable[[], None] | None = None,
) -> torch.futures.Future[torch.Tensor]:
    """One bucket through the hook protocol (see :class:`CerarState`), as every hook sends it:
    counted as started, then ``begin()`` starts its call and says how to finish it; the bucket
    is counted as done if that raises, or once the finish has made the result. ``figures``: the
    call's and the bucket's :class:`CommStats`, added to the totals then; ``step_ended`` runs
    after the step's last bucket. Returns the future as DDP reads it."""
    state.bucket_started(bucket.is_last())
    try:
        future, finish = begin()
    except BaseException:
        state.bucket_done(None, None)
        raise

    def done(source: torch.futures.Future[Any]) -> torch.Tensor:
        try:
            return finish(source)
        finally:
            if state.bucket_done(*figures) and step_ended is not None:
                step_ended()

    buffer = bucket.buffer()
    # DDP's C++ reads the hook's future: its error as for_torch makes it (cerar.comm.runtime.work).
    return for_torch(chain(future, done, [buffer.device] if buffer.is_cuda else None))
