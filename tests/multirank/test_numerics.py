"""The collective's numerics: error relative to each parameter, and no silent non-finite output
from finite input (overflow, subnormals), with the same decision on every rank."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

import cerar
from cerar import codes
from cerar.comm.collective.api import default_code
from multirank import check, run_ranks


def _gather(tensor: torch.Tensor) -> torch.Tensor:
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, tensor.contiguous())
    return torch.stack(parts)


def _mixed_scale_worker(rank: int, world: int) -> tuple[float, float, float]:
    """Blocks of 1000 values, every other block scaled by 100, as the parameters of one bucket."""
    g = torch.Generator().manual_seed(rank)
    blocks = torch.randn(40, 1000, generator=g)
    blocks[::2] *= 100
    x = blocks.reshape(-1)
    exact = _gather(x).double().sum(0)
    cerar.all_reduce(x, code=codes.perturbed(world, 2 * world))
    err = (x.double() - exact).reshape(40, 1000)
    exact_blocks = exact.reshape(40, 1000)
    per_block = (err.norm(dim=1) / exact_blocks.norm(dim=1)).max()
    unscaled = err[1::2].norm() / exact_blocks[1::2].norm()
    return float(per_block), float(unscaled), float(err.norm() / exact.norm())


def test_each_parameter_error_is_relative_to_its_own_values() -> None:
    for per_block, unscaled, whole in check(run_ranks(_mixed_scale_worker, 4, timeout=60)):
        # With contiguous components the unscaled blocks' error was 1.6e-2 (75x the whole's).
        assert per_block < 1e-3 and unscaled < 1e-3, (per_block, unscaled)
        assert unscaled < 3 * whole


def _extreme_worker(rank: int, world: int, case: str, nonfinite: str) -> tuple[bool, float, int, int]:
    g = torch.Generator().manual_seed(10 + rank)
    x = torch.randn(8400, generator=g)
    if case == "huge":  # one rank holds +-1e38: the true sum is finite in float32
        x = x.sign() * 1e38 if rank == 1 else x
    elif case == "subnormal":
        x = x * 1e-40
    elif case == "huge-then-normal":
        pass
    exact = _gather(x).double().sum(0)
    stats = cerar.CommStats()
    code = codes.perturbed(world, 2 * world)
    if case == "huge-then-normal":  # a scale learnt from a huge call must not spoil the next ones
        huge = x.sign() * 1e38 if rank == 1 else x.clone()
        cerar.all_reduce(huge, code=code, nonfinite=nonfinite, stats=stats)
    cerar.all_reduce(x, code=code, nonfinite=nonfinite, stats=stats)
    finite = bool(torch.isfinite(x).all())
    err = float((x.double() - exact).norm() / exact.norm())
    return finite, err, stats.rescales, stats.fallbacks


@pytest.mark.parametrize("nonfinite", ["raise", "exact", "ignore"])
def test_huge_finite_input_comes_back_finite(nonfinite: str) -> None:
    results = check(run_ranks(_extreme_worker, 4, "huge", nonfinite, timeout=60))
    for finite, err, rescales, fallbacks in results:
        assert finite and err < 1e-3, (finite, err)
        assert rescales == 1 and fallbacks == 0  # redone at a scale that fits, on every rank


def test_subnormal_input_keeps_its_precision() -> None:
    for finite, err, rescales, _ in check(run_ranks(_extreme_worker, 4, "subnormal", "raise", timeout=60)):
        # Before: 4e-3 (23x the bound); float32 subnormals near 1e-40 hold ~1e-5 relative.
        assert finite and err < 1e-3, err
        assert rescales == 1


def test_a_rescaled_call_then_ordinary_data() -> None:
    for finite, err, rescales, _ in check(run_ranks(_extreme_worker, 4, "huge-then-normal", "raise", timeout=60)):
        assert finite and err < 1e-3, err
        assert rescales == 1  # the huge call redid itself; the ordinary one fit the learnt scale


def _scale_disagreement_worker(rank: int, world: int) -> tuple[float, bool]:
    """Ranks whose remembered scales differ (one rank restarted, say) still agree on one."""
    from cerar.comm.runtime.groups import group_state, ring_of

    x = torch.randn(5000, generator=torch.Generator().manual_seed(rank))
    exact = _gather(x).double().sum(0)
    if rank == 2:
        ring = ring_of(None)
        group_state(None).scale_exponents[(ring.send_to, ring.recv_from, x.numel(), "fp32")] = 40
    cerar.all_reduce(x, code=codes.perturbed(world, 2 * world))
    return float((x.double() - exact).norm() / exact.norm()), bool(torch.isfinite(x).all())


def test_ranks_with_different_remembered_scales_agree() -> None:
    for err, finite in check(run_ranks(_scale_disagreement_worker, 3, timeout=60)):
        assert finite and err < 1e-3


def _fresh_scale_worker(rank: int, world: int) -> list[tuple[int, int]]:
    """16-bit packets: a size's calls, then data 2**12 times larger and back (as a stream that
    another method interrupted while the gradients grew): the remembered scale no longer fits
    and the call is redone, unless the calls where the data changed take their scale from their
    data (``fresh_scale``)."""
    code = cerar.codes.optimized(world, 2 * world, "fp16")
    x = torch.randn(20_000, generator=torch.Generator().manual_seed(rank))
    exact = _gather(x).double().sum(0)
    seen = []
    for fresh in (False, True):
        stats = cerar.CommStats()
        previous = 1.0
        for growth in (1.0, 1.0, 4096.0, 1.0):
            y = x * growth
            cerar.all_reduce(
                y, code=code, packet_dtype=torch.float16, stats=stats, fresh_scale=fresh and growth != previous
            )
            assert torch.isfinite(y).all()
            assert float((y.double() / growth - exact).norm() / exact.norm()) < 5e-2
            previous = growth
        seen.append((stats.rescales, stats.agreed_calls))
    return seen


def test_a_fresh_scale_fits_data_that_grew_without_redoing_the_call() -> None:
    for without, with_fresh in check(run_ranks(_fresh_scale_worker, 4, timeout=90)):
        # Without: the grown call (and the one back) start from a scale that no longer fits and
        # are redone; the size's first call ran the whole handshake, the other three the early path.
        assert without[0] >= 1 and without[1] == 3, without
        # With: nothing redone; the two calls at a changed scale ran the whole handshake.
        assert with_fresh == (0, 2), with_fresh


def _one_value_worker(rank: int, world: int, c: int, d: int, where: int) -> list[int]:
    x = torch.zeros(d)
    if rank == 1:
        x[where] = 1.0
    cerar.all_reduce(x, code=codes.perturbed(world, c))
    exact = torch.zeros(d)
    exact[where] = 1.0
    return torch.nonzero(x != exact).flatten().tolist()


def test_the_collective_and_the_simulator_confine_an_error_to_its_column() -> None:
    """The layout, in the collective and in the simulator: an input that is non-zero in one value
    only reaches, through the decoder's error, only that value's column (its c neighbours), and
    on the interior ranks (whose decode is approximate) it does reach it."""
    world, c, d, where = 4, 8, 999, 17
    column = set(range(16, 24))
    touched_by_rank = check(run_ranks(_one_value_worker, world, c, d, where, timeout=60))
    for rank, touched in enumerate(touched_by_rank):
        assert set(touched) <= column, (rank, touched)
    assert all(touched_by_rank[r] for r in range(1, world - 1))  # interior ranks: approximate
    inputs = np.zeros((world, d))
    inputs[1, where] = 1.0
    result = cerar.simulate(codes.perturbed(world, c), inputs)
    touched = np.flatnonzero(np.abs(result.outputs - result.exact).max(axis=0) > 0)
    assert set(touched) <= column and len(touched) > 0


def _sixteen_bit_worker(rank: int, world: int, packet: str) -> tuple[float, float, int, int, list[int]]:
    dtype = getattr(torch, packet)
    x = torch.randn(100_003, generator=torch.Generator().manual_seed(rank)) / world
    inputs = _gather(x).double()
    exact = inputs.sum(0)
    stats = cerar.CommStats()
    rescales = []
    y = x.clone()
    cerar.all_reduce(y, packet_dtype=dtype, stats=stats)
    rescales.append(stats.rescales)
    sent = stats.bytes_sent
    for growth in (2.0, 64.0, 1 / 4096):  # within the window, then out of it both ways
        z = x * growth
        cerar.all_reduce(z, packet_dtype=dtype, stats=stats)
        rescales.append(stats.rescales)
        assert torch.isfinite(z).all()
        assert float((z.double() / growth - exact).norm() / exact.norm()) < 5e-2
    code = default_code(world, "fp16" if packet == "float16" else "bf16")
    simulated = cerar.simulate(code, inputs.numpy(), packet_dtype=packet)
    from_simulator = float(np.linalg.norm(simulated.outputs[rank] - y.double().numpy()) / exact.norm())
    return float((y.double() - exact).norm() / exact.norm()), from_simulator, sent, code.components, rescales


@pytest.mark.parametrize("packet", ["float16", "bfloat16"])
def test_sixteen_bit_packets(packet: str) -> None:
    world, d = 4, 100_003
    for err, from_simulator, sent, c, rescales in check(run_ranks(_sixteen_bit_worker, world, packet, timeout=120)):
        # Issue goal at c = 2N: float16 <= 3e-2 (predicted 1.6e-2); bfloat16 predicted 4.5e-2.
        assert err < (3e-2 if packet == "float16" else 6e-2), err
        assert from_simulator < max(err, 1e-3)  # the same protocol and rounding, summed in another order
        assert c == 2 * world
        assert sent == (c + world - 2) * -(-d // c) * 2  # 16-bit packets, counted at the transport
        if packet == "float16":  # first call measured up front; x2 fits; x64 and /4096 do not
            assert rescales == [0, 0, 1, 2], rescales
        else:  # bfloat16 has float32's exponent range: nothing to rescale
            assert rescales == [0, 0, 0, 0], rescales


def _drifting_worker(rank: int, world: int) -> tuple[int, float]:
    """Gradients' magnitudes drift over training; twelve calls growing 1.6x each, then twelve
    shrinking as much (6.5 binades each way): 16-bit packets follow the drift."""
    x = torch.randn(20_000, generator=torch.Generator().manual_seed(rank))
    stats, worst = cerar.CommStats(), 0.0
    for k in [*range(12), *range(12, -1, -1)]:
        y = x * 1.6**k
        exact = _gather(y).double().sum(0)
        cerar.all_reduce(y, packet_dtype=torch.float16, stats=stats)
        worst = max(worst, float((y.double() - exact).norm() / exact.norm()))
    return stats.rescales, worst


def test_sixteen_bit_packets_follow_a_slow_drift_without_redoing_a_call() -> None:
    """Each call re-centres the next call's packet scale once the data has drifted a binade
    from it: a redo (a whole call sent again) is left to jumps beyond the window's room."""
    for rescales, worst in check(run_ranks(_drifting_worker, 4, timeout=120)):
        assert rescales == 0, rescales  # without re-centring: 6 (a redo every 3 calls)
        assert worst < 3e-2, worst


def _bad_wire_worker(rank: int, world: int) -> str:
    try:
        cerar.all_reduce(torch.ones(10), wire_dtype=torch.int8)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_bad_wire_dtype_names_the_argument() -> None:
    for message in check(run_ranks(_bad_wire_worker, 2, timeout=30)):
        assert "Argument 'wire_dtype'" in message and "torch.int8" in message
