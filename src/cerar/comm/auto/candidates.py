"""The candidates of ``method="auto"``: each way to all-reduce, with the rounds, the bytes and the
predicted worst-rank error that the budget, the tournament's order and ``cerar plan`` need
(``docs/auto.md`` tabulates them). ``exact`` is always admitted, the reference; the bfloat16
variants (the bytes of float16, more error) only when listed; a CERAR candidate whose code is
the exact one (``c = N``, as at ``N = 2``) is left out (it is the ring with CERAR's extra
rounds). The 16-bit rings' error: a ring rounds each partial sum it sends (``k`` of the ``N``
inputs at hop ``k``) and the sum once more for the all-gather, each rounding within ``u`` of the
value, so for i.i.d. inputs the relative error is at most ``u sqrt((N+1)/2)``. No torch here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cerar._checks import check_choice, check_int
from cerar.coding.blocks import WIRES as WIRES_8BIT
from cerar.coding.blocks import BlockFormat, ring_error_bound
from cerar.coding.code import Code, check_max_error

__all__ = [
    "BASELINE_NAMES",
    "CANDIDATE_NAMES",
    "DEFAULT_CANDIDATES",
    "UNIT_ROUNDOFF",
    "Candidate",
    "build_candidates",
    "handshake_hops",
    "ring_error",
]

#: The largest relative error of one rounding to nearest, by wire precision.
UNIT_ROUNDOFF = {"fp32": 2.0**-24, "fp16": 2.0**-11, "bf16": 2.0**-8}
#: Every candidate ``method="auto"`` knows (exact first: the reference; trials run by bytes sent).
CANDIDATE_NAMES = ("exact", "fp16", "bf16", "int8", "fp8", "cerar", "cerar-fp16", "cerar-bf16")
#: The candidates tried by default (the bfloat16 ones send the same bytes and err more; the
#: float8 ring sends the int8 ring's bytes and errs more).
DEFAULT_CANDIDATES = ("exact", "fp16", "int8", "cerar", "cerar-fp16")
#: The exact, 16-bit and 8-bit rings: the baselines CERAR must beat by the margin.
BASELINE_NAMES = ("exact", "fp16", "bf16", "int8", "fp8")
#: The row of the route table (:mod:`cerar.comm.collective.routes`) each candidate runs, by
#: context: the DDP hook's 16-bit rings are torch's compress hooks, the collective's cerar's rings.
ROWS = {
    "collective": {
        name: {"fp16": "ring-fp16", "bf16": "ring-bf16", "int8": "ring-int8", "fp8": "ring-fp8"}.get(name, name)
        for name in CANDIDATE_NAMES
    },
    "ddp": {
        name: {"fp16": "torch-fp16", "bf16": "torch-bf16", "int8": "ring-int8", "fp8": "ring-fp8"}.get(name, name)
        for name in CANDIDATE_NAMES
    },
}


def ring_error(world_size: int, precision: str) -> float:
    """The predicted worst-rank relative error of a ring whose wire is ``precision``:
    ``u sqrt((N+1)/2)`` (derived in the module doc); the 8-bit wires' by
    :func:`cerar.coding.blocks.ring_error_bound` for their default block format."""
    n = check_int("world_size", world_size, minimum=1)
    if precision in WIRES_8BIT:
        return ring_error_bound(n, BlockFormat(precision))
    return UNIT_ROUNDOFF[check_choice("precision", precision, tuple(UNIT_ROUNDOFF))] * math.sqrt((n + 1) / 2)


def handshake_hops(world_size: int) -> int:
    """The point-to-point hops of the handshake that opens every call on cerar's transport."""
    return math.ceil(math.log2(world_size)) if world_size > 1 else 0


