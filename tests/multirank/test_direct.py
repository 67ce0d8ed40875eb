"""The direct shape (``direct-int8``, ``direct-int4``...: cerar.comm.algorithms.ring.direct) and error
feedback (cerar.ErrorFeedback) on Gloo ranks: bitwise the same result on every rank and bitwise
the numpy reference (cerar.coding.blocks.direct_round_trip), compiled kernels and torch ops
alike; the ring's bytes; less error than the ring at the same wire; with error feedback, the
sum over many calls of one gradient converging like 1/calls on both shapes (without it, not);
residuals that stay finite, are refused for another stream, and are agreed on by every rank."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch
from wire_data import same_bits as _same
from wire_data import scaled_input as _input

import cerar
from cerar.coding.blocks import SCALE_ITEMSIZE, BlockFormat, direct_round_trip
from cerar.comm.algorithms.ring.direct import run_direct
from cerar.comm.algorithms.ring.wires import BlockWire
from cerar.comm.runtime.handshake import SettingsMismatchError
from cerar.comm.runtime.links import Ring
from cerar.comm.runtime.stats import CommStats
from multirank import RankFailure, check, run_ranks

pytestmark = pytest.mark.multirank

CASES = [
    (1000, BlockFormat("int8", 64, "bf16")),
    (3, BlockFormat("int8", 7, "fp16")),
    (4099, BlockFormat("fp8", 33, "bf16")),
    (1001, BlockFormat("int4", 32, "bf16")),
    (2_000_003, BlockFormat("int4", 32, "bf16")),  # several pieces a chunk
]


def _direct_worker(rank: int, world: int, native: str) -> list[tuple[np.ndarray, np.ndarray, int, int]]:
    os.environ["CERAR_NATIVE"] = native
    ring = Ring.of(None)
    assert ring is not None
    out = []
    for seed, (d, fmt) in enumerate(CASES):
        x = _input(rank, d, seed)
        given = x.clone()
        stats = CommStats()
        run_direct(x, ring, stats, BlockWire(fmt.wire, fmt))
        out.append((given.numpy(), x.numpy(), stats.bytes_sent, stats.bytes_received))
    return out


@pytest.mark.parametrize(("world", "native"), [(2, "1"), (3, "1"), (4, "1"), (4, "0")])
def test_every_rank_bitwise_equal_and_the_reference(world: int, native: str) -> None:
    results = check(run_ranks(_direct_worker, world, native, timeout=300))
    for index, (d, fmt) in enumerate(CASES):
        inputs = np.stack([results[r][index][0] for r in range(world)])
        expected = direct_round_trip(inputs, fmt)
        for r in range(world):
            assert _same(results[r][index][1], expected), (d, fmt, r)
        chunk = math.ceil(d / world)
        packet = fmt.code_bytes(chunk) + math.ceil(chunk / fmt.block) * SCALE_ITEMSIZE[fmt.scale]
        for r in range(world):
            _, _, sent, received = results[r][index]
            # the ring's bytes (its packets, each aligned to 16 bytes in the buffer)
            assert 2 * (world - 1) * packet <= sent == received <= 2 * (world - 1) * (packet + 16 * 16)


def _error_worker(rank: int, world: int) -> list[float]:
    """The relative error of ring-int4 and direct-int4 on the same Gaussian inputs."""
    x = _input(rank, 1 << 16, 11)
    exact = x.clone()
    torch.distributed.all_reduce(exact)
    errors = []
    for method in ("ring-int4", "direct-int4"):
        y = x.clone()
        cerar.all_reduce(y, method=method, max_error=None)
        errors.append(float((y - exact).norm() / exact.norm()))
    return errors


def test_direct_errs_less_than_the_ring_at_four_bits() -> None:
    results = check(run_ranks(_error_worker, 4, timeout=120))
    ring, direct = results[0]
    bound = cerar.collective.get_route("direct-int4").error_bound(4)
    assert direct < ring and direct < bound, (ring, direct, bound)


def _feedback_worker(rank: int, world: int, method: str, calls: int) -> tuple[list[float], list[float], bool, float]:
    """``calls`` calls on one fixed gradient, with and without a store: the relative error of the
    running sum after each call (against ``k`` times the exact sum); whether every call's result
    was bitwise the same on every rank; the store's bytes."""
    g = _input(rank, 4096, 5)
    exact = g.clone()
    torch.distributed.all_reduce(exact)
    store = cerar.ErrorFeedback()
    curves, same = [], True
    for feedback in (None, store):
        total, curve = torch.zeros_like(g, dtype=torch.float64), []
        for k in range(1, calls + 1):
            y = g.clone()
            cerar.all_reduce(y, method=method, max_error=None, error_feedback=feedback)
            gathered = [torch.empty_like(y) for _ in range(world)]
            torch.distributed.all_gather(gathered, y)
            same = same and all(torch.equal(t, gathered[0]) for t in gathered)
            total += y.double()
            curve.append(float((total - k * exact.double()).norm() / (k * exact.double().norm())))
        curves.append(curve)
    return curves[0], curves[1], same, store.nbytes


