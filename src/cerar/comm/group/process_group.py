"""cerar as a ``torch.distributed.ProcessGroup``: :class:`CerarProcessGroup` runs CERAR (or another
method) for the all-reduces that are plainly gradient-sized float sums and hands every other call
to an exact group of the same ranks, unchanged.

A Python subclass of ``ProcessGroup`` receives what torch's C++ and Python callers ask of a group:
DDP's buckets (``allreduce``, SUM of a pre-divided bucket) and its start-up ``allgather`` and
``broadcast``s, FSDP2's HSDP all-reduce over the replicate dimension (AVG, or SUM), the
functional collectives, ``DeviceMesh``, ``dist.*``. Its routing, decided per call and the same on
every rank, since it depends on the call alone:

=====================================================  =========================================
all-reduce, SUM or AVG, floating dense tensors each    the group's method on cerar's transport
of at least ``min_bytes``, outside ``cerar.exact()``   (``cerar``, ``ring``, ``auto``, or the
                                                       hierarchical path with ``ranks_per_node``)
any other all-reduce (MAX, MIN, PRODUCT, PREMUL_SUM,   the exact group (bitwise what it gives)
integers, complex, sparse, small tensors)
every other collective, send/recv, barrier             the exact group, unchanged
=====================================================  =========================================

Every float SUM or AVG of dense tensors, coded or handed over, is agreed before its data moves:
the settings that decide its route (``cerar.exact()``, ``min_bytes``, the method, packet dtype,
code, ``max_error``, ``nonfinite``) travel in the call's handshake on cerar's transport (a
handed-over one's alone, on the communication thread, before the exact group's all-reduce), so
ranks that differ raise :class:`cerar.SettingsMismatchError` naming the setting, on every rank,
instead of one rank coding what another hands over. What the group hands over is issued on
cerar's communication thread, in the order of the calls, so ``wait(timeout=)`` is honoured while an
agreement waits on a stopped peer. Every all-reduce returns cerar's one
:class:`~cerar.comm.runtime.work.Work` (value: the tensors, reduced in place); its errors (a dead
peer, a mismatch, ``nonfinite="raise"``) reach ``wait()`` with their own type. Two groups are
made for it (:func:`cerar.comm.group.create.new_group`): ``exact`` for everything handed over,
``transport`` for cerar's own point-to-point messages, so that these never share a communicator
with the caller's collectives.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

import cerar.comm.auto.collective  # noqa: F401 (registers the auto row)
from cerar._checks import check_int
from cerar.coding.linear_code import MAX_ERROR, Code
from cerar.comm.collective.call import agree_call
from cerar.comm.collective.request import Settings
from cerar.comm.collective.routes import Route, get_route, route_for, start
from cerar.comm.ddp.state import DEFAULT_MIN_BUCKET_BYTES
from cerar.comm.group.in_order import issue_in_order
from cerar.comm.runtime.groups import ring_of
from cerar.comm.runtime.thread import COMM
from cerar.comm.runtime.work import Work, chain

__all__ = ["CerarProcessGroup", "GroupSettings", "RouteStats", "exact"]

_RED = dist.ReduceOp.RedOpType
_OP_NAMES = {_RED.SUM: "sum", _RED.AVG: "avg", _RED.MAX: "max", _RED.MIN: "min", _RED.PRODUCT: "product"}
_FAMILIES = ("cerar", "ring", "hier-cerar", "hier-ring")


@dataclass(frozen=True)
class GroupSettings:
    """What a :class:`CerarProcessGroup` codes and how, checked when built (see
    :func:`cerar.comm.group.create.new_group` for each setting). ``method`` is a row of the
    route table; the old form, a family (``"cerar"``, ``"ring"``) with a ``wire_dtype`` that a
    row fixes or with ``ranks_per_node``, is turned into that row with a ``DeprecationWarning``."""

    method: str = "cerar"
    code: Code | None = None
    wire_dtype: torch.dtype | None = None
    max_error: float | None = MAX_ERROR
    min_bytes: int = DEFAULT_MIN_BUCKET_BYTES
    nonfinite: str = "exact"
    ranks_per_node: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.method, str):
            raise TypeError(f"Argument 'method' must be a row of the route table (a str), not {self.method!r}.")
        check_int("min_bytes", self.min_bytes, minimum=0)
        row, packet = _row(self.method, self.wire_dtype, self.ranks_per_node)
        if row != self.method:
            warnings.warn(
                f"cerar.new_group(method={self.method!r}, wire_dtype={self.wire_dtype}, ranks_per_node="
                f"{self.ranks_per_node}) is deprecated: name the row, method={row!r}.",
                DeprecationWarning,
                stacklevel=4,
            )
            object.__setattr__(self, "method", row)
            object.__setattr__(self, "wire_dtype", packet)
        route = self.route
        route.check(self.call_settings())
        if route.family == "auto" and self.ranks_per_node is not None:
            raise ValueError(f"Argument 'ranks_per_node' does not apply to method 'auto', not {self.ranks_per_node}.")
        if route.hierarchical and self.ranks_per_node is None:
            raise ValueError(f"Argument 'ranks_per_node' must be given for method {self.method!r}, not None.")

    @property
    def route(self) -> Route:
        """The route table's row the coded all-reduces take."""
        return get_route(self.method)

    def call_settings(self, context: dict[str, Any] | None = None) -> Settings:
        """Every setting of the group's, for each coded call: the route decides what applies."""
        return Settings(
            code=self.code, nonfinite=self.nonfinite, wire_dtype=self.wire_dtype, max_error=self.max_error,
            ranks_per_node=self.ranks_per_node, context=context,
        )  # fmt: skip


