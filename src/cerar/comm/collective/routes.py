"""The route table: every way cerar all-reduces, one row each (:data:`ROUTES`), and the one way a
call of a row starts (:func:`start`).

A row names the method, says how one call of it runs, how many bytes it sends per value and what
worst-rank relative error it predicts for a world size, and whether it is exact. Every way in
looks methods up here: ``cerar.all_reduce(method=)``, ``cerar.ring_all_reduce``, the
hierarchical collectives, cerar's process group, the DDP hooks (``cerar.ddp.get_hook``),
``method="auto"``'s candidates (auto adds its own row from above: it chooses among these),
``cerar bench --methods`` and ``cerar train --methods``. Adding a method is a row and its start.

==============  =====================================================  =========  ======================
row             one call                                               identical  values sent per value
==============  =====================================================  =========  ======================
``exact``       ``torch.distributed.all_reduce`` on the caller's group yes, exact ``2(N-1)/N``
``torch-fp16``  torch's ``fp16_compress_hook`` as a call: a float16    yes        ``2(N-1)/N``, 2 bytes
                cast, torch's all-reduce (``torch-bf16``: bfloat16)
``ring``        cerar's ring on its transport, the data's own dtype    yes, exact ``2(N-1)/N``
``ring-fp16``   the ring sending float16 (power-of-two scaled),        yes        ``2(N-1)/N``, 2 bytes
                float32 sums (``ring-bf16``: bfloat16)
``ring-int8``   the ring sending int8 in blocks with one scale each,    yes        ``2(N-1)/N``, 1 byte +
                requantized at every hop (``ring-fp8``: float8 e4m3;              the block's scale
                ``ring-int4``: 4-bit codes two a byte; ``ring-int3``,             (int4: half a byte)
                ``ring-int2``: 3 and 2 bits)
``direct-int8`` each rank's chunk straight to its owner, quantized once, yes        as ``ring-int8``
                the owner's float32 sum quantized once, to every rank
                (``direct-fp8``, ``direct-int4``, ``direct-int3``...)
``cerar``       CERAR, float32 (float64) packets                       no         ``1 + (N-2)/c``
``cerar-fp16``  CERAR, float16 packets (``cerar-bf16``: bfloat16)      no         ``1 + (N-2)/c``, 2 bytes
``hier-ring``   exact inside each node, the ring between the M nodes   yes, exact ``2(M-1)/M`` between
                (``hier-ring-int8``... : in that wire)
``hier-cerar``  exact inside each node, CERAR between the M nodes      no         ``1 + (M-2)/c`` between
``auto``        the fastest row within ``max_error`` (:mod:`cerar.comm.auto.collective`)
==============  =====================================================  =========  ======================

"identical": every rank ends with bitwise the same values; "exact": and they are the sum up to
float32 rounding. The predicted errors: a ring whose wire rounds to within ``u`` of each value
sent (a partial sum of ``k`` of the ``N`` inputs at hop ``k``, and the whole sum once more for the
all-gather) errs by at most ``u sqrt((N+1)/2)`` relative, for i.i.d. inputs; the block rings
(int8, fp8, int4, int3, int2; ring and direct shapes) by :func:`cerar.coding.blocks.ring_error_bound`,
relative to the root-sum-square of the ranks' inputs (the sum's norm for independent inputs;
where inputs cancel, the sum is smaller and the error relative to it larger); CERAR by its code's
:meth:`cerar.Code.predicted_worst_error` at the packet precision. No row's start imports above
this layer.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.distributed as dist

from cerar._checks import check_bool, check_choice, check_int
from cerar.coding.blocks import ring_error_bound
from cerar.coding.linear_code import Code, check_max_error
from cerar.coding.precision import UNIT_ROUNDOFF, precision_name
from cerar.comm.algorithms.ring.feedback import ErrorFeedback
from cerar.comm.algorithms.ring.wires import OWN, WIRES, BlockWire, FloatWire, Wire
from cerar.comm.collective.call import agree_call, cerar_call, ring_call
from cerar.comm.collective.checks import check_op, check_packet_dtype, check_stats, check_tensor
from cerar.comm.collective.default_code import check_usable, code_within, default_code, working_dtype
from cerar.comm.collective.hierarchical import hierarchical_call
from cerar.comm.collective.policies import NONFINITE_POLICIES
from cerar.comm.collective.request import Request, Settings
from cerar.comm.runtime.dtypes import dtype_name
from cerar.comm.runtime.groups import ring_of
from cerar.comm.runtime.nodes import prepare_nodes
from cerar.comm.runtime.thread import COMM
from cerar.comm.runtime.torch_groups import torch_all_reduce
from cerar.comm.runtime.work import Work, forward

__all__ = ["ROUTES", "Call", "Request", "Route", "Settings", "get_route", "register_route", "route_for", "start"]

#: Bytes per value of each wire (the block wires with their blocks' scales).
WIRE_BYTES = {"fp64": 8.0, "fp32": 4.0, "fp16": 2.0, "bf16": 2.0}
WIRE_BYTES.update({name: w.fmt.bytes_per_value for name, w in WIRES.items() if isinstance(w, BlockWire)})
#: The block wires' names (int8, fp8, int4, int3, int2), each a ``ring-``, a ``direct-`` and a
#: ``hier-ring-`` row (the 3- and 2-bit ones did not train like allreduce: docs/results.md).
BLOCK_WIRES = tuple(name for name, w in WIRES.items() if isinstance(w, BlockWire))


Start = Callable[["Route", Request], "Work | None"]


def _ring_values(n: int, c: int | None) -> float:
    return 2.0 * (n - 1) / n if n > 1 else 0.0


def _cerar_values(n: int, c: int | None) -> float:
    return (c + n - 2) / c if c else _ring_values(n, None)


@dataclass(frozen=True)
class Route:
    """One way to all-reduce (a row of :data:`ROUTES`).

    Attributes:
        name: the method's name (``"cerar-fp16"``, ``"ring-int8"``).
        family: ``"cerar"``, ``"ring"``, ``"direct"``, ``"hier-cerar"``, ``"hier-ring"``, ``"exact"``,
            ``"torch"`` or ``"auto"``.
        wire: the wire's name, fixed by the row (``"fp16"``, ``"int8"``...), or None: the data's
            own (float32, or float64 for float64 tensors; ``packet_dtype`` float32 or float64
            may choose).
        start: how one call starts: ``start(route, request)`` returns a :class:`Work` with
            ``async_op``, else None once done (None too on ranks outside the group).
        values: values each rank sends per value reduced, ``values(n, c)`` for the ring it runs
            on (``n``: ranks, or nodes for a hierarchical row; ``c``: CERAR's components).
        coded: takes a :class:`cerar.Code` (CERAR).
        identical: every rank ends with bitwise the same values.
        exact_sum: identical, and the sum up to float32 rounding.
        hierarchical: exact inside each node; ``values``, the code and the error are for the nodes.
        transport: ``"cerar"`` (its point-to-point ring and handshake) or ``"torch"``.
        description: one line for ``--help`` and the docs.
    """

    name: str
    family: str
    wire: str | None
    start: Start
    values: Callable[[int, int | None], float] = _ring_values
    coded: bool = False
    identical: bool = True
    exact_sum: bool = False
    hierarchical: bool = False
    transport: str = "cerar"
    description: str = ""

    @property
    def takes_feedback(self) -> bool:
        """Whether the row takes ``error_feedback``: the flat rows of a block wire."""
        return self.wire in BLOCK_WIRES and not self.hierarchical

    @property
    def wire_dtype(self) -> torch.dtype | None:
        """The wire's torch dtype where the row fixes a narrower float one, else None."""
        return getattr(WIRES.get(self.wire or ""), "dtype", None)

    def precision(self, data: torch.dtype = torch.float32) -> str:
        """The precision on the wire for ``data`` tensors (``"fp32"``, ``"fp16"``, ``"int8"``...)."""
        return self.wire or precision_name(working_dtype(data))

    def bytes_per_value(self, world_size: int, components: int | None = None, data_bytes: float = 4.0) -> float:
        """Bytes each rank sends per value reduced (a hierarchical row: per value between nodes,
        for ``world_size`` nodes); ``data_bytes``: the data's own width, for rows of no fixed wire."""
        width = WIRE_BYTES[self.wire] if self.wire in WIRE_BYTES else data_bytes
        return self.values(world_size, components) * width

    def error_bound(self, world_size: int, code: Code | None = None) -> float:
        """The predicted worst-rank relative error (see the module doc): CERAR's code's (the
        default code's for ``world_size`` if none), a block wire's ring's
        (:func:`cerar.coding.blocks.ring_error_bound`), a float ring's ``u sqrt((N+1)/2)``."""
        wire = WIRES.get(self.wire or "")
        if isinstance(wire, BlockWire):
            return ring_error_bound(world_size, fmt=wire.fmt, shape="direct" if self.family == "direct" else "ring")
        precision = self.precision()
        if self.coded and world_size > 2:
            code = code if code is not None else default_code(world_size, precision)
            return code.predicted_worst_error(precision)
        return UNIT_ROUNDOFF[precision] * math.sqrt((world_size + 1) / 2)

    def code_for(self, ranks: int, data: torch.dtype, settings: Settings) -> Code | None:
        """The one rule for the code of a CERAR row on ``ranks`` ranks (nodes for the hierarchical
        row): the given code, checked for ``ranks`` and against ``max_error`` at the packet
        precision, or :func:`cerar.comm.collective.default_code.code_within`'s (the default code, or one
        with fewer components where ``max_error`` asks for less, or refused with the figures).
        None for a row that takes no code or a ring of one rank. The process group, the DDP
        hooks, ``method="auto"`` and every call ask here."""
        if not self.coded or ranks < 2:
            return None
        precision = precision_name(self.packet_wire(data, settings.wire_dtype).dtype or working_dtype(data))
        code = settings.code
        if code is None:
            return code_within(ranks, precision, settings.max_error)
        if code.world_size != ranks:
            where = "nodes" if self.hierarchical else "ranks"
            raise ValueError(
                f"Argument 'code' must be for the group's {ranks} {where}, not world_size={code.world_size}."
            )
        check_usable(code, precision, settings.max_error)
        return code

    def packet_wire(self, data: torch.dtype, packet_dtype: torch.dtype | None) -> FloatWire:
        """A float row's wire: the row's, the ``packet_dtype`` given (CERAR's family rows take 16
        bits too), or the data's own."""
        wire = WIRES.get(self.wire or "")
        if isinstance(wire, FloatWire):
            return wire
        return WIRES[precision_name(packet_dtype or working_dtype(data))]  # type: ignore[return-value]

    def takes_wire_dtype(self, dtype: torch.dtype | None) -> bool:
        """Whether this row takes ``wire_dtype=dtype``: the data's own width (float32, float64) or
        the row's own wire on any row, any packet dtype on CERAR's family rows (``cerar``,
        ``hier-cerar``), which :func:`check_packet_dtype` then checks."""
        return dtype in (None, torch.float32, torch.float64, self.wire_dtype) or (self.coded and self.wire is None)

    def applicable(self, options: dict[str, Any]) -> dict[str, Any]:
        """Of the settings of an owner that serves several rows (a DDP hook's state, a process
        group, the bench), the ones this row takes: ``code`` and ``fresh_scale`` for CERAR's rows,
        ``wire_dtype`` where the row has no fixed wire (or it names the row's own), and
        ``ranks_per_node`` for the hierarchical rows, ``error_feedback`` for the flat block rows;
        the others apply to every row."""
        drop = set()
        if not self.coded:
            drop |= {"code", "fresh_scale"}
        if not self.takes_wire_dtype(options.get("wire_dtype")):
            drop.add("wire_dtype")
        if not self.hierarchical:
            drop.add("ranks_per_node")
        if not self.takes_feedback:
            drop.add("error_feedback")
        return {k: v for k, v in options.items() if k not in drop}

    def check(self, settings: Settings) -> None:
        """Refuse the settings that do not apply to this row (naming the row), or bad values."""
        s = settings
        check_choice("nonfinite", s.nonfinite, NONFINITE_POLICIES)
        check_packet_dtype(s.wire_dtype, "wire_dtype")
        check_stats(s.stats)
        check_max_error(s.max_error)
        check_bool("fresh_scale", s.fresh_scale)
        check_int("ranks_per_node", s.ranks_per_node, minimum=1, optional=True)
        if s.code is not None and not isinstance(s.code, Code):
            raise TypeError(f"Argument 'code' must be a cerar.Code or None, not {type(s.code).__name__}.")
        if s.code is not None and not self.coded:
            raise ValueError(f"Argument 'code' does not apply to method {self.name!r}, not {s.code!r}.")
        if s.fresh_scale and not self.coded:
            raise ValueError(f"Argument 'fresh_scale' applies to CERAR's rows, not to method {self.name!r}.")
        if not self.takes_wire_dtype(s.wire_dtype):
            wire = self.wire or "the data's own"
            raise ValueError(
                f"Argument 'wire_dtype' does not apply to method {self.name!r}, not {s.wire_dtype} "
                f"(its wire is {wire}; name the row of that wire instead)."
            )
        if s.ranks_per_node is not None and not self.hierarchical:
            raise ValueError(f"Argument 'ranks_per_node' applies to the hierarchical methods only, not {self.name!r}.")
        if s.error_feedback is not None and not isinstance(s.error_feedback, ErrorFeedback):
            kind = type(s.error_feedback).__name__
            raise TypeError(f"Argument 'error_feedback' must be a cerar.ErrorFeedback or None, not {kind}.")
        if s.error_feedback is not None and not self.takes_feedback:
            rows = ", ".join(f"{family}-{w}" for family in ("ring", "direct") for w in BLOCK_WIRES)
            raise ValueError(
                f"Argument 'error_feedback' applies to the flat block rows ({rows}), not to method {self.name!r}."
            )

    def check_error(self, ranks: int, max_error: float | None) -> None:
        """Refuse a row whose predicted error on ``ranks`` ranks (nodes) exceeds ``max_error``,
        with the figures (CERAR's rows are checked through their code, :meth:`code_for`)."""
        if max_error is None or self.coded or ranks < 2:
            return
        bound = self.error_bound(ranks)
        if bound > max_error:
            where = "nodes" if self.hierarchical else "ranks"
            raise ValueError(
                f"Argument 'max_error' is {max_error:g}, but method {self.name!r} predicts a worst-rank relative error "
                f"of {bound:.3g} on {ranks} {where} (relative to the root-sum-square of the ranks' inputs). "
                f"Pass a larger max_error, or max_error=None to run it anyway."
            )

    def resolve(
        self, tensor: torch.Tensor, op: str, group: Any, async_op: bool, settings: Settings, ranks: int
    ) -> Request:
        """The request of one call on ``ranks`` ranks (nodes, for a hierarchical row): the wire and
        the code resolved, the error checked against ``max_error``."""
        self.check_error(ranks, settings.max_error)
        wire: Wire = WIRES[self.wire] if self.wire in WIRES else self.packet_wire(tensor.dtype, settings.wire_dtype)
        if self.wire is None and not self.coded and settings.wire_dtype is None:
            wire = OWN
        s, code = settings, self.code_for(ranks, tensor.dtype, settings)
        if s.error_feedback is not None:
            s.error_feedback.check(self.name, tensor.numel(), ranks)
        return Request(
            tensor, op, group, async_op, self.name, wire, s.nonfinite, s.max_error, s.stats, s.context, code,
            s.fresh_scale, s.ranks_per_node, s.error_feedback, self.family == "direct",
        )  # fmt: skip


#: The rows by name (auto's is added by :mod:`cerar.comm.auto.collective` when it loads).
ROUTES: dict[str, Route] = {}


def register_route(route: Route) -> Route:
    """Add ``route`` to :data:`ROUTES` (a row of the same name is replaced)."""
    ROUTES[route.name] = route
    return route


def get_route(name: str) -> Route:
    """The row called ``name``; an unknown name raises ValueError listing the rows."""
    if name not in ROUTES:
        raise ValueError(f"Argument 'method' must be one of {sorted(ROUTES)}, not {name!r}.")
    return ROUTES[name]


def route_for(family: str, packet_dtype: torch.dtype | None = None) -> Route:
    """The row of a family and a packet or wire dtype (the deprecated ways in, which name a family
    and a dtype): ``("cerar", torch.float16)`` is ``cerar-fp16``, ``("ring", torch.int8)``
    ``ring-int8``; where no row fixes that wire (float32, float64, None; ``hier-cerar`` with
    16-bit packets), the family's own row, which takes the dtype as its ``packet_dtype``."""
    wire = dtype_name(packet_dtype, "wire_dtype") if packet_dtype is not None else None
    row = ROUTES.get(f"{family}-{wire}")
    return row if row is not None else get_route(family)


def start(
    route: Route | str,
    tensor: Any,
    op: Any = "sum",
    group: Any = None,
    async_op: Any = False,
    **options: Any,
) -> Work | None:
    """Check a call's arguments on the caller's thread, before anything is queued, and start it
    by ``route`` (a row or its name). ``options``: :class:`Settings`'s fields (a row refuses
    one that does not apply to it)."""
    route = get_route(route) if isinstance(route, str) else route
    unknown = sorted(set(options) - {f.name for f in fields(Settings)})
    if unknown:
        raise TypeError(f"cerar: unknown arguments {unknown} for method {route.name!r}.")
    check_tensor(tensor)
    settings = Settings(**options)
    op, async_op = check_op(op), check_bool("async_op", async_op)
    route.check(settings)
    return route.start(route, Call(tensor, op, group, async_op, settings))  # type: ignore[arg-type]


@dataclass(frozen=True)
class Call:
    """A call checked but not yet resolved: each row's start resolves it once it knows its
    ring's size (:meth:`Route.resolve`)."""

    tensor: torch.Tensor
    op: str
    group: Any
    async_op: bool
    settings: Settings

    def resolve(self, route: Route, ranks: int) -> Request:
        return route.resolve(self.tensor, self.op, self.group, self.async_op, self.settings, ranks)


# ---------------------------------------------------------------------------------------------
# The rows' starts


def _submit(r: Request, call: Callable[..., None], *args: Any) -> Work | None:
    """Queue ``call(request, *args)`` on the communication thread: every cerar-transport row's
    start ends here. detach(): the same storage, so the result lands in ``tensor``, without
    autograd, which refuses in-place writes to a leaf that requires grad (dist.all_reduce also
    bypasses it)."""
    request = dataclasses.replace(r, tensor=r.tensor.detach())
    return COMM.submit(functools.partial(call, request, *args), r.tensor, r.async_op, r.group)


def _start_flat(route: Route, c: Call) -> Work | None:
    ring = ring_of(c.group)
    if ring is None:
        return None
    request = c.resolve(route, ring.size)
    return _submit(request, cerar_call if route.coded else ring_call, ring)


def _start_hierarchical(route: Route, c: Call) -> Work | None:
    nodes = prepare_nodes(c.group, c.settings.ranks_per_node, c.tensor.device)
    if nodes is None:
        return None
    request = c.resolve(route, nodes.layout.nodes)
    return _submit(request, hierarchical_call, nodes)


def _agree_first(route: Route, c: Call, bytes_per_value: Callable[[int], float]) -> None:
    """Agree the call (its row, size, dtype, op and a layer above's ``context``) on cerar's
    thread, in order with the calls in flight, and wait for it, before torch's all-reduce on the
    caller's thread: a rank that called another row raises :class:`SettingsMismatchError`
    everywhere instead of waiting in torch's all-reduce for a peer that never joins it.
    ``bytes_per_value(ranks)``: what that all-reduce sends per value, by its formula."""
    ring = ring_of(c.group)
    assert ring is not None
    sent = round(bytes_per_value(ring.size) * c.tensor.numel())
    context = {"method": route.name, "size": c.tensor.numel(), "dtype": str(c.tensor.dtype), "op": c.op}
    context.update(c.settings.context or {})
    agree = functools.partial(agree_call, ring, context, c.tensor.device, c.settings.stats, sent)
    COMM.submit(agree, c.tensor, False, c.group)


def _start_exact(route: Route, c: Call) -> Work | None:
    """torch's all-reduce on the caller's thread, in order with the caller's own collectives,
    once the call is agreed on cerar's thread (:func:`_agree_first`)."""
    if dist.get_rank(c.group) < 0:
        return None
    r = c.resolve(route, dist.get_world_size(c.group))
    _agree_first(route, c, lambda n: route.bytes_per_value(n, None, r.tensor.element_size()))
    future = torch_all_reduce(r.tensor, r.group, average=r.op == "avg", async_op=True)
    assert future is not None
    return _finished(Work(future), r.async_op)


def _start_torch_16(route: Route, c: Call) -> Work | None:
    """torch's ``fp16_compress_hook`` (``bf16_compress_hook``) as a call: the tensor cast to the
    wire (divided by ``N`` first for an average), torch's all-reduce, cast back; what DDP's
    16-bit hooks send."""
    if dist.get_rank(c.group) < 0:
        return None
    group = dist.group.WORLD if c.group is None else c.group
    r = c.resolve(route, dist.get_world_size(group))
    _agree_first(route, c, route.bytes_per_value)
    compressed = r.tensor.detach().to(route.wire_dtype)
    if r.op == "avg":
        compressed.div_(dist.get_world_size(group))
    reduced = dist.all_reduce(compressed, group=group, async_op=True).get_future()
    target = r.tensor.detach()

    def back(value: list[torch.Tensor]) -> list[torch.Tensor]:
        target.copy_(value[0])
        return [r.tensor]

    devices = [r.tensor.device] if r.tensor.device.type != "cpu" else None
    return _finished(Work(forward(reduced, back, devices)), r.async_op)


def _finished(work: Work, async_op: bool) -> Work | None:
    if async_op:
        return work
    work.wait()
    return None


def _block_rows() -> list[Route]:
    rows = []
    for name in BLOCK_WIRES:
        fmt = WIRES[name].fmt  # type: ignore[attr-defined]
        rows.append(Route(
            f"ring-{name}", "ring", name, _start_flat,
            description=f"the ring sending {name} in blocks ({fmt.describe()}), float32 partial sums, requantized "
            "at every hop, every rank the owner's values",
        ))  # fmt: skip
    for name in BLOCK_WIRES:
        fmt = WIRES[name].fmt  # type: ignore[attr-defined]
        rows.append(Route(
            f"direct-{name}", "direct", name, _start_flat,
            description=f"each rank's chunks straight to their owners in {name} ({fmt.describe()}), the owner's "
            "float32 sum quantized once, to every rank: two roundings whatever N",
        ))  # fmt: skip
    for name in ("fp16", "bf16", *BLOCK_WIRES):
        rows.append(Route(
            f"hier-ring-{name}", "hier-ring", name, _start_hierarchical, hierarchical=True,
            description=f"exact reduce-scatter in each node, the ring sending {name} between nodes, all-gather",
        ))  # fmt: skip
    return rows


for _route in (
    Route("exact", "exact", "fp32", _start_exact, exact_sum=True, transport="torch",
          description="torch.distributed.all_reduce on the caller's group (Gloo, NCCL)"),
    Route("torch-fp16", "torch", "fp16", _start_torch_16, transport="torch",
          description="torch's fp16_compress_hook as a call: cast to float16, torch's all-reduce, cast back"),
    Route("torch-bf16", "torch", "bf16", _start_torch_16, transport="torch",
          description="torch's bf16_compress_hook as a call: cast to bfloat16, torch's all-reduce, cast back"),
    Route("ring", "ring", None, _start_flat, exact_sum=True,
          description="cerar's exact ring (reduce-scatter + all-gather) on cerar's transport"),
    Route("ring-fp16", "ring", "fp16", _start_flat,
          description="the ring sending float16 (power-of-two scaled), accumulating in float32"),
    Route("ring-bf16", "ring", "bf16", _start_flat,
          description="the ring sending bfloat16, accumulating in float32"),
    Route("cerar", "cerar", None, _start_flat, _cerar_values, coded=True, identical=False,
          description="CERAR with float32 packets (float64 for float64 tensors), decoded in float64"),
    Route("cerar-fp16", "cerar", "fp16", _start_flat, _cerar_values, coded=True, identical=False,
          description="CERAR with float16 packets (power-of-two scaled; codes designed for float16)"),
    Route("cerar-bf16", "cerar", "bf16", _start_flat, _cerar_values, coded=True, identical=False,
          description="CERAR with bfloat16 packets (codes designed for bfloat16)"),
    Route("hier-ring", "hier-ring", None, _start_hierarchical, exact_sum=True, hierarchical=True,
          description="exact reduce-scatter in each node, cerar's exact ring between nodes, all-gather in each node"),
    Route("hier-cerar", "hier-cerar", None, _start_hierarchical, _cerar_values, coded=True, identical=False,
          hierarchical=True,
          description="exact reduce-scatter in each node, CERAR (a code for M nodes) between nodes, all-gather"),
    *_block_rows(),
):  # fmt: skip
    register_route(_route)