@pytest.mark.parametrize("method", ["direct-int4", "ring-int4", "direct-int8"])
def test_error_feedback_makes_the_sum_over_calls_converge(method: str) -> None:
    calls = 64
    results = check(run_ranks(_feedback_worker, 4, method, calls, timeout=300))
    plain, fed, _, nbytes = results[0]
    assert all(r[2] for r in results)  # bitwise the same on every rank, every call, either way
    assert nbytes == 4 * 4 * math.ceil(4096 / 4)  # one float32 per padded value
    # Without feedback the running mean keeps the one call's error (the same gradient rounds the
    # same way); with it the error of the sum stays bounded, so the mean's falls like 1/calls.
    assert plain[-1] > 0.5 * plain[0]
    assert fed[-1] < 4.0 * fed[0] / calls, (fed[0], fed[-1])


def _misuse_worker(rank: int, world: int) -> list[str]:
    outcomes = []
    store = cerar.ErrorFeedback()
    x = torch.ones(100)
    cerar.all_reduce(x, method="direct-int4", max_error=None, error_feedback=store)
    for call in (
        lambda: cerar.all_reduce(torch.ones(99), method="direct-int4", max_error=None, error_feedback=store),
        lambda: cerar.all_reduce(torch.ones(100), method="ring-int4", max_error=None, error_feedback=store),
        lambda: cerar.all_reduce(torch.ones(100), method="cerar", error_feedback=cerar.ErrorFeedback()),
        lambda: cerar.all_reduce(torch.ones(100), method="direct-int4", error_feedback="yes"),
    ):
        try:
            call()
            outcomes.append("ran")
        except (ValueError, TypeError) as exc:
            outcomes.append(f"{type(exc).__name__}: {exc}")
    store.reset()
    cerar.all_reduce(torch.ones(99), method="direct-int4", max_error=None, error_feedback=store)
    outcomes.append(repr(store))
    return outcomes


def test_a_store_refuses_another_stream_and_other_rows() -> None:
    for outcomes in check(run_ranks(_misuse_worker, 3, timeout=120)):
        assert "holds the residual of a call of method 'direct-int4' on 100 values" in outcomes[0]
        assert "this call (method 'direct-int4', 99 values" in outcomes[0]
        assert "method 'ring-int4'" in outcomes[1]
        assert "applies to the flat block rows" in outcomes[2] and "'cerar'" in outcomes[2]
        assert outcomes[3].startswith("TypeError") and "error_feedback" in outcomes[3]
        assert "99 values" in outcomes[4]


def _mismatch_worker(rank: int, world: int) -> None:
    store = cerar.ErrorFeedback() if rank == 1 else None
    cerar.all_reduce(torch.ones(100), method="direct-int4", max_error=None, error_feedback=store)


def test_feedback_on_some_ranks_only_raises_everywhere() -> None:
    for result in run_ranks(_mismatch_worker, 3, timeout=120):
        assert isinstance(result, RankFailure) and result.type_name == SettingsMismatchError.__name__, result


def _nonfinite_worker(rank: int, world: int, method: str) -> tuple[bool, bool, bool]:
    store = cerar.ErrorFeedback()
    x = _input(rank, 1000, 3)
    cerar.all_reduce(x.clone(), method=method, max_error=None, error_feedback=store, nonfinite="ignore")
    y = x.clone()
    if rank == 2:
        y[10] = float("nan")
    cerar.all_reduce(y, method=method, max_error=None, error_feedback=store, nonfinite="ignore")
    finite_after_nan = bool(torch.isfinite(store.residual).all())
    z = x.clone()
    cerar.all_reduce(z, method=method, max_error=None, error_feedback=store, nonfinite="ignore")
    return finite_after_nan, bool(torch.isfinite(z).all()), bool(torch.isnan(y).any())


@pytest.mark.parametrize("method", ["direct-int4", "ring-int8"])
def test_a_nonfinite_value_never_enters_a_residual(method: str) -> None:
    for finite_residual, finite_next, nan_this in check(run_ranks(_nonfinite_worker, 4, method, timeout=120)):
        assert finite_residual and finite_next and nan_this


def _float64_worker(rank: int, world: int) -> tuple[np.ndarray, np.ndarray]:
    x = _input(rank, 999, 9).double() * 1e300  # beyond float32's range: scaled in float64 first
    given = x.clone()
    cerar.all_reduce(x, method="direct-int8", max_error=None, error_feedback=cerar.ErrorFeedback(), op="avg")
    return given.numpy(), x.numpy()


def test_float64_beyond_float32s_range_and_avg() -> None:
    results = check(run_ranks(_float64_worker, 3, timeout=120))
    exact = np.stack([r[0] for r in results]).mean(0)
    for _, out in results:
        assert np.isfinite(out).all() and np.array_equal(out, results[0][1])
        assert np.linalg.norm((out - exact) / 1e300) / np.linalg.norm(exact / 1e300) < 0.05
