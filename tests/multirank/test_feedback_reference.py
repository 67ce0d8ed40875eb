"""Error feedback (cerar.ErrorFeedback) on Gloo ranks against its numpy reference
(cerar.experiments.study.feedback): call after call of ``cerar.all_reduce(..., error_feedback=)``
on one fixed gradient per rank, every rank's result and every rank's residual bitwise the
reference's, in both shapes (``direct-<wire>``, ``ring-<wire>``) and every block wire, with the
compiled kernels (CERAR_NATIVE=1, where they take the wire) and the torch ops (0)."""

from __future__ import annotations

import hashlib
import os

import numpy as np
import pytest
import torch

import cerar
from cerar.coding.blocks import WIRES as BLOCK_NAMES
from cerar.comm.algorithms import native
from cerar.comm.algorithms.ring.wires import WIRES
from cerar.comm.collective.routes import ROUTES
from cerar.experiments.study.feedback import feedback_call, zero_residuals
from multirank import check, run_ranks

pytestmark = pytest.mark.multirank

WORLD = 4
#: Every block wire's rows in both shapes (the route table has a row of each).
METHODS = [f"{shape}-{wire}" for wire in BLOCK_NAMES for shape in ("direct", "ring") if f"{shape}-{wire}" in ROUTES]
#: (values, calls, methods): a size divisible by neither the ranks nor the blocks; one of several
#: pieces a chunk (packets of about 256 KiB each), compared by digest.
SMALL = (1001, 4, METHODS)
LARGE = (2_000_003, 3, ["direct-int4", "ring-int4"])


def _input(rank: int, d: int, seed: int) -> torch.Tensor:
    """Values over 12 binades, so that blocks mix magnitudes (tests/multirank/test_direct.py's)."""
    g = torch.Generator().manual_seed(1000 * seed + rank)
    return torch.randn(d, generator=g) * torch.exp2(torch.randint(-6, 6, (d,), generator=g).float())


def _bits(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).tobytes()


def _digest(a: np.ndarray) -> str:
    return hashlib.sha256(_bits(a)).hexdigest()


def _worker(rank: int, world: int, native_flag: str, case: tuple, seed: int, digest: bool) -> dict:
    """Each method's calls on this rank's fixed gradient: every call's output and the store's
    residual after it (or their digests), and whether the compiled int4 kernels were in use."""
    os.environ["CERAR_NATIVE"] = native_flag
    d, calls, methods = case
    g = _input(rank, d, seed)
    out: dict = {"compiled": native.quant_kernels("int4", "bf16", 32, torch.float32, torch.device("cpu")) is not None}
    for method in methods:
        store = cerar.ErrorFeedback()
        seen = []
        for _ in range(calls):
            y = g.clone()
            cerar.all_reduce(y, method=method, max_error=None, error_feedback=store)
            assert store.residual is not None
            pair = (y.numpy(), store.residual.numpy().copy())
            seen.append(tuple(_digest(a) for a in pair) if digest else pair)
        out[method] = seen
    return out


def _reference(case: tuple, seed: int) -> dict[str, list[tuple[np.ndarray, np.ndarray]]]:
    """Each method's calls in numpy: the sum every rank ends with and the ``N`` residuals."""
    d, calls, methods = case
    inputs = np.stack([_input(r, d, seed).numpy() for r in range(WORLD)])
    expected = {}
    for method in methods:
        shape, wire = method.split("-", 1)
        fmt = WIRES[wire].fmt  # type: ignore[attr-defined]
        residuals, seen = zero_residuals(WORLD, d), []
        for _ in range(calls):
            out, residuals = feedback_call(shape, inputs, fmt, residuals)
            seen.append((out, residuals))
        expected[method] = seen
    return expected


@pytest.mark.parametrize("native_flag", ["1", "0"])
def test_every_call_and_residual_bitwise_the_reference(native_flag: str, monkeypatch: pytest.MonkeyPatch) -> None:
    results = check(run_ranks(_worker, WORLD, native_flag, SMALL, 3, False, timeout=300))
    monkeypatch.setenv("CERAR_NATIVE", "1")  # whether this machine has the compiled kernels at all
    available = native.quant_kernels("int4", "bf16", 32, torch.float32, torch.device("cpu")) is not None
    assert all(r["compiled"] == (native_flag == "1" and available) for r in results)
    expected = _reference(SMALL, 3)
    for method, calls in expected.items():
        for k, (out, residuals) in enumerate(calls):
            for r in range(WORLD):
                got_out, got_residual = results[r][method][k]
                assert _bits(got_out) == _bits(out), (method, k, r, np.max(np.abs(got_out - out)))
                assert _bits(got_residual) == _bits(residuals[r]), (method, k, r)
        # the residuals differ from rank to rank and hold what was rounded away (not zero)
        last = calls[-1][1]
        assert np.all(np.abs(last).max(axis=1) > 0) and not np.array_equal(last[0], last[1])


@pytest.mark.parametrize("native_flag", ["1", "0"])
def test_several_pieces_a_chunk(native_flag: str) -> None:
    results = check(run_ranks(_worker, WORLD, native_flag, LARGE, 4, True, timeout=600))
    expected = _reference(LARGE, 4)
    for method, calls in expected.items():
        for k, (out, residuals) in enumerate(calls):
            for r in range(WORLD):
                assert results[r][method][k] == (_digest(out), _digest(residuals[r])), (method, k, r)
