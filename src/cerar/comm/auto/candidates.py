"""The candidates of ``method="auto"``: rows of the route table (:mod:`cerar.comm.collective.routes`)
under auto's names, each with ``N``, CERAR's code and its predicted worst-rank error
(``docs/auto.md`` tabulates them). ``exact``, the reference, is always admitted; a CERAR
candidate whose code is the exact one (``c = N``, as at ``N = 2``) is left out: it would be the
ring with CERAR's extra rounds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from cerar.coding.linear_code import Code
from cerar.comm.collective.call import NonFiniteError
from cerar.comm.collective.default_code import code_within, default_code
from cerar.comm.collective.routes import Route, get_route, start
from cerar.comm.runtime.maxima import max_abs
from cerar.comm.runtime.stats import CommStats
from cerar.comm.runtime.work import Work

__all__ = ["CANDIDATE_NAMES", "DEFAULT_CANDIDATES", "ROWS", "Candidate", "build_candidates", "rank"]

#: Every candidate ``method="auto"`` knows (exact first: the reference; trials run by bytes sent).
CANDIDATE_NAMES = ("exact", "fp16", "bf16", "int8", "fp8", "cerar", "cerar-fp16", "cerar-bf16")
#: The candidates tried by default (the bfloat16 ones send the same bytes and err more; the
#: float8 ring sends the int8 ring's bytes and errs more).
DEFAULT_CANDIDATES = ("exact", "fp16", "int8", "cerar", "cerar-fp16")
#: The row each candidate runs, by context: the DDP hook's 16-bit rings are torch's compress
#: hooks, the collective's cerar's rings; the 8-bit rings are cerar's in both.
ROWS = {
    context: {
        "exact": "exact", "fp16": f"{ring16}-fp16", "bf16": f"{ring16}-bf16", "int8": "ring-int8", "fp8": "ring-fp8",
        "cerar": "cerar", "cerar-fp16": "cerar-fp16", "cerar-bf16": "cerar-bf16",
    }
    for context, ring16 in (("ddp", "torch"), ("collective", "ring"))
}  # fmt: skip


@dataclass(frozen=True)
class Candidate:
    """One way to all-reduce, as the tournament, the cost model and the decision see it.

    Attributes:
        name: ``"exact"``, ``"fp16"``, ``"cerar"``... (or a bench method the cost model fits).
        route: the row of the route table it runs: its wire, transport, bytes, exactness, and
            whether it is CERAR (``coded``) or a ring, a baseline CERAR must beat by the margin.
        world_size: ``N``.
        components: CERAR's ``c`` (``None`` for a ring).
        code: CERAR's code (``None`` for a ring, or where only the figures are needed).
        predicted_error: the predicted worst-rank relative error (the row's, for the code).
    """

    name: str
    route: Route
    world_size: int
    components: int | None = None
    code: Code | None = None
    predicted_error: float = 0.0

    @property
    def wire(self) -> str:
        """The precision on the wire: ``"fp32"``, ``"fp16"``, ``"bf16"``, ``"int8"`` or ``"fp8"``."""
        return self.route.precision()

    @property
    def bytes_per_value(self) -> float:
        """Bytes each rank sends per value reduced (the row's, for ``N`` and ``c``)."""
        return self.route.bytes_per_value(self.world_size, self.components)

    @property
    def label(self) -> str:
        """``"exact"``, ``"fp16"``, ``"cerar c=8"``, ``"cerar-fp16 c=8"``."""
        return self.name if self.components is None else f"{self.name} c={self.components}"

    def describe(self) -> dict[str, Any]:
        """JSON-ready figures (``auto_status``): name, label, wire, transport, c, bytes per value, error."""
        keys = ("name", "label", "wire", "components", "bytes_per_value", "predicted_error")
        return {"transport": self.route.transport, **{k: getattr(self, k) for k in keys}}

    def start(
        self, tensor: torch.Tensor, op: str, group: Any, nonfinite: str, stats: CommStats | None,
        context: dict[str, Any] | None = None, fresh: bool = False,
    ) -> Work:  # fmt: skip
        """Start the row on ``tensor`` in place, asynchronously; the arguments were checked by the
        caller. No budget of its own: auto admitted the candidate by its predicted error. With
        ``context``, auto's settings are agreed in the row's handshake. ``fresh``: after another
        method's call, 16-bit CERAR takes its packet scale from the data, since the one its last
        call left may no longer fit (every rank switches at the same call)."""
        fresh = fresh and self.route.wire is not None
        options: dict[str, Any] = {"code": self.code, "fresh_scale": fresh} if self.route.coded else {}
        options.update(nonfinite=nonfinite, max_error=None, stats=stats, context=context)
        work = start(self.route, tensor, op, group, True, **options)
        assert work is not None  # a member of the group: checked by the caller
        return work

    def check_finite(self, result: torch.Tensor, nonfinite: str, what: str) -> None:
        """Under ``nonfinite="raise"``, a ring's non-finite sum (the same on every rank) raises :class:`NonFiniteError`
        on every rank; CERAR checks its own. One read (``max_abs``), no mask of the tensor written."""
        if nonfinite == "raise" and not self.route.coded and not math.isfinite(max_abs(result)):
            raise NonFiniteError(
                f"cerar auto: the {self.label} {what} is not finite (some rank's input held NaN or Inf, "
                "or the sum overflowed)."
            )


def rank(candidates: Sequence[Candidate], times: Sequence[float], among: Sequence[int], margin: float) -> list[int]:
    """``among`` (indices of ``candidates``) fastest first by ``times`` (``inf``: unknown); a CERAR
    candidate counts as faster than the fastest ring only if it beats it by ``margin``, since its
    coding competes with the step for the cores and its errors are not free. Ties go to the lower
    index (exact first), so the order depends only on the numbers."""
    best_ring = min((times[k] for k in among if not candidates[k].route.coded), default=math.inf)

    def key(k: int) -> tuple[float, int, int]:
        if candidates[k].route.coded and not times[k] < (1 - margin) * best_ring:
            return (max(times[k], best_ring), 1, k)  # not the margin faster: behind the rings
        return (times[k], 0, k)

    return sorted(among, key=key)


def build_candidates(
    world_size: int,
    max_error: float | None,
    names: Sequence[str] = DEFAULT_CANDIDATES,
    context: str = "ddp",
    *,
    fast_codes: bool = False,
) -> tuple[list[Candidate], list[Candidate]]:
    """``(admitted, refused)``: the candidates ``names`` for ``N`` ranks, split by ``max_error``
    (``None``: no limit), in :data:`CANDIDATE_NAMES` order, exact first and always admitted; the
    callers checked their arguments (``names``: :class:`cerar.comm.auto.tournament.AutoConfig`).

    ``context`` is ``"ddp"`` or ``"collective"`` (:data:`ROWS`). ``fast_codes`` takes
    ``perturbed(N, 2N)`` codes instead of the library's defaults (which may take seconds to
    design for a large ``N``): what ``cerar plan`` uses to describe a cluster.
    """
    wanted = ["exact", *(name for name in CANDIDATE_NAMES if name in names and name != "exact")]
    admitted: list[Candidate] = []
    refused: list[Candidate] = []
    for name in wanted:
        candidate = _candidate(name, get_route(ROWS[context][name]), world_size, max_error, fast_codes)
        if candidate is None:
            continue
        keep = name == "exact" or max_error is None or candidate.predicted_error <= max_error
        (admitted if keep else refused).append(candidate)
    return admitted, refused


def _candidate(name: str, route: Route, n: int, limit: float | None, fast_codes: bool) -> Candidate | None:
    """The candidate ``name`` for ``N`` ranks, or None where it does not apply (a CERAR code that
    would be the exact one)."""
    if not route.coded:
        return Candidate(name, route, n, predicted_error=route.error_bound(n))
    if n < 3:
        return None  # two ranks: every c sends one value per value and decodes exactly, the ring's
    code = _code(n, route.precision(), limit, fast_codes)
    if code.components == n:
        return None
    return Candidate(name, route, n, code.components, code, route.error_bound(n, code))


def _code(n: int, wire: str, limit: float | None, fast_codes: bool) -> Code:
    from cerar.coding import codes

    if fast_codes:
        return codes.perturbed(n, 2 * n, None, wire, max_error=None)
    try:  # the one rule every call takes (cerar.comm.collective.default_code.code_within)
        return code_within(n, wire, limit)
    except ValueError:  # none within the budget: the default, which the budget then refuses
        return default_code(n, wire)
