"""The compiled CPU coding (cerar.comm.algorithms.native: encode and decode) inside the collective, against
the torch ops it replaces (``CERAR_NATIVE=0``), on the same inputs: the same sums within
float32's rounding, no larger error, less memory, and the scaled paths (a huge rank, an odd
size) alike."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.distributed as dist

import cerar
from cerar.comm.algorithms import native
from multirank import check, run_ranks

_SIZE = 50_003  # not a multiple of c: the padded last piece too
_PACKETS = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _worker(rank: int, world: int, switch: str) -> dict[str, tuple[np.ndarray, float, float, int, str]]:
    os.environ["CERAR_NATIVE"] = switch  # read at every call; the fork's parent may have built it
    generator = torch.Generator().manual_seed(rank)
    base = torch.randn(_SIZE, generator=generator) * torch.exp2(torch.randint(-8, 8, (_SIZE,), generator=generator))
    results = {}
    for case in ["plain", "huge"]:
        x = base.clone()
        if case == "huge" and rank == 1:  # the call's scale then moves the data (its exponent path)
            x = x.sign() * 1e37
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x)
        exact = torch.stack(parts).double().sum(0)
        for name, packet in _PACKETS.items():
            y, stats = x.clone(), cerar.CommStats()
            cerar.all_reduce(y, packet_dtype=packet, stats=stats)
            error = float((y.double() - exact).norm() / exact.norm())
            switched = native.status().split(":")[0]
            results[f"{case}/{name}"] = (
                y.double().numpy(),
                float(exact.norm()),
                error,
                stats.peak_extra_bytes,
                switched,
            )
    return results


@pytest.mark.skipif(native.status().startswith("off"), reason=f"compiled coding unavailable: {native.status()}")
def test_compiled_decode_agrees_with_the_torch_ops() -> None:
    compiled = check(run_ranks(_worker, 4, "1", timeout=120))
    torch_ops = check(run_ranks(_worker, 4, "0", timeout=120))
    for key in compiled[0]:
        worst_on = max(on[key][2] for on in compiled)
        worst_off = max(off[key][2] for off in torch_ops)
        assert worst_on <= worst_off * 1.02, (key, worst_on, worst_off)  # the worst rank: no larger error
    for rank, (on, off) in enumerate(zip(compiled, torch_ops, strict=True)):
        for key, (y_on, _, err_on, peak_on, status_on) in on.items():
            y_off, norm, err_off, peak_off, status_off = off[key]
            assert (status_on, status_off) == ("on", "off")
            assert np.isfinite(y_on).all(), (rank, key)
            # Each rank within 10%: the torch ops' own part D X is a float32 product whose
            # rounding can echo the encode's (the same product of the same rows), which cancels
            # a little of a rank's error where its own values dominate the sum ("huge": 5% on
            # rank 1); the kernel's is float64.
            assert err_on <= err_off * 1.1 + 1e-12, (rank, key, err_on, err_off)
            # Both decode the same observations: on ordinary data they differ by far less than
            # either's error (where one rank's values dominate, by about that error: see above).
            if key.startswith("plain"):
                assert np.linalg.norm(y_on - y_off) <= 0.25 * err_off * norm, (rank, key)
            # The kernel needs no float64 accumulator and no widened scratch.
            assert peak_on < peak_off, (rank, key, peak_on, peak_off)
