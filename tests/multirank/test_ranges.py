"""Every finite magnitude of every supported dtype, for every packet dtype: the sum comes back
finite and within the code's predicted error, or the call raises on every rank with the input
intact. An explicit grid (a seeded generator, so a failure reproduces): per (data dtype, packet
dtype), magnitudes ``2**e`` from the dtype's smallest subnormal to its largest value that ``N``
ranks can sum without overflow, in a shuffled order (a call's scale starts from the previous
call's of that size, so huge-after-tiny and tiny-after-huge are both met), on all ranks or on
one rank beside ordinary data."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

import cerar
from cerar.comm.collective.request import Settings
from cerar.comm.collective.routes import get_route
from multirank import check, run_ranks

_SIZE = 2003  # not a multiple of c: the padded last piece too
#: A rank's error may be 3x its documented bound (``error_bound[j] * D_j``, relative to the sum) or
#: 3x the code's predicted worst-rank error at the packet precision, whichever is larger (the bound
#: is for exact arithmetic; the prediction includes the packets' rounding).
_ALLOWANCE = 3.0

#: (data dtype, packet dtype): every packet dtype for both data dtypes (None: the native packet).
_COMBINATIONS = [
    (torch.float32, None),
    (torch.float32, torch.float16),
    (torch.float32, torch.bfloat16),
    (torch.float64, None),
    (torch.float64, torch.float32),
    (torch.float64, torch.float16),
    (torch.float64, torch.bfloat16),
]


def _exponents(dtype: torch.dtype, world: int, generator: torch.Generator) -> list[int]:
    """Binary exponents across ``dtype``'s whole finite range: both ends, and random ones between."""
    info = torch.finfo(dtype)
    lowest = int(math.log2(info.tiny)) - {torch.float32: 23, torch.float64: 52}[dtype]  # smallest subnormal
    # randn reaches about 5 sigma: keep N * 5 * 2**e below the largest value.
    highest = int(math.log2(info.max)) - math.ceil(math.log2(5 * world)) - 1
    middle = torch.randint(lowest, highest + 1, (10,), generator=generator).tolist()
    grid = [lowest, lowest + 8, -140, -130, -120, -60, 0, 60, 110, 120, highest - 8, highest, *middle]
    grid = [e for e in grid if lowest <= e <= highest]
    order = torch.randperm(len(grid), generator=generator).tolist()
    return [grid[i] for i in order]


def _gather(tensor: torch.Tensor) -> torch.Tensor:
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, tensor.contiguous())
    return torch.stack(parts)


def _sweep_worker(rank: int, world: int, data: torch.dtype, packet: torch.dtype | None, where: str) -> list[tuple]:
    torch.manual_seed(0)  # the same exponents and order on every rank
    generator = torch.Generator().manual_seed(1)
    exponents = _exponents(data, world, generator)
    code = get_route("cerar").code_for(world, data, Settings(wire_dtype=packet))  # the one rule
    predicted = code.predicted_worst_error(str(packet or data).removeprefix("torch."))
    found = []
    for exponent in exponents:
        x = torch.randn(_SIZE, dtype=torch.float64, generator=torch.Generator().manual_seed(100 * rank + exponent))
        if where == "all" or rank == 1:
            x = x * 2.0**exponent  # subnormal at the lowest exponents, as intended
        x = x.to(data)
        original = x.clone()
        inputs = _gather(x).double()
        exact = inputs.sum(0)
        scale = float(inputs.abs().max())  # relative errors, computed without overflow or underflow
        relative_d = code.error_scale((inputs / scale).numpy(), rank) / float((exact / scale).norm())
        limit = _ALLOWANCE * max(predicted, float(code.error_bound[rank]) * relative_d)
        try:
            cerar.all_reduce(x, packet_dtype=packet)
        except Exception as exc:  # must be the same on every rank, with the input intact
            found.append((exponent, type(exc).__name__, bool(torch.equal(x, original)), 0.0, limit))
            continue
        finite = bool(torch.isfinite(x).all())
        err = float(((x.double() - exact) / scale).norm() / (exact / scale).norm()) if finite else math.inf
        found.append((exponent, "ok" if finite else "nonfinite", True, err, limit))
    return found


