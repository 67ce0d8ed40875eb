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
                requantized at every hop (``ring-fp8``: float8 e4m3)              the block's scale
``cerar``       CERAR, float32 (float64) packets                       no         ``1 + (N-2)/c``
``cerar-fp16``  CERAR, float16 packets (``cerar-bf16``: bfloat16)      no         ``1 + (N-2)/c``, 2 bytes
``hier-ring``   exact inside each node, the ring between the M nodes   yes, exact ``2(M-1)/M`` between
``hier-cerar``  exact inside each node, CERAR between the M nodes      no         ``1 + (M-2)/c`` between
``auto``        the fastest row within ``max_error`` (:mod:`cerar.comm.auto.collective`)
==============  =====================================================  =========  ======================

"identical": every rank ends with bitwise the same values; "exact": and they are the sum up to
float32 rounding. The predicted errors: a ring whose wire rounds to within ``u`` of each value
sent (a partial sum of ``k`` of the ``N`` inputs at hop ``k``, and the whole sum once more for the
all-gather) errs by at most ``u sqrt((N+1)/2)`` relative, for i.i.d. inputs; the 8-bit rings by
:func:`cerar.coding.blocks.ring_error_bound`; CERAR by its code's
:meth:`cerar.Code.predicted_worst_error` at the packet precision. No row's start imports above
this layer.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from cerar._checks import check_bool, check_choice, check_int
from cerar.coding.blocks import BlockFormat, ring_error_bound
from cerar.coding.code import MAX_ERROR, Code, check_max_error
from cerar.coding.precision import UNIT_ROUNDOFF, precision_name
from cerar.comm.collective.call import agree_call, cerar_call, ring_call
from cerar.comm.collective.checks import check_op, check_packet_dtype, check_stats, check_tensor
from cerar.comm.collective.codes import check_usable, code_within, default_code, working_dtype
from cerar.comm.collective.hierarchical import hierarchical_call
from cerar.comm.collective.policies import NONFINITE_POLICIES
from cerar.comm.collective.quant_call import quant_ring_call
from cerar.comm.ring.exact import exact_all_reduce
from cerar.comm.ring.groups import ring_of
from cerar.comm.ring.nodes import prepare_nodes
from cerar.comm.ring.stats import CommStats
from cerar.comm.ring.thread import COMM
from cerar.comm.ring.work import Work, forward

__all__ = ["ROUTES", "Request", "Route", "get_route", "register_route", "route_for", "start"]

#: The 8-bit rings' block formats (:mod:`cerar.coding.blocks`: the defaults chosen by measurement).
BLOCK_FORMATS = {"int8": BlockFormat("int8"), "fp8": BlockFormat("fp8")}
#: Bytes per value of each wire precision (the 8-bit ones with their blocks' scales).
WIRE_BYTES = {"fp64": 8.0, "fp32": 4.0, "fp16": 2.0, "bf16": 2.0}
WIRE_BYTES.update({wire: fmt.bytes_per_value for wire, fmt in BLOCK_FORMATS.items()})
_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "int8": torch.int8, "fp8": torch.float8_e4m3fn}
_WIRE_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


@dataclass(frozen=True)
class Request:
    """One call, its arguments checked (:func:`start`): what every row's start takes."""

    tensor: torch.Tensor
    op: str  # "sum" or "avg"
    group: Any = None
    async_op: bool = False
    code: Code | None = None
    nonfinite: str = "raise"
    packet_dtype: torch.dtype | None = None  # rows of no fixed wire: None, float32 or float64
    max_error: float | None = MAX_ERROR
    stats: CommStats | None = None
    fresh_scale: bool = False
    ranks_per_node: int | None = None
    context: Mapping[str, Any] | None = None  # a layer above's settings, agreed in the call's handshake


Start = Callable[["Route", Request], "Work | None"]


def _ring_values(n: int, c: int | None) -> float:
    return 2.0 * (n - 1) / n if n > 1 else 0.0


def _cerar_values(n: int, c: int | None) -> float:
    return (c + n - 2) / c if c else _ring_values(n, None)


