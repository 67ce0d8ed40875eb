"""Each training method's DDP communication hook, registered in :data:`HOOKS`, and how its
bytes are counted.

=============  ==========================================================  ==================
method         hook                                                        bytes
=============  ==========================================================  ==================
``allreduce``  torch's ``allreduce_hook`` (same result as DDP without a     computed
               hook; wrapped only to time it)
``fp16``       torch's ``fp16_compress_hook``                              computed
``bf16``       torch's ``bf16_compress_hook`` (Gloo supports bfloat16)     computed
``powersgd``   torch's ``powerSGD_hook``: rank ``r``, error feedback,      computed
               warm start, exact all-reduce for the first
               ``K`` steps (``powersgd:r:startK``, default
               :data:`POWERSGD_START`); one bucket at a time on
               one thread (see :class:`_SerialHook`)
``ring``       :func:`cerar.comm.ddp.hooks.ring_hook` (exact ring, cerar transport)    measured
``int8``       the 8-bit ring (int8 blocks, row ``ring-int8``; ``fp8``: float8 e4m3;   measured
               ``int4``, ``int3``, ``int2``: the 4-, 3- and 2-bit rings); ``direct-int8``,
               ``direct-int4``...: the direct reduce-scatter's rows; ``+ef`` after
               any of these (``int4+ef``, ``direct-int4+ef``): error feedback
``cerar``      :func:`cerar.comm.ddp.hooks.cerar_hook` with ``perturbed(N, c)``        measured
               (``cerar:c:fp16``/``:bf16``: 16-bit packets, ``optimized(N, c)``
               designed for that precision)
``auto``       :func:`cerar.comm.ddp.hooks.auto_hook`: each bucket by the fastest  measured (CERAR),
               of exact, fp16, CERAR float32 and 16-bit within the budget   computed (torch's)
               (``auto:1e-3``: ``max_error``), decided from measured steps
=============  ==========================================================  ==================

Communication-avoiding schedules wrap one of those (:mod:`cerar.experiments.train.periodic`,
the averaging itself in :mod:`cerar.experiments.train.averaging`); ``<m>`` is the method
underneath, ``allreduce`` when left out:

=====================  ==================================================  ==================
schedule               what runs                                           bytes
=====================  ==================================================  ==================
``accum:K[:<m>]``      ``K`` micro-batches of ``batch_size / K``           as ``<m>``
                       sequences, ``model.no_sync()`` for the first
                       ``K - 1``, ``<m>``'s hook on the last: the same
                       tokens per optimizer step as every other method
                       (``batch_size`` must divide by ``K``)
``localsgd:H[:<m>]``   torch's ``post_localSGD_hook`` (DDP's all-reduce    computed (warm-up,
                       each step for ``warmup_steps``, then no gradient    ring formula) +
                       sync) and, after every optimizer step, parameter    ``<m>``'s for the
                       averaging every ``H`` steps from ``warmup_steps``   averages
                       on: exact: torch's ``PostLocalSGDOptimizer`` +
                       ``PeriodicModelAverager``; through another
                       ``<m>``: cerar's own averager with the same
                       schedule, averaging the change since the last
                       average (see ``periodic``)
``diloco:H[:<m>]``     no gradient sync (torch's ``noop_hook``); inner     ``<m>``'s for the
                       AdamW for ``H`` steps, then the pseudo-gradient     averages
                       ``theta_start - theta`` averaged through ``<m>``,
                       outer SGD with Nesterov momentum
                       (``--outer-lr``, ``--outer-momentum``)
=====================  ==================================================  ==================

``localsgd`` and ``diloco`` average through ``allreduce``, ``fp16``, ``bf16``, ``ring`` or
``cerar[:c][:fp16|:bf16]``, once over the whole model (``accum`` takes any method above).

"Measured" bytes are those handed to point-to-point sends (:class:`cerar.comm.runtime.stats.CommStats`);
buckets that ``ring``/``cerar``'s bucket policy (``min_bucket_mb``) sends to Gloo's all-reduce
add their computed bytes.
Gloo's built-in collectives cannot be observed at that level, so their bytes are **computed**
from the bucket sizes with the ring formula, ``2(N-1)/N x elements x bytes per element`` per
all-reduce (PowerSGD: of the uncompressed tensors and its P and Q factors); reports label them.

The names in :data:`HOOKS` are the ones :class:`~cerar.experiments.train.config.TrainConfig`
accepts, so this module imports no config (and loads torch only when a hook is installed: the
config, and ``cerar train --help``, load without it).

``--methods`` also takes the route table's row names (:mod:`cerar.comm.collective.routes`),
:data:`ROW_NAMES`: ``exact`` is ``allreduce``, ``torch-fp16`` is ``fp16``, ``ring-int8`` is
``int8``, ``cerar-fp16:8`` is ``cerar:8:fp16``... (:func:`resolve`). A run is named by its
method here (``allreduce-s0``, ``int8-s0``) whichever spelling was typed, so the results of old
runs and new ones read alike.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cerar.experiments.train.installed import ROWS, Build, Count, HookSettings, InstalledHook, cerar_code, ring_bytes

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from cerar.experiments.train.timeline import Timeline

__all__ = ["HOOKS", "POWERSGD_START", "ROW_NAMES", "Hook", "install", "method_names", "resolve"]

POWERSGD_START = 10  # PowerSGD's exact warm-up steps (torch's default, 1000, is for long runs)


@dataclass(frozen=True)
class Hook:
    """One training method: its name in ``--methods`` and how to build its hook.

    Attributes:
        name: the method name (``"cerar"``, ``"powersgd"``...), what the config accepts.
        usage: how ``--methods`` writes it (``"cerar[:c|:kN]"``).
        build: makes the hook for a config and ``N`` (see :data:`Build`).
        parameter: the config field ``name:x`` sets (``None``: the method takes none).
        per_rank: ``name:kN`` means ``k x N``, and the plain name means ``2N``.
        hierarchical: exact inside each node, the method only between the ``M`` nodes
            (``N`` in ``kN`` is then ``M``); the node layout comes from the launcher
            (``CERAR_RANKS_PER_NODE``, else torchrun's ``LOCAL_WORLD_SIZE``).
    """

    name: str
    usage: str
    build: Build
    parameter: str | None = None
    per_rank: bool = False
    hierarchical: bool = False


def install(config: HookSettings, model: DistributedDataParallel, timeline: Timeline) -> InstalledHook:
    """Register ``config.method``'s hook (wrapped by :func:`timed_hook`) on ``model`` (a schedule's
    config goes to :func:`cerar.experiments.train.periodic.install_schedule`, which calls this for
    ``accum``)."""
    import torch.distributed as dist

    from cerar.experiments.train.timeline import TimedState, timed_hook

    installed, hook, state, count = HOOKS[config.method].build(config, dist.get_world_size())
    model.register_comm_hook(TimedState(hook, state, timeline, count), timed_hook)
    return installed


def _build_cerar_or_ring(config: HookSettings, world_size: int) -> tuple[InstalledHook, Any, Any, Count]:
    """``cerar`` (``perturbed(N, c)`` for float32 packets, ``optimized(N, c)`` designed for the
    precision of 16-bit ones) or ``ring`` (the exact ring on the same transport)."""
    import torch

    from cerar.comm.collective.routes import get_route
    from cerar.comm.ddp.hooks import CerarState, route_hook
    from cerar.comm.runtime.dtypes import DTYPES

    coded = config.method == "cerar"
    route = get_route(ROWS[config.method])
    components = config.components if config.components is not None else 2 * world_size
    precision = config.packet or "fp32"
    code = cerar_code(world_size, components, precision) if coded else None
    state = CerarState(
        code=code,
        nonfinite=config.nonfinite,
        wire_dtype=None if precision == "fp32" else DTYPES[precision],  # None: the data's own (float32)
        min_bucket_bytes=round(config.min_bucket_mb * 2**20),  # MB as DDP's bucket_cap_mb: MiB
        resync_every=config.resync_every,
        divergence_tol=config.divergence_tol,
        max_error=None,  # training measures its quality by the loss; the 4-bit ring predicts 0.19
        error_feedback=config.error_feedback,
    )
    if coded:
        packets = "" if precision == "fp32" else f", {precision} packets"
        installed = InstalledHook("cerar", True, f"cerar_hook{packets}, {state.code!r}", state=state)
        installed.extra = {
            "components": components,
            "code": repr(state.code),
            "comm_rate": state.code.comm_rate,
            "ring_comm_rate": state.code.ring_comm_rate,
            "packet": precision,
            "predicted_worst_error": state.code.predicted_worst_error(precision),
        }
    elif config.method == "ring":
        installed = InstalledHook("ring", True, "ring_hook (exact ring, cerar transport)", state=state)
    else:  # the block-quantized rings
        feedback = ", error feedback" if config.error_feedback else ""
        installed = InstalledHook(config.method, True, f"{route.name} hook{feedback}: {route.description}", state=state)
        installed.extra = {"wire": route.wire, "predicted_worst_error": route.error_bound(world_size),
                           "error_feedback": config.error_feedback}  # fmt: skip

    def count(bucket: dist.GradBucket) -> None:
        buffer = bucket.buffer()
        if buffer.layout == torch.strided and state.exact_path(buffer):  # asked before the hook runs
            installed.bytes_computed += ring_bytes(world_size, buffer.numel(), buffer.element_size())
            installed.collectives += 1  # Gloo's all-reduce
        else:
            installed.collectives += 1  # the ring (its handshake rides on the same point-to-point links)

    return installed, route_hook(route.name), state, count


def _build_auto(config: HookSettings, world_size: int) -> tuple[InstalledHook, Any, Any, Count]:
    """``auto``: :class:`cerar.comm.ddp.hooks.AutoState` with the budget ``max_error`` (default the
    library's, 0.1); the decisions and the last step's buckets go to the run's ``method_info``."""
    from cerar.coding.linear_code import MAX_ERROR
    from cerar.comm.auto.ddp import AutoState, auto_hook

    budget = MAX_ERROR if config.max_error is None else config.max_error
    installed = InstalledHook("auto", True, f"auto_hook (max_error {budget:g})")

    def on_step(state: Any, record: Any) -> None:
        # The description says where the buckets went; the extra keeps every decision.
        methods = [b.method for b in record.buckets]
        counts = ", ".join(f"{m} x{methods.count(m)}" for m in dict.fromkeys(methods))
        installed.description = f"auto_hook (max_error {budget:g}): {counts}"
        installed.extra.update(last_step=record.describe(), plan=state.plan, decisions=state.decisions)

    state = AutoState(
        max_error=budget,
        nonfinite=config.nonfinite,
        resync_every=config.resync_every,
        divergence_tol=config.divergence_tol,
        on_step=on_step,
    )
    installed.state = state
    installed.extra = {"max_error": budget, "plan": [], "decisions": [], "last_step": []}

    def count(bucket: dist.GradBucket) -> None:
        installed.collectives += 1  # bytes: the transport's (CERAR) and state.torch_bytes (torch's)

    return installed, auto_hook, state, count


def _build_hierarchical(config: HookSettings, world_size: int) -> tuple[InstalledHook, Any, Any, Count]:
    """``hier-cerar`` (``perturbed(M, c)`` between the ``M`` nodes) or ``hier-ring`` (the exact
    ring between nodes), exact inside each node (:mod:`cerar.comm.collective.hierarchical`)."""
    import os

    from cerar.coding import codes
    from cerar.comm.ddp.hooks import HierarchicalState, hier_cerar_hook, hier_ring_hook

    coded = config.method == "hier-cerar"
    text = os.environ.get("CERAR_RANKS_PER_NODE") or os.environ.get("LOCAL_WORLD_SIZE") or "1"
    per_node = int(text)
    nodes = world_size // per_node
    components = config.components if config.components is not None else 2 * nodes
    state = HierarchicalState(
        code=codes.perturbed(nodes, components) if coded and nodes > 1 else None,
        ranks_per_node=per_node,
        nonfinite=config.nonfinite,
        min_bucket_bytes=round(config.min_bucket_mb * 2**20),
        resync_every=config.resync_every,
        divergence_tol=config.divergence_tol,
    )
    layout = f"{nodes} nodes x {per_node} ranks"
    if coded:
        installed = InstalledHook("hier-cerar", True, f"hier_cerar_hook ({layout}), {state.code!r}", state=state)
        installed.extra = {"components": components, "nodes": nodes, "ranks_per_node": per_node}
    else:
        description = f"hier_ring_hook ({layout}, exact ring between nodes)"
        installed = InstalledHook("hier-ring", True, description, state=state)
        installed.extra = {"nodes": nodes, "ranks_per_node": per_node}

    def count(bucket: dist.GradBucket) -> None:
        installed.collectives += 1  # bytes: the transport's, between nodes only

    return installed, hier_cerar_hook if coded else hier_ring_hook, state, count


def _build_powersgd(config: HookSettings, world_size: int) -> tuple[InstalledHook, Any, Any, Count]:
    """torch's PowerSGD, run one bucket at a time (:class:`_SerialHook`), bytes computed."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    state = powerSGD_hook.PowerSGDState(
        process_group=None,
        matrix_approximation_rank=config.powersgd_rank,
        start_powerSGD_iter=config.powersgd_start,
        use_error_feedback=True,
        warm_start=True,
        random_seed=config.seed,
    )
    description = (
        f"powerSGD_hook, rank {config.powersgd_rank}, error feedback, warm start, exact for the first "
        f"{config.powersgd_start} steps"
    )
    installed = InstalledHook("powersgd", False, description, state=state)
    installed.extra = {"powersgd_rank": config.powersgd_rank, "start_iter": config.powersgd_start}

    def count_powersgd(bucket: dist.GradBucket) -> None:
        buffer = bucket.buffer()
        if state.iter < state.start_powerSGD_iter:
            installed.bytes_computed += ring_bytes(world_size, buffer.numel(), buffer.element_size())
            installed.collectives += 1
            return
        elements = 0
        for tensor in bucket.gradients():
            n = tensor.shape[0]
            m = tensor.numel() // max(n, 1)
            rank = min(n, m, state.matrix_approximation_rank)
            compressed = (n + m) * rank
            elements += compressed if compressed * state.min_compression_rate < n * m else n * m
        installed.bytes_computed += ring_bytes(world_size, elements, buffer.element_size())
        installed.collectives += 3  # uncompressed tensors, then P, then Q

    # Bytes are counted on the serial thread, right before each bucket's hook, where
    # ``state.iter`` is current; the timed wrapper's own count does nothing.
    return installed, _SerialHook(powerSGD_hook.powerSGD_hook, count_powersgd), state, _nothing


def _builtin(hook_name: str, wire_size: int, description: str) -> Build:
    """A torch default hook (``default_hooks.<hook_name>``) on the default process group, whose
    ``wire_size``-byte values are counted with the ring formula."""

    def build(config: HookSettings, world_size: int) -> tuple[InstalledHook, Any, Any, Count]:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        installed = InstalledHook(config.method, False, description)

        def count(bucket: dist.GradBucket) -> None:
            installed.bytes_computed += ring_bytes(world_size, bucket.buffer().numel(), wire_size)
            installed.collectives += 1

        return installed, getattr(default_hooks, hook_name), None, count

    return build


def _nothing(bucket: dist.GradBucket) -> None:
    return None


#: The training methods, in the order the config lists them.
HOOKS: dict[str, Hook] = {
    hook.name: hook
    for hook in (
        Hook("allreduce", "allreduce", _builtin("allreduce_hook", 4, "allreduce_hook (= DDP's default)")),
        Hook("ring", "ring", _build_cerar_or_ring),
        Hook("int8", "int8", _build_cerar_or_ring),
        Hook("fp8", "fp8", _build_cerar_or_ring),
        Hook("int4", "int4", _build_cerar_or_ring),
        Hook("int3", "int3", _build_cerar_or_ring),
        Hook("int2", "int2", _build_cerar_or_ring),
        *(Hook(f"direct-{w}", f"direct-{w}", _build_cerar_or_ring) for w in ("int8", "int4", "int3", "int2")),
        Hook("cerar", "cerar[:c|:kN][:fp16|:bf16]", _build_cerar_or_ring, parameter="components", per_rank=True),
        Hook("auto", "auto[:max_error]", _build_auto, parameter="max_error"),
        Hook("hier-ring", "hier-ring", _build_hierarchical, hierarchical=True),
        Hook(
            "hier-cerar", "hier-cerar[:c|:kM]", _build_hierarchical, parameter="components", per_rank=True,
            hierarchical=True,
        ),
        Hook("fp16", "fp16", _builtin("fp16_compress_hook", 2, "fp16_compress_hook")),
        Hook("bf16", "bf16", _builtin("bf16_compress_hook", 2, "bf16_compress_hook")),
        Hook("powersgd", "powersgd[:r[:startK]]", _build_powersgd, parameter="powersgd_rank"),
    )
}


class _SerialHook:
    """Run a hook's whole chain for one bucket at a time, in bucket order, on one thread.

    torch's ``powerSGD_hook`` issues its second and third all-reduces from ``.then`` callbacks,
    which Gloo runs on its own threads; with several buckets in flight, ranks can then issue
    collectives on the same group in different orders. Here that crashed a run with Gloo's
    "Received data size doesn't match expected size" (a collective mismatch). One thread
    that finishes bucket ``k`` before starting bucket ``k+1`` gives every rank the same order
    and still overlaps communication with the rest of backward.
    """

    def __init__(
        self,
        hook: Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]],
        before: Callable[[dist.GradBucket], None],
    ) -> None:
        import torch

        self._future = torch.futures.Future
        self._hook = hook
        self._before = before
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cerar-serial-hook")

    def __call__(self, state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        result: torch.futures.Future[torch.Tensor] = self._future()

        def run_bucket() -> None:
            try:
                self._before(bucket)
                result.set_result(self._hook(state, bucket).wait())
            except BaseException as exc:  # surfaced to DDP through the future
                result.set_exception(exc)

        self._executor.submit(run_bucket)
        return result


#: ``--methods``' one vocabulary: each route-table row (:mod:`cerar.comm.collective.routes`) a
#: training method runs, and the method it is here: ``(with a DDP hook or a schedule, under a
#: process group)``, each ``"name"`` or ``"name:packet"`` (``cerar-fp16`` is ``cerar`` with
#: ``packet="fp16"``), None where that row is not offered. The methods' own names (the keys of
#: :data:`HOOKS`) stay accepted, as aliases, with their meanings of before: ``fp16`` is torch's
#: ``fp16_compress_hook`` (the row ``torch-fp16``) as a hook and in a schedule's averages, but
#: cerar's 16-bit ring (``ring-fp16``) under ``group:``/``hsdp:``. Runs, labels and results keep
#: the method's own name (the alias), whichever was typed.
ROW_NAMES: dict[str, tuple[str | None, str | None]] = {
    "exact": ("allreduce", "allreduce"),
    "torch-fp16": ("fp16", None),
    "torch-bf16": ("bf16", None),
    "ring": ("ring", "ring"),
    "ring-fp16": (None, "fp16"),
    "ring-int8": ("int8", "int8"),
    "ring-fp8": ("fp8", "fp8"),
    "ring-int4": ("int4", "int4"),
    "ring-int3": ("int3", "int3"),
    "ring-int2": ("int2", "int2"),
    **{f"direct-{w}": (f"direct-{w}", f"direct-{w}") for w in ("int8", "int4", "int3", "int2")},
    "cerar": ("cerar", "cerar"),
    "cerar-fp16": ("cerar:fp16", "cerar:fp16"),
    "cerar-bf16": ("cerar:bf16", "cerar:bf16"),
    "hier-ring": ("hier-ring", None),
    "hier-cerar": ("hier-cerar", None),
    "auto": ("auto", "auto"),
}  # fmt: skip
_GROUPED = 1  # ROW_NAMES' column under a process group


def resolve(name: str, grouped: bool = False) -> tuple[str, str | None]:
    """The training method (a key of :data:`HOOKS`) and the packet precision (or None) that the
    name ``name`` means in ``--methods``: a method's own name as it is, a row's name by
    :data:`ROW_NAMES` (``grouped``: under ``group:``/``hsdp:``). Anything else raises
    ``ValueError`` naming the argument, the value and the names accepted there."""
    if name in HOOKS:
        return name, None
    meaning = ROW_NAMES[name][_GROUPED if grouped else 0] if name in ROW_NAMES else None
    if meaning is None:
        where = "of group and hsdp " if grouped else ""
        elsewhere = ROW_NAMES.get(name, (None, None))[0 if grouped else _GROUPED]
        hint = "" if elsewhere is None else " (not under group:/hsdp:)" if grouped else " (under group:/hsdp: only)"
        raise ValueError(f"Argument 'method' {where}must be one of {method_names(grouped)}, not {name!r}{hint}.")
    method, _, packet = meaning.partition(":")
    return method, packet or None


def method_names(grouped: bool = False) -> str:
    """The names ``--methods`` accepts (``grouped``: under ``group:``/``hsdp:``), each row's with
    the method's own name it is an alias of: ``exact (= allreduce), torch-fp16 (= fp16), ...``."""
    names = []
    for row, meanings in ROW_NAMES.items():
        meaning = meanings[_GROUPED if grouped else 0]
        if meaning is None:
            continue
        method, _, packet = meaning.partition(":")
        alias = f"{method}:2N:{packet}" if packet else method
        names.append(row if alias == row else f"{row} (= {alias})")
    if not grouped:
        names += [name for name in HOOKS if name not in {m.partition(":")[0] for m, _ in ROW_NAMES.values() if m}]
    return ", ".join(names)