def _row(method: str, wire_dtype: torch.dtype | None, ranks_per_node: int | None) -> tuple[str, torch.dtype | None]:
    """The row the old form names (a family, a packet dtype, ``ranks_per_node``), and the packet
    dtype left for it to take (None where the row fixes the wire)."""
    if method not in _FAMILIES:
        return method, wire_dtype
    family = method if ranks_per_node is None or method.startswith("hier-") else f"hier-{method}"
    if wire_dtype in (None, torch.float32, torch.float64):
        return family, wire_dtype
    row = route_for(family, wire_dtype)
    return row.name, None if row.wire is not None else wire_dtype


@dataclass
class RouteStats:
    """Calls, payload bytes and seconds by route (``"cerar"``: the group's method; ``"exact"``:
    the exact group) and by op (``"sum"``, ``"avg"``, ``"max"``, ..., or the collective's name).
    The wire bytes of the coded calls are the transport's (``cerar.collective.get_stats``)."""

    routes: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)
    last_done: float = 0.0  # time.perf_counter() of the latest all-reduce's completion
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, route: str, op: str, nbytes: int, seconds: float = 0.0, calls: int = 1) -> None:
        with self._lock:
            if seconds:
                self.last_done = max(self.last_done, time.perf_counter())
            entry = self.routes.setdefault(route, {}).setdefault(op, {"calls": 0, "bytes": 0, "seconds": 0.0})
            entry["calls"] += calls
            entry["bytes"] += nbytes
            entry["seconds"] += seconds

    def as_dict(self) -> dict[str, dict[str, dict[str, float]]]:
        with self._lock:
            return {route: {op: dict(v) for op, v in ops.items()} for route, ops in self.routes.items()}

    def reset(self) -> None:
        with self._lock:
            self.routes.clear()


_EXACT = threading.local()  # per thread: the groups (None: every group) under cerar.exact()


@contextlib.contextmanager
def exact(group: Any = None) -> Iterator[None]:
    """Send every all-reduce this thread makes on ``group`` (a :class:`CerarProcessGroup`; None:
    every one) to its exact group while inside: metrics and loss logging that must be bitwise the
    same on every rank. Per thread: FSDP2's hooks on autograd's thread keep their route."""
    if group is not None and not isinstance(group, CerarProcessGroup):
        raise TypeError(f"Argument 'group' must be a cerar process group or None, not {type(group).__name__}.")
    held: list[Any] = _EXACT.__dict__.setdefault("groups", [])
    held.append(group)
    try:
        yield
    finally:
        held.remove(group)