@dataclass(frozen=True)
class Route:
    """One way to all-reduce (a row of :data:`ROUTES`).

    Attributes:
        name: the method's name (``"cerar-fp16"``).
        method: its family, the name the process group's and the hooks' settings use with a
            ``packet_dtype`` (``"cerar"``, ``"ring"``, ``"hier-cerar"``, ``"hier-ring"``,
            ``"exact"``, ``"auto"``).
        wire: the precision it sends, fixed by the row (``"fp16"``...), or None: the data's
            own (float32, or float64 for float64 tensors; ``packet_dtype`` may choose).
        start: how one call starts: ``start(route, request)`` returns a :class:`Work` with
            ``async_op``, else None once done (None too on ranks outside the group).
        values: values each rank sends per value reduced, ``values(n, c)`` for the ring it runs
            on (``n``: ranks, or nodes for a hierarchical row; ``c``: CERAR's components).
        coded: takes a :class:`cerar.Code` (CERAR).
        identical: every rank ends with bitwise the same values.
        exact: identical, and the sum up to float32 rounding.
        hierarchical: exact inside each node; ``values`` and the code are for the nodes.
        transport: ``"cerar"`` (its point-to-point ring and handshake) or ``"torch"``.
        description: one line for ``--help`` and the docs.
    """

    name: str
    method: str
    wire: str | None
    start: Start
    values: Callable[[int, int | None], float] = _ring_values
    coded: bool = False
    identical: bool = True
    exact: bool = False
    hierarchical: bool = False
    transport: str = "cerar"
    description: str = ""
    error: Callable[[int], float] | None = None  # a row's own prediction (the 8-bit rings')

    @property
    def wire_dtype(self) -> torch.dtype | None:
        """The wire's torch dtype where the row fixes a narrower one, else None."""
        return _DTYPES.get(self.wire or "")

    def precision(self, data: torch.dtype = torch.float32) -> str:
        """The precision on the wire for ``data`` tensors (``"fp32"``, ``"fp16"``...)."""
        return self.wire or precision_name(working_dtype(data))

    def bytes_per_value(self, world_size: int, components: int | None = None, data_bytes: float = 4.0) -> float:
        """Bytes each rank sends per value reduced (a hierarchical row: per value between nodes,
        for ``world_size`` nodes); ``data_bytes``: the data's own width, for rows of no fixed wire."""
        width = WIRE_BYTES[self.wire] if self.wire in WIRE_BYTES else data_bytes
        return self.values(world_size, components) * width

    def error_bound(self, world_size: int, code: Code | None = None) -> float:
        """The predicted worst-rank relative error for i.i.d. inputs (see the module doc):
        CERAR's code's (the default code's for ``world_size`` if none), a ring's
        ``u sqrt((N+1)/2)``."""
        if self.error is not None:
            return self.error(world_size)
        precision = self.precision()
        if self.coded and world_size > 2:
            code = code if code is not None else default_code(world_size, precision)
            return code.predicted_worst_error(precision)
        return UNIT_ROUNDOFF[precision] * math.sqrt((world_size + 1) / 2)


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


def route_for(method: str, packet_dtype: torch.dtype | None = None) -> Route:
    """The row of a family and a packet or wire dtype: ``("cerar", torch.float16)`` is
    ``cerar-fp16``; where no row fixes that wire (float32, float64, None; ``hier-cerar`` with
    16-bit packets), the family's own row, which takes the dtype as its ``packet_dtype``."""
    wire = _WIRE_NAMES.get(packet_dtype) or (precision_name(packet_dtype) if packet_dtype is not None else None)
    row = ROUTES.get(f"{method}-{wire}")
    return row if row is not None else get_route(method)  # a family row takes the dtype as an argument


def start(
    route: Route | str,
    tensor: Any,
    op: Any = "sum",
    group: Any = None,
    async_op: Any = False,
    **options: Any,
) -> Work | None:
    """Check a call's arguments on the caller's thread, before anything is queued, and start it
    by ``route`` (a row or its name). ``options``: :class:`Request`'s fields (a row that does
    not take ``code``, ``packet_dtype`` or ``ranks_per_node`` refuses them)."""
    route = get_route(route) if isinstance(route, str) else route
    unknown = sorted(set(options) - set(Request.__dataclass_fields__))
    if unknown:
        raise TypeError(f"cerar: unknown arguments {unknown} for method {route.name!r}.")
    check_tensor(tensor)
    request = Request(tensor, check_op(op), group, check_bool("async_op", async_op), **options)
    _check(route, request)
    return route.start(route, request)