@dataclass(frozen=True)
class Candidate:
    """One way to all-reduce, as the cost model and the decision see it.

    Attributes:
        name: ``"exact"``, ``"fp16"``, ``"cerar"``... (the bench also models its own methods,
            ``"builtin"``, ``"ring-fp16"``, with the same class).
        wire: the precision on the wire, ``"fp32"``, ``"fp16"`` or ``"bf16"``.
        transport: ``"torch"`` (``torch.distributed.all_reduce`` on the caller's group, its
            own latency) or ``"cerar"`` (cerar's point-to-point ring and handshake).
        world_size: ``N``.
        components: CERAR's ``c`` (``None`` for a ring).
        code: CERAR's code (``None`` for a ring, or where only the figures are needed).
        predicted_error: the predicted worst-rank relative error.
    """

    name: str
    wire: str
    transport: str
    world_size: int
    components: int | None = None
    code: Code | None = None
    predicted_error: float = 0.0
    row: str = ""  # its row of the route table; default: the one ``name`` runs on ``transport``

    def __post_init__(self) -> None:
        if not self.row:
            context = ROWS["ddp" if self.transport == "torch" else "collective"]
            object.__setattr__(self, "row", context.get(self.name, self.name))

    @property
    def route(self) -> Any:
        """Its :class:`cerar.comm.collective.routes.Route` (loads torch.distributed)."""
        from cerar.comm.collective.routes import get_route

        return get_route(self.row)

    @property
    def coded(self) -> bool:
        """Whether it takes a code (CERAR)."""
        return self.components is not None

    @property
    def algorithm(self) -> str:
        """``"cerar"`` or ``"ring"`` (exact and 16-bit rings): a knob of the pinned table."""
        return "ring" if self.components is None else "cerar"

    @property
    def baseline(self) -> bool:
        """An exact or 16-bit ring, the methods CERAR must beat by the decision's margin."""
        return self.components is None

    @property
    def coding(self) -> bool:
        """Whether it has a time per value beyond moving its bytes (casts, CERAR's coding, cerar's
        transport's own work): the cost model's ``gamma`` term. Torch's exact float32
        all-reduce, which the link's ``beta`` is measured by, has none."""
        return self.components is not None or self.wire != "fp32" or self.transport != "torch"

    @property
    def rounds(self) -> int:
        """Sequential message rounds per call (cerar's transport adds its handshake hops)."""
        n = self.world_size
        data = 2 * (n - 1) if self.components is None else self.components + n - 2
        return data + (handshake_hops(n) if self.transport == "cerar" else 0)

    @property
    def bytes_per_value(self) -> float:
        """Bytes each rank sends per value reduced: ``2(N-1)/N`` values for a ring,
        ``1 + (N-2)/c`` for CERAR, times the wire's bytes."""
        n, c = self.world_size, self.components
        values = 2.0 * (n - 1) / n if c is None else (c + n - 2) / c
        if self.wire in WIRES_8BIT:
            return values * BlockFormat(self.wire).bytes_per_value
        return values * (4.0 if self.wire == "fp32" else 2.0)

    @property
    def label(self) -> str:
        """``"exact"``, ``"fp16"``, ``"cerar c=8"``, ``"cerar-fp16 c=8"``."""
        return self.name if self.components is None else f"{self.name} c={self.components}"

    def describe(self) -> dict[str, Any]:
        """JSON-ready figures: name, label, wire, transport, c, rounds, bytes per value, error."""
        return {
            "name": self.name,
            "label": self.label,
            "wire": self.wire,
            "transport": self.transport,
            "components": self.components,
            "rounds": self.rounds,
            "bytes_per_value": self.bytes_per_value,
            "predicted_error": self.predicted_error,
        }


def build_candidates(
    world_size: int,
    max_error: float | None,
    names: Sequence[str] = DEFAULT_CANDIDATES,
    context: str = "ddp",
    *,
    fast_codes: bool = False,
) -> tuple[list[Candidate], list[Candidate]]:
    """``(admitted, refused)``: the candidates ``names`` for ``N`` ranks, split by ``max_error``
    (``None``: no limit), in :data:`CANDIDATE_NAMES` order, exact first and always admitted.

    ``context`` is ``"ddp"`` (16-bit rings are torch's compress hooks, on torch's transport) or
    ``"collective"`` (``cerar.ring_all_reduce`` with a 16-bit wire, on cerar's). ``fast_codes``
    takes ``perturbed(N, 2N)`` codes instead of the library's defaults (which may take seconds to
    design for a large ``N``): what ``cerar plan`` uses to describe a cluster.
    """
    n = check_int("world_size", world_size, minimum=1)
    limit = check_max_error(max_error)
    check_choice("context", context, ("ddp", "collective"))
    for name in names:
        check_choice("candidates", name, CANDIDATE_NAMES)
    wanted = ["exact", *(name for name in CANDIDATE_NAMES if name in names and name != "exact")]
    admitted: list[Candidate] = []
    refused: list[Candidate] = []
    for name in wanted:
        candidate = _candidate(name, n, limit, context, fast_codes)
        if candidate is None:
            continue
        keep = name == "exact" or limit is None or candidate.predicted_error <= limit
        (admitted if keep else refused).append(candidate)
    return admitted, refused


def _candidate(name: str, n: int, limit: float | None, context: str, fast_codes: bool) -> Candidate | None:
    """The candidate ``name`` for ``N`` ranks, or None where it does not apply (``N = 1``, a
    CERAR code that would be the exact one)."""
    wire = "fp32" if name in ("exact", "cerar") else name.removeprefix("cerar-")
    if name in BASELINE_NAMES:
        transport = "torch" if name == "exact" or (context == "ddp" and wire not in WIRES_8BIT) else "cerar"
        return Candidate(name, wire, transport, n, predicted_error=ring_error(n, wire), row=ROWS[context][name])
    if n < 3:
        return None  # two ranks: every c sends one value per value and decodes exactly, the ring's
    code = _code(n, wire, limit, fast_codes)
    if code.components == n:
        return None
    return Candidate(name, wire, "cerar", n, code.components, code, code.predicted_worst_error(wire), name)


def _code(n: int, wire: str, limit: float | None, fast_codes: bool) -> Code:
    from cerar.coding import codes

    if fast_codes:
        return codes.perturbed(n, 2 * n, None, wire, max_error=None)
    if wire == "fp32":  # the library's default code, or a more accurate one where the budget asks
        default = codes.choose(n, "fp32")
        if limit is None or default.predicted_worst_error("fp32") <= limit:
            return default
        return codes.choose(n, "fp32", limit)
    # The default 16-bit code: optimized(N, 2N, precision), as cerar.all_reduce picks it.
    return codes.optimized(n, 2 * n, wire, max_error=None)