class CerarProcessGroup(dist.ProcessGroup):
    """A process group whose plainly gradient-sized float sums go by ``settings.method`` on
    ``transport`` and everything else to ``exact`` (see the module doc). ``stats``: a
    :class:`RouteStats`."""

    def __init__(
        self, exact: dist.ProcessGroup, transport: dist.ProcessGroup, settings: GroupSettings, rank: int, size: int
    ) -> None:
        super().__init__(rank, size)  # torch 2.13 takes (rank, size) only from a Python subclass
        self.exact, self.transport, self.settings = exact, transport, settings
        self.stats = RouteStats()
        self._name = self._desc = ""

    # -- what torch asks of every group (C++ reaches these names through pybind's trampoline)
    def getBackendName(self) -> str:
        return "cerar"

    def getGroupName(self) -> str:
        return self._name

    def setGroupName(self, name: str) -> None:
        self._name = name

    def getGroupDesc(self) -> str:
        return self._desc

    def setGroupDesc(self, desc: str) -> None:
        self._desc = desc

    def __repr__(self) -> str:
        return f"CerarProcessGroup(name={self._name!r}, rank={self.rank()}, size={self.size()}, {self.settings})"

    # -- all-reduce: coded or handed over
    def allreduce(self, tensors: Any, opts: Any = None) -> dist.Work:
        """``allreduce(tensors, opts)``, and torch's other overloads: ``allreduce(tensors, op)``,
        ``allreduce(tensor, op)``."""
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        opts = _options(dist.AllreduceOptions, opts)
        return self._allreduce(tensors, opts.reduceOp, lambda ts: self.exact.allreduce(ts, opts))

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        opts = _options(dist.AllreduceCoalescedOptions, opts)
        return self._allreduce(tensors, opts.reduceOp, lambda ts: self.exact.allreduce_coalesced(ts, opts))

    def _allreduce(
        self, tensors: list[torch.Tensor], op: Any, handed: Callable[[list[torch.Tensor]], dist.Work]
    ) -> dist.Work:
        name, started = _op_name(op), time.perf_counter()
        # One walk: a float sum of dense tensors is agreed (its route decided alike on every
        # rank), and coded if every tensor holds at least min_bytes, outside cerar.exact().
        dense = bool(tensors) and name in ("sum", "avg")
        large, nbytes = True, 0
        for t in tensors:
            size = t.numel() * t.element_size()
            nbytes += size
            dense = dense and t.layout == torch.strided and t.is_floating_point()
            large = large and size >= self.settings.min_bytes
        held = getattr(_EXACT, "groups", ())
        under_exact = None in held or self in held
        coded = dense and large and not under_exact
        route = "cerar" if coded else "exact"
        # Gloo sums a strided view wrongly and writes outside it: the exact group gets a contiguous
        # copy, written back (the coded route works on any layout itself).
        copies = tensors if coded else [_contiguous(t) for t in tensors]
        settings = self._deciding(under_exact, coded) if dense else None
        if coded:
            future = self._coded(tensors, name, settings).future
        else:
            agree: Callable[[], None] | None = None
            if settings is not None:  # agreed first: a rank that would code it raises, as this one does
                ring = ring_of(self.transport)
                assert ring is not None
                agree = functools.partial(agree_call, ring, settings, tensors[0].device, None)
            future = issue_in_order(functools.partial(handed, copies), tensors, self.transport, agree)
        stats = self.stats  # not the group: this runs on the exact group's thread (see chain)

        def timed(done: torch.futures.Future[Any]) -> Any:
            try:
                done.wait()  # re-raises the call's error with its own type
                for tensor, copy in zip(tensors, copies, strict=True):
                    if copy is not tensor:
                        tensor.copy_(copy)
                return tensors
            finally:
                stats.add(route, name, nbytes, time.perf_counter() - started)

        devices = sorted({t.device for t in tensors if t.is_cuda}, key=str)
        return Work(chain(future, timed, devices))

    def _deciding(self, under_exact: bool, coded: bool) -> dict[str, Any]:
        """The settings that decide how a float sum of dense tensors goes, which every rank must
        share (agreed in the call's handshake, the first that differs named on every rank)."""
        s = self.settings
        return {
            "cerar.exact()": under_exact, "min_bytes": s.min_bytes, "group method": s.method,
            "wire_dtype": str(s.wire_dtype), "code": None if s.code is None else s.code.fingerprint,
            "max_error": s.max_error, "nonfinite": s.nonfinite, "ranks_per_node": s.ranks_per_node,
            "route": "coded" if coded else "exact",
        }  # fmt: skip

    def _coded(self, tensors: list[torch.Tensor], op: str, settings: dict[str, Any] | None = None) -> Work:
        """Each tensor by the group's row of the route table, asynchronously, in place, its
        ``settings`` agreed in its handshake."""
        route, options = self.settings.route, self.settings.call_settings(settings)
        works = [start(route, t, op, self.transport, True, **vars(options)) for t in tensors]
        return Work.gather([w for w in works if w is not None], tensors)