def _check(route: Route, r: Request) -> None:
    check_choice("nonfinite", r.nonfinite, NONFINITE_POLICIES)
    check_packet_dtype(r.packet_dtype)
    check_stats(r.stats)
    check_max_error(r.max_error)
    check_bool("fresh_scale", r.fresh_scale)
    check_int("ranks_per_node", r.ranks_per_node, minimum=1, optional=True)
    if r.code is not None and not isinstance(r.code, Code):
        raise TypeError(f"Argument 'code' must be a cerar.Code or None, not {type(r.code).__name__}.")
    if r.code is not None and not route.coded:
        raise ValueError(f"Argument 'code' does not apply to method {route.name!r}, not {r.code!r}.")
    if r.packet_dtype not in (None, torch.float32, torch.float64) and route.wire is not None:
        raise ValueError(f"Argument 'packet_dtype' does not apply to method {route.name!r} (its wire is {route.wire}).")
    if r.ranks_per_node is not None and not route.hierarchical:
        raise ValueError(f"Argument 'ranks_per_node' applies to the hierarchical methods only, not {route.name!r}.")


# ---------------------------------------------------------------------------------------------
# The rows' starts


def _packet(route: Route, r: Request) -> torch.dtype | None:
    return route.wire_dtype if route.wire is not None else r.packet_dtype


def _submit(r: Request, call: Callable[..., None], *args: Any) -> Work | None:
    """Queue ``call(tensor, op, *args)`` on the communication thread: every cerar-transport row's
    start ends here. detach(): the same storage, so the result lands in ``tensor``, without
    autograd, which refuses in-place writes to a leaf that requires grad (dist.all_reduce also
    bypasses it)."""
    return COMM.submit(functools.partial(call, r.tensor.detach(), r.op, *args), r.tensor, r.async_op, r.group)


def _start_cerar(route: Route, r: Request) -> Work | None:
    ring = ring_of(r.group)
    if ring is None:
        return None
    packet = _packet(route, r)
    precision = precision_name(packet or working_dtype(r.tensor.dtype))
    code = r.code
    if code is not None:
        if code.world_size != ring.size:
            raise ValueError(
                f"Argument 'code' is for world_size={code.world_size} but the group has {ring.size} ranks."
            )
        check_usable(code, precision, r.max_error)
    elif ring.size > 1:  # the default code, bound by max_error (fewer components, or refused with the figures)
        code = code_within(ring.size, precision, r.max_error)
    return _submit(r, cerar_call, ring, code, r.nonfinite, r.stats, packet, r.fresh_scale, r.context, r.max_error)


def _start_ring(route: Route, r: Request) -> Work | None:
    ring = ring_of(r.group)
    return None if ring is None else _submit(r, ring_call, ring, _packet(route, r), r.stats, r.context)


def _start_quantized(route: Route, r: Request) -> Work | None:
    ring = ring_of(r.group)
    if ring is None:
        return None
    return _submit(r, quant_ring_call, ring, BLOCK_FORMATS[route.wire or ""], r.nonfinite, r.stats, r.context)


def _start_hierarchical(route: Route, r: Request) -> Work | None:
    nodes = prepare_nodes(r.group, r.ranks_per_node, r.tensor.device)
    if nodes is None:
        return None
    if r.code is not None and r.code.world_size != nodes.layout.nodes:
        raise ValueError(
            f"Argument 'code' must be for the group's {nodes.layout.nodes} nodes, not world_size={r.code.world_size}."
        )
    family = "cerar" if route.coded else "ring"
    nonfinite = r.nonfinite if route.coded else "ignore"
    packet, code = _packet(route, r), r.code
    if route.coded and nodes.layout.nodes > 1:  # the code between nodes, bound by max_error as the flat call's
        precision = precision_name(packet or working_dtype(r.tensor.dtype))
        if code is not None:
            check_usable(code, precision, r.max_error)
        else:
            code = code_within(nodes.layout.nodes, precision, r.max_error)
    return _submit(r, hierarchical_call, nodes, family, code, nonfinite, r.stats, packet, r.context)


