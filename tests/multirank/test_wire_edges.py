"""Every wire's edges, tried as a demanding user would (issue 61's adversarial pass): the DDP hooks'
non-finite policy on the block wires, values beyond or below float32's range, a sum that overflows
at one element, tensors whose blocks' scales would be subnormal, inputs that cancel, ``max_error``
on every row, the hierarchical ring with a wire, ranks that call different rows, and the one rule
that picks the default code wherever a call comes from."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch

from multirank import RankFailure, check, run_ranks

pytestmark = pytest.mark.multirank

BLOCK_ROWS = ("ring-int8", "ring-fp8", "ring-int4")


def _bound(row: str, n: int) -> float:
    from cerar.comm.collective.routes import get_route

    return get_route(row).error_bound(n)


# ---------------------------------------------------------------------------------------------
# The DDP hooks of the block wires follow the state's non-finite policy


def _hook_worker(rank: int, world: int, row: str, policy: str) -> tuple[np.ndarray, int, int]:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import cerar

    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(64, 64, bias=False))
    state = cerar.ddp.CerarState(nonfinite=policy, min_bucket_bytes=0, max_error=None)  # int4's bound exceeds 0.1
    model.register_comm_hook(state, cerar.ddp.get_hook(row))
    torch.manual_seed(1 + rank)
    x = torch.randn(8, 64)
    if rank == 1:
        x[0, 0] = float("nan")
    model(x).sum().backward()
    grad = model.module.weight.grad.detach().numpy().copy()
    dist.barrier()
    return grad, state.stats.fallbacks, state.stats.nonfinite_events


@pytest.mark.parametrize("row", ["ring-int8", "ring-int4"])
def test_block_hooks_fall_back_under_exact_and_raise_under_raise(row: str) -> None:
    exact = check(run_ranks(_hook_worker, 3, row, "exact", timeout=120))
    for grad, fallbacks, events in exact:
        assert fallbacks == 1 and events == 1
        assert grad.tobytes() == exact[0][0].tobytes()  # every rank the same: the exact ring's
    failed = run_ranks(_hook_worker, 3, row, "raise", timeout=120)
    assert all(isinstance(r, RankFailure) and "NonFiniteError" in r.message + r.type_name for r in failed), failed


def test_block_hook_ignore_keeps_nan_to_its_blocks() -> None:
    results = check(run_ranks(_hook_worker, 3, "ring-int8", "ignore", timeout=120))
    for grad, fallbacks, events in results:
        assert fallbacks == 0 and events == 1
        assert 0 < np.isnan(grad).sum() < grad.size  # the blocks that held it, not the whole gradient
        assert grad.tobytes() == results[0][0].tobytes()


# ---------------------------------------------------------------------------------------------
# Range: every wire scales the data by a power of two where float32 or the scales need it


def _range_worker(rank: int, world: int, row: str, dtype: str, magnitude: float) -> tuple[np.ndarray, np.ndarray]:
    import cerar

    g = torch.Generator().manual_seed(10 + rank)
    x = (torch.randn(5000, generator=g, dtype=torch.float64) * magnitude).to(getattr(torch, dtype))
    given = x.clone()
    cerar.all_reduce(x, method=row, max_error=None)
    return given.numpy(), x.numpy()


@pytest.mark.parametrize("row", BLOCK_ROWS)
@pytest.mark.parametrize(
    ("dtype", "magnitude"), [("float64", 1e300), ("float64", 1e-300), ("float32", 1e-38), ("float32", 1e-41)]
)
def test_values_beyond_and_below_float32_come_back_within_the_bound(row: str, dtype: str, magnitude: float) -> None:
    results = check(run_ranks(_range_worker, 3, row, dtype, magnitude, timeout=120))
    inputs = np.stack([r[0] for r in results]).astype(np.float64) / magnitude  # norms in range
    total = inputs.sum(0)
    for _, out in results:
        assert out.tobytes() == results[0][1].tobytes()
        error = np.linalg.norm(out.astype(np.float64) / magnitude - total) / np.linalg.norm(total)
        assert error < 1.5 * _bound(row, 3), (row, dtype, magnitude, error)


def _overflow_worker(rank: int, world: int) -> np.ndarray:
    import cerar

    x = torch.full((1000,), 1.0 + rank)
    x[5] = 3e38  # the sum of three overflows float32 there, as torch's sum does
    cerar.all_reduce(x, method="ring-int8")
    return x.numpy()


def test_a_sum_that_overflows_at_one_element_is_infinite_there_only() -> None:
    results = check(run_ranks(_overflow_worker, 3, timeout=120))
    for out in results:
        assert np.isposinf(out[5]) and np.isfinite(np.delete(out, 5)).all()  # not its whole block NaN
        # Its block's other values are below its scale's step (absmax blocks); the others are sums.
        assert np.allclose(out[64:], 6.0, rtol=2e-2)


def _cancel_worker(rank: int, world: int, row: str) -> tuple[np.ndarray, np.ndarray]:
    import cerar

    g = torch.Generator().manual_seed(3)
    x = torch.randn(20000, generator=g) * (1 if rank % 2 == 0 else -1)  # the sum is exactly zero
    given = x.clone()
    cerar.all_reduce(x, method=row, max_error=None)
    return given.numpy(), x.numpy()


@pytest.mark.parametrize("row", BLOCK_ROWS)
def test_inputs_that_cancel_err_within_the_bound_relative_to_the_inputs(row: str) -> None:
    results = check(run_ranks(_cancel_worker, 4, row, timeout=120))
    inputs = np.stack([r[0] for r in results]).astype(np.float64)
    scale = math.sqrt(float((inputs**2).sum()))  # the root-sum-square of the ranks' inputs
    for _, out in results:
        assert np.linalg.norm(out.astype(np.float64) - inputs.sum(0)) / scale < _bound(row, 4)


# ---------------------------------------------------------------------------------------------
# max_error on every row; the hierarchical ring with a wire; ranks that call different rows


def test_max_error_refuses_rows_predicted_above_it() -> None:
    from cerar.comm.collective.routes import get_route

    with pytest.raises(ValueError, match=r"Argument 'max_error' is 0.0001.*'ring-int8'"):
        get_route("ring-int8").check_error(4, 1e-4)
    get_route("ring-int8").check_error(4, 0.1)
    get_route("ring-fp8").check_error(14, 0.1)
    with pytest.raises(ValueError, match="'ring-fp8'"):
        get_route("ring-fp8").check_error(15, 0.1)  # its bound passes the default from N = 15
    get_route("ring").check_error(64, 1e-6)


def _max_error_worker(rank: int, world: int) -> str:
    import cerar

    x = torch.randn(1000)
    try:
        cerar.all_reduce(x, method="ring-int8", max_error=1e-4)
    except ValueError as exc:
        first = str(exc)
    else:
        return "accepted"
    try:
        cerar.new_group(method="ring-int8", max_error=1e-4)
    except ValueError as exc:
        return first + " | " + str(exc)
    return "group accepted"


def test_max_error_is_checked_by_the_call_and_by_the_group() -> None:
    for message in check(run_ranks(_max_error_worker, 2, timeout=120)):
        assert message.count("Argument 'max_error' is 0.0001") == 2, message


def _hier_worker(rank: int, world: int) -> tuple[str, str, np.ndarray, np.ndarray, int]:
    import cerar

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        group = cerar.new_group(method="ring", packet_dtype=torch.int8, ranks_per_node=2, min_bytes=0)
    warned = " ".join(str(w.message) for w in caught if issubclass(w.category, DeprecationWarning))
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(40000, generator=g)
    given = x.clone()
    torch.distributed.all_reduce(x, group=group)
    stats = cerar.collective.get_stats(group.transport)
    cerar.shutdown()
    return group.settings.method, warned, given.numpy(), x.numpy(), stats.bytes_sent


def test_the_old_hierarchical_int8_form_runs_the_int8_ring_between_nodes() -> None:
    results = check(run_ranks(_hier_worker, 4, timeout=180))
    inputs = np.stack([r[2] for r in results]).astype(np.float64)
    for method, warned, _, out, sent in results:
        assert method == "hier-ring-int8" and "method='hier-ring-int8'" in warned
        error = np.linalg.norm(out - inputs.sum(0)) / np.linalg.norm(inputs.sum(0))
        assert 1e-4 < error < _bound("ring-int8", 2)  # rounded by the 8-bit wire, not exact
        assert sent < 40000 * 4 / 2  # a quarter-sized shard each way in about a byte a value
    assert all(r[3].tobytes() == results[0][3].tobytes() for r in results)


def _different_rows_worker(rank: int, world: int) -> None:
    import cerar

    cerar.all_reduce(torch.randn(1000), method="exact" if rank == 0 else "ring-int8")


def test_ranks_that_call_exact_and_a_ring_raise_a_mismatch_on_every_rank() -> None:
    results = run_ranks(_different_rows_worker, 3, timeout=60, pg_timeout=20)
    for result in results:
        assert isinstance(result, RankFailure) and result.type_name == "SettingsMismatchError", result


# ---------------------------------------------------------------------------------------------
# One rule picks the default code, wherever the call comes from


def _one_rule_worker(rank: int, world: int) -> dict[str, int]:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import cerar

    fp16, limit = torch.float16, 1e-2
    c = {}
    stats = cerar.CommStats()
    cerar.all_reduce(torch.randn(4096), method="cerar-fp16", max_error=limit, stats=stats)
    c["all_reduce"] = stats.rounds - (world - 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        group = cerar.new_group(packet_dtype=fp16, max_error=limit, min_bytes=0)  # the case issue 61 found
    before = cerar.collective.get_stats(group.transport).rounds
    dist.all_reduce(torch.randn(4096), group=group)
    c["group"] = cerar.collective.get_stats(group.transport).rounds - before - (world - 2)
    state = cerar.ddp.CerarState(packet_dtype=fp16, max_error=limit, min_bucket_bytes=0)
    model = DDP(torch.nn.Linear(64, 64))
    model.register_comm_hook(state, cerar.ddp.get_hook("cerar-fp16"))
    model(torch.randn(4, 64)).sum().backward()
    c["hook"] = state.code.components
    stats = cerar.CommStats()
    cerar.hierarchical_all_reduce(torch.randn(4096), ranks_per_node=1, packet_dtype=fp16, max_error=limit, stats=stats)
    c["hierarchical"] = stats.rounds - (world - 2)
    cerar.shutdown()
    return c


def test_the_group_the_call_the_hook_and_the_hierarchical_call_pick_the_same_code() -> None:
    from cerar.comm.collective.default_code import code_within

    expected = code_within(4, "fp16", 1e-2).components
    for picked in check(run_ranks(_one_rule_worker, 4, timeout=240)):
        assert picked == dict.fromkeys(("all_reduce", "group", "hook", "hierarchical"), expected), picked
