"""Codes that spread their seam (rank i encodes Z^i X_i): maths, simulator and collective."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.distributed as dist

import cerar
from cerar.coding import codes
from cerar.coding.linear_code import Code
from multirank import check, run_ranks


def _spread(code: Code) -> Code:
    data = code.to_dict()
    data["spread_seam"] = True
    return Code.from_dict(data)


CASES = [(3, 6), (4, 8), (4, 12), (5, 13), (8, 16), (8, 24)]


@pytest.mark.parametrize(("world", "c"), CASES)
def test_node_route_bound_matches_explicit_source_errors(world: int, c: int) -> None:
    code = _spread(codes.perturbed(world, c))
    for j in range(world):
        errors = code.source_errors(j)
        assert sum(errors.values()) == pytest.approx(np.zeros((c, c)), abs=1e-8)  # exact on the shared part
        explicit = math.sqrt(sum(np.linalg.norm(e, 2) ** 2 for e in errors.values()))
        assert code.error_bound[j] == pytest.approx(explicit, rel=1e-6, abs=1e-12)


@pytest.mark.parametrize(("world", "c"), CASES)
def test_float64_simulation_within_bound_and_exact_on_common_part(world: int, c: int) -> None:
    code = _spread(codes.perturbed(world, c))
    rng = np.random.default_rng(world * 100 + c)
    x = rng.standard_normal((world, 40 * c))
    result = cerar.simulate(code, x, packet_dtype="fp64")
    assert np.all(result.errors <= result.error_bounds * (1 + 1e-6) + 1e-9 * np.linalg.norm(result.exact))
    same = np.repeat(rng.standard_normal((1, 40 * c)), world, axis=0)
    assert cerar.simulate(code, same, packet_dtype="fp64").worst_relative_error < 1e-8


@pytest.mark.parametrize(("world", "c"), [(4, 8), (4, 16), (8, 24)])
def test_spreading_beats_the_plain_code_in_float32(world: int, c: int) -> None:
    plain = codes.perturbed(world, c)
    x = np.random.default_rng(7).standard_normal((world, 1000 * c))
    plain_error = cerar.simulate(plain, x).worst_relative_error
    spread_error = cerar.simulate(_spread(plain), x).worst_relative_error
    assert spread_error < 0.8 * plain_error


def test_json_round_trip_and_argument_checks() -> None:
    code = _spread(codes.perturbed(4, 8))
    again = Code.from_json(code.to_json())
    assert again.spread_seam and again == code and "seam spread" in repr(again)
    assert not Code.from_json(codes.perturbed(4, 8).to_json()).spread_seam
    with pytest.raises(ValueError, match="spread_seam"):
        Code(4, codes.perturbed(4, 8).rows, spread_seam=True)
    with pytest.raises(ValueError, match="reference"):
        Code.from_nodes(4, [1.0], [0.5], reference="A", spread_seam=True)
    with pytest.raises(ValueError, match="odd world_size"):
        Code.from_nodes(3, [1.0, 1.0], [0.0, math.pi], spread_seam=True)
    with pytest.raises(TypeError, match="spread_seam"):
        Code.from_nodes(4, [1.0], [0.5], spread_seam=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="source_errors"):
        code.wrap_errors(1)


def _collective_worker(rank: int, world: int) -> float:
    code = _spread(codes.perturbed(world, 2 * world))
    x = torch.randn(3001, generator=torch.Generator().manual_seed(rank))
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x)
    cerar.all_reduce(x, code=code)
    simulated = cerar.simulate(code, torch.stack(parts))
    exact = float(np.linalg.norm(simulated.exact))
    return float(np.linalg.norm(simulated.outputs[rank] - x.double().numpy())) / exact


@pytest.mark.multirank
def test_collective_runs_spread_codes_like_the_simulator() -> None:
    for difference in check(run_ranks(_collective_worker, 3, timeout=60)):
        assert difference < 1e-3  # the same protocol: agree to about the error itself