def _agree_first(r: Request, bytes_per_value: Callable[[int], float]) -> None:
    """With a ``context`` (auto's), agree it on cerar's thread, in order with the calls in flight,
    before torch's all-reduce on the caller's thread; ``bytes_per_value(ranks)``: what that
    all-reduce sends per value, by its formula, for the statistics."""
    if r.context is None:
        return
    ring = ring_of(r.group)
    assert ring is not None
    sent = round(bytes_per_value(ring.size) * r.tensor.numel())
    agree = functools.partial(agree_call, ring, r.context, r.tensor.device, r.stats, sent)
    COMM.submit(agree, r.tensor, False, r.group)


def _start_exact(route: Route, r: Request) -> Work | None:
    """torch's all-reduce on the caller's thread, in order with the caller's own collectives; with
    a ``context`` (auto's), agreed first on cerar's thread, in order with the calls in flight."""
    if dist.get_rank(r.group) < 0:
        return None
    _agree_first(r, lambda n: route.bytes_per_value(n, None, r.tensor.element_size()))
    future = exact_all_reduce(r.tensor, r.group, average=r.op == "avg", async_op=True)
    assert future is not None
    return _finished(Work(future), r.async_op)


def _start_torch_16(route: Route, r: Request) -> Work | None:
    """torch's ``fp16_compress_hook`` (``bf16_compress_hook``) as a call: the tensor cast to the
    wire (divided by ``N`` first for an average), torch's all-reduce, cast back; what DDP's
    16-bit hooks send."""
    if dist.get_rank(r.group) < 0:
        return None
    _agree_first(r, route.bytes_per_value)
    group = dist.group.WORLD if r.group is None else r.group
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


for _route in (
    Route("exact", "exact", "fp32", _start_exact, exact=True, transport="torch",
          description="torch.distributed.all_reduce on the caller's group (Gloo, NCCL)"),
    Route("torch-fp16", "torch", "fp16", _start_torch_16, transport="torch",
          description="torch's fp16_compress_hook as a call: cast to float16, torch's all-reduce, cast back"),
    Route("torch-bf16", "torch", "bf16", _start_torch_16, transport="torch",
          description="torch's bf16_compress_hook as a call: cast to bfloat16, torch's all-reduce, cast back"),
    Route("ring", "ring", None, _start_ring, exact=True,
          description="cerar's exact ring (reduce-scatter + all-gather) on cerar's transport"),
    Route("ring-fp16", "ring", "fp16", _start_ring,
          description="the ring sending float16 (power-of-two scaled), accumulating in float32"),
    Route("ring-bf16", "ring", "bf16", _start_ring,
          description="the ring sending bfloat16, accumulating in float32"),
    Route("ring-int8", "ring", "int8", _start_quantized,
          error=functools.partial(ring_error_bound, fmt=BLOCK_FORMATS["int8"]),
          description=f"the ring sending int8 in blocks ({BLOCK_FORMATS['int8'].describe()}), float32 partial sums, "
          "requantized at every hop, every rank the owner's values"),
    Route("ring-fp8", "ring", "fp8", _start_quantized,
          error=functools.partial(ring_error_bound, fmt=BLOCK_FORMATS["fp8"]),
          description=f"the ring sending float8 e4m3 in blocks ({BLOCK_FORMATS['fp8'].describe()}), float32 partial "
          "sums, requantized at every hop"),
    Route("cerar", "cerar", None, _start_cerar, _cerar_values, coded=True, identical=False,
          description="CERAR with float32 packets (float64 for float64 tensors), decoded in float64"),
    Route("cerar-fp16", "cerar", "fp16", _start_cerar, _cerar_values, coded=True, identical=False,
          description="CERAR with float16 packets (power-of-two scaled; codes designed for float16)"),
    Route("cerar-bf16", "cerar", "bf16", _start_cerar, _cerar_values, coded=True, identical=False,
          description="CERAR with bfloat16 packets (codes designed for bfloat16)"),
    Route("hier-ring", "hier-ring", None, _start_hierarchical, exact=True, hierarchical=True,
          description="exact reduce-scatter in each node, cerar's exact ring between nodes, all-gather in each node"),
    Route("hier-cerar", "hier-cerar", None, _start_hierarchical, _cerar_values, coded=True, identical=False,
          hierarchical=True,
          description="exact reduce-scatter in each node, CERAR (a code for M nodes) between nodes, all-gather"),
):  # fmt: skip
    register_route(_route)