def _options(kind: Any, opts: Any) -> Any:
    """An options object of ``kind`` from torch's overloads' ``opts``: None, the options, or a
    ``ReduceOp`` (``RedOpType``)."""
    if opts is None:
        return kind()
    if isinstance(opts, (dist.ReduceOp, _RED)):
        made = kind()
        made.reduceOp = opts if isinstance(opts, dist.ReduceOp) else dist.ReduceOp(opts)
        return made
    return opts


def _contiguous(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.layout != torch.strided or tensor.is_contiguous() else tensor.contiguous()


def _op_name(op: Any) -> str:
    kind = op.op if hasattr(op, "op") else op
    return _OP_NAMES.get(kind, str(kind).rsplit(".", 1)[-1].lower())


def _handed_over(name: str) -> Callable[..., Any]:
    """A collective of the exact group, as it is, counted by route, issued in order with cerar's
    calls (:func:`~cerar.comm.group.in_order.issue_in_order`; point-to-point calls at once);
    ``monitored_barrier``, which blocks and returns nothing, waits."""

    def method(self: CerarProcessGroup, *args: Any, **kwargs: Any) -> Any:
        tensors = [t for a in (*args, *kwargs.values()) for t in _tensors(a)]
        self.stats.add("exact", name, sum(t.numel() * t.element_size() for t in tensors))
        call = functools.partial(getattr(self.exact, name), *args, **kwargs)
        if name in _POINT_TO_POINT:  # paired by tag, not by order with the collectives: Gloo's own work
            return call()
        if name == "monitored_barrier":
            COMM.submit(call, torch.empty(0), False, self.transport)
            return None
        return Work(issue_in_order(call, tensors, self.transport))

    method.__name__ = name
    return method


#: Gloo pairs point-to-point calls by peer and tag, apart from the collectives' order; their
#: works carry what ``dist.recv`` reads back (``_source_rank``).
_POINT_TO_POINT = ("send", "recv", "recv_anysource")


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    return [t for v in value for t in _tensors(v)] if isinstance(value, list) else []


#: Every other collective torch's callers reach a Python group by (the trampoline's names, and
#: the ones ``dist.*`` looks up by name), handed to the exact group; the old names alias the new.
_HANDED = (
    "broadcast", "allgather", "all_gather_single", "all_gather_single_coalesced", "allgather_coalesced",
    "reduce_scatter", "reduce_scatter_single", "reduce_scatter_single_coalesced", "all_to_all_single", "alltoall",
    "barrier", "send", "recv", "recv_anysource", "gather", "scatter", "reduce", "monitored_barrier",
)  # fmt: skip
for _name in _HANDED:
    setattr(CerarProcessGroup, _name, _handed_over(_name))
# Under torch.compile dynamo sees a ProcessGroup as an opaque object and cannot trace a Python
# method that reads the group's attributes ("Member 'stats' is not registered for this opaque
# object type"): the methods run eagerly, at a graph break, as a C++ group's do.
for _name in (*_HANDED, "allreduce", "allreduce_coalesced"):
    setattr(CerarProcessGroup, _name, torch.compiler.disable(getattr(CerarProcessGroup, _name)))
CerarProcessGroup._allgather_base = CerarProcessGroup.all_gather_single  # type: ignore[attr-defined]
CerarProcessGroup._reduce_scatter_base = CerarProcessGroup.reduce_scatter_single  # type: ignore[attr-defined]
CerarProcessGroup.allgather_into_tensor_coalesced = CerarProcessGroup.all_gather_single_coalesced  # type: ignore[attr-defined]
CerarProcessGroup.reduce_scatter_tensor_coalesced = CerarProcessGroup.reduce_scatter_single_coalesced  # type: ignore[attr-defined]