@pytest.mark.multirank
@pytest.mark.parametrize("where", ["all", "one"])
@pytest.mark.parametrize(("data", "packet"), _COMBINATIONS, ids=lambda v: str(v).removeprefix("torch."))
def test_every_magnitude_of_every_dtype(data: torch.dtype, packet: torch.dtype | None, where: str) -> None:
    _check_sweep(check(run_ranks(_sweep_worker, 4, data, packet, where, timeout=240)))


@pytest.mark.multirank
@pytest.mark.parametrize("packet", [None, torch.float16, torch.bfloat16], ids=lambda v: str(v).removeprefix("torch."))
def test_every_magnitude_with_the_torch_ops_decode(packet: torch.dtype | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """float32 data decodes in one compiled pass where a C compiler is (cerar.comm.algorithms.native); the
    torch ops it replaces still run on GPUs and machines without one: the same sweep through them."""
    monkeypatch.setenv("CERAR_NATIVE", "0")  # the forked ranks inherit it
    _check_sweep(check(run_ranks(_sweep_worker, 4, torch.float32, packet, "one", timeout=240)))


def _check_sweep(results: list[list[tuple]]) -> None:
    failures = []
    for case in zip(*results, strict=True):
        outcomes = {(what, intact) for _, what, intact, _, _ in case}
        exponent = case[0][0]
        if len(outcomes) != 1:
            failures.append(f"2**{exponent}: ranks differ {sorted(outcomes)}")
            continue
        what, intact = outcomes.pop()
        if what != "ok":
            failures.append(f"2**{exponent}: {what} (input intact: {intact})")
            continue
        over = [f"rank {r}: {e:.3g} > {limit:.3g}" for r, (_, _, _, e, limit) in enumerate(case) if not e <= limit]
        if over:
            failures.append(f"2**{exponent}: error {over}")
    assert not failures, "\n".join(failures)


def _ring_sweep_worker(rank: int, world: int, data: torch.dtype, wire: torch.dtype | None) -> list[tuple]:
    generator = torch.Generator().manual_seed(2)
    found = []
    unit = {None: 2.0**-53, torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}[wire]
    for exponent in _exponents(data, world, generator):
        x = torch.randn(_SIZE, dtype=torch.float64, generator=torch.Generator().manual_seed(100 * rank + exponent))
        x = (x * 2.0**exponent).to(data)
        inputs = _gather(x).double()
        exact = inputs.sum(0)
        scale = float(inputs.abs().max())
        cerar.ring_all_reduce(x, wire_dtype=wire)
        finite = bool(torch.isfinite(x).all())
        err = float(((x.double() - exact) / scale).norm() / (exact / scale).norm()) if finite else math.inf
        # Each of the N - 1 additions and the wire's roundings adds at most one unit roundoff per value.
        limit = 4 * world * max(unit, 2.0**-24 if data == torch.float32 else 2.0**-53) * float(
            (inputs / scale).abs().sum(0).norm() / (exact / scale).norm()
        )
        found.append((exponent, "ok" if finite else "nonfinite", True, err, limit))
    return found


@pytest.mark.multirank
@pytest.mark.parametrize(
    ("data", "wire"),
    [(torch.float32, torch.float16), (torch.float32, torch.bfloat16), (torch.float64, torch.float32),
     (torch.float64, torch.float16), (torch.float64, torch.bfloat16)],
    ids=lambda v: str(v).removeprefix("torch."),
)  # fmt: skip
def test_the_exact_ring_over_every_magnitude_of_every_dtype(data: torch.dtype, wire: torch.dtype) -> None:
    results = check(run_ranks(_ring_sweep_worker, 4, data, wire, timeout=240))
    failures = []
    for case in zip(*results, strict=True):
        exponent = case[0][0]
        over = [f"rank {r}: {what} {e:.3g} > {limit:.3g}" for r, (_, what, _, e, limit) in enumerate(case)
                if what != "ok" or not e <= limit]  # fmt: skip
        if over:
            failures.append(f"2**{exponent}: {over}")
    assert not failures, "\n".join(failures)
