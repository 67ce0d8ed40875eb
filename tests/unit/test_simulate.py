"""The simulator: accounting, accuracy against the code's bounds and model, inputs, precisions."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from cerar import SimulationResult, codes, simulate
from cerar.coding.precision import ITEMSIZE, PRECISIONS, UNIT_ROUNDOFF, precision_name, rounder
from cerar.protocol.simulate import stack_inputs

# ---------------------------------------------------------------------------------------------
# Accounting


@pytest.mark.parametrize(
    ("n_ranks", "c", "d"), [(2, 1, 5), (2, 3, 7), (3, 3, 9), (4, 8, 1000), (5, 13, 130), (6, 7, 1)]
)
def test_rounds_values_and_memory(n_ranks: int, c: int, d: int) -> None:
    code = codes.perturbed(n_ranks, c, 0.01) if c > n_ranks else codes.perturbed(n_ranks, c)
    inputs = np.random.default_rng(d).standard_normal((n_ranks, d))
    result = simulate(code, inputs)
    assert isinstance(result, SimulationResult)
    m = math.ceil(d / c)
    assert result.rounds == c + n_ranks - 2 == code.rounds
    assert result.packet_values == m
    np.testing.assert_array_equal(result.values_sent, np.full(n_ranks, (c + n_ranks - 2) * m))
    np.testing.assert_array_equal(result.values_received, result.values_sent)
    assert result.outputs.shape == (n_ranks, d) and result.exact.shape == (d,)
    np.testing.assert_array_equal(result.inputs, inputs)
    # Working memory: reported, at least the packet in hand, and no more than the protocol's N
    # packets beyond the rank's own data (the c observations that become the output aside).
    working = result.peak_working_packets
    assert working.shape == (n_ranks,)
    assert np.all(working >= 1) and np.all(working <= n_ranks)
    np.testing.assert_array_equal(result.peak_packets - working, np.full(n_ranks, 2 * c))


def test_comm_rate_matches_values_sent() -> None:
    code = codes.perturbed(8, 32, 0.01)
    d = 32 * 50
    result = simulate(code, np.ones((8, d)))
    assert result.values_sent[0] / d == pytest.approx(code.comm_rate)
    assert code.comm_rate < code.ring_comm_rate  # c > N: less traffic than ring all-reduce


# ---------------------------------------------------------------------------------------------
# Accuracy


@pytest.mark.parametrize(
    "make",
    [
        lambda: codes.perturbed(4, 8, 0.01),
        lambda: codes.perturbed(5, 13, 0.03),
        lambda: codes.perturbed(6, 20, 0.02, reference="A"),
        # Poor codes at fp32 (the error limit's precision), simulated at fp64: max_error=None.
        lambda: codes.perturbed(8, 30, 0.05, max_error=None),
        lambda: codes.vandermonde(4, 6, 0.05, max_error=None),
        lambda: codes.vandermonde(5, 7, 0.03, reference="A", max_error=None),
        lambda: codes.exact(7),
    ],
)
@pytest.mark.parametrize("shared", [0.0, 3.0])
def test_float64_error_within_error_bound(make, shared: float) -> None:
    code = make()
    n_ranks, c = code.world_size, code.components
    rng = np.random.default_rng(c)
    d = 40 * c + 3
    inputs = shared * rng.standard_normal(d) + rng.standard_normal((n_ranks, d))
    result = simulate(code, inputs, "fp64")
    beta = code.error_bound
    expected = beta * np.array([code.error_scale(inputs, j) for j in range(n_ranks)])
    np.testing.assert_allclose(result.error_bounds, expected, rtol=1e-12)
    rounding = 1e-13 * float(np.max(code.cond)) * float(np.linalg.norm(inputs))
    errors = result.errors
    assert np.all(errors <= result.error_bounds * (1 + 1e-9) + rounding), (errors, result.error_bounds)
    if not code.is_exact:
        # The bound is not vacuous: the worst rank gets within a modest factor of it.
        interior = slice(1, n_ranks - 1)
        assert np.max(errors[interior] / result.error_bounds[interior]) > 0.1


@pytest.mark.parametrize("reference", ["mixed", "A"])
def test_error_scale_definition(reference: str) -> None:
    code = codes.perturbed(4, 8, 0.01, reference=reference)
    inputs = np.random.default_rng(1).standard_normal((4, 3, 5))
    flat = inputs.reshape(4, -1)
    for j in range(4):
        others = np.delete(flat, j, axis=0)
        if reference == "mixed":
            others = others - others.mean(axis=0)
        assert code.error_scale(inputs, j) == pytest.approx(np.linalg.norm(others))


@pytest.mark.parametrize(("n_ranks", "c"), [(3, 7), (4, 8), (5, 13), (8, 24)])
def test_mixed_reference_exact_on_identical_inputs(n_ranks: int, c: int) -> None:
    code = codes.perturbed(n_ranks, c, 0.02)
    x = np.random.default_rng(c).standard_normal(17 * c)
    inputs = np.tile(x, (n_ranks, 1))
    result = simulate(code, inputs, "fp64")
    assert np.all(result.error_bounds < 1e-12 * np.linalg.norm(inputs))
    assert result.worst_relative_error < 1e-14 * float(np.max(code.cond))
    # In float32 only rounding is left (amplified by cond at most).
    fp32 = simulate(code, inputs, "fp32")
    assert fp32.worst_relative_error < 10 * float(np.max(code.cond)) * UNIT_ROUNDOFF["fp32"]
    # Reference A does not have this property.
    assert simulate(code.with_reference("A"), inputs, "fp64").worst_relative_error > 1e-4


@pytest.mark.parametrize(("n_ranks", "c"), [(4, 8), (4, 12), (8, 16)])
def test_float32_error_agrees_with_model(n_ranks: int, c: int) -> None:
    code = codes.perturbed(n_ranks, c)  # delta tuned for fp32
    inputs = np.random.default_rng(0).standard_normal((n_ranks, 500 * c))
    simulated = simulate(code, inputs, "fp32").relative_errors
    predicted = code.predicted_error("fp32")
    assert np.all(simulated <= 1.2 * predicted), (simulated, predicted)
    # The model is calibrated: the worst rank lands within a factor 2 of its prediction.
    assert 0.5 * np.max(predicted) <= np.max(simulated), (simulated, predicted)
    # The fp32 worst rank sits near the floor u^(1/(r+1)) of docs/protocol.md, "Where the error floor comes from" (10x).
    r = math.ceil(c / n_ranks) - 1
    floor = UNIT_ROUNDOFF["fp32"] ** (1 / (r + 1))
    assert floor / 10 < np.max(simulated) < 10 * floor


def test_packet_precisions_order() -> None:
    code = codes.exact(4)
    inputs = np.random.default_rng(2).standard_normal((4, 400))
    errors = {p: simulate(code, inputs, p).worst_relative_error for p in PRECISIONS}
    assert errors["fp64"] < 1e-14
    for p in ("fp32", "fp16", "bf16"):
        assert UNIT_ROUNDOFF[p] / 100 < errors[p] < 10 * UNIT_ROUNDOFF[p], (p, errors[p])


def test_nonfinite_input_spreads_to_every_rank() -> None:
    # docs/protocol.md, "Non-finite inputs": a NaN reaches its column (all c components) on every rank.
    code = codes.perturbed(4, 8, 0.01)
    inputs = np.random.default_rng(0).standard_normal((4, 80))
    inputs[2, 5] = np.nan
    outputs = simulate(code, inputs).outputs
    assert all(np.any(~np.isfinite(outputs[j])) for j in range(4))


# ---------------------------------------------------------------------------------------------
# Inputs


def test_inputs_forms() -> None:
    code = codes.perturbed(3, 5, 0.05)
    rng = np.random.default_rng(0)
    array = rng.standard_normal((3, 4, 6))
    by_array = simulate(code, array, "fp64")
    assert by_array.outputs.shape == (3, 24)
    by_list = simulate(code, [array[0], array[1], array[2]], "fp64")
    np.testing.assert_array_equal(by_list.outputs, by_array.outputs)
    by_torch = simulate(code, [torch.from_numpy(a) for a in array], "fp64")
    np.testing.assert_array_equal(by_torch.outputs, by_array.outputs)
    by_tensor = simulate(code, torch.from_numpy(array), "fp64")
    np.testing.assert_array_equal(by_tensor.outputs, by_array.outputs)
    bf16 = torch.from_numpy(array).to(torch.bfloat16)
    by_bf16 = simulate(code, bf16, "fp64")  # bf16 has no numpy view: converted through float64
    np.testing.assert_array_equal(by_bf16.inputs, bf16.double().reshape(3, -1).numpy())
    integers = simulate(code, np.arange(30).reshape(3, 10), "fp64")
    np.testing.assert_allclose(integers.exact, np.arange(30).reshape(3, 10).sum(axis=0))
    scalars = simulate(code, [1.0, 2.0, 3.0], "fp64")
    assert scalars.outputs.shape == (3, 1)
    np.testing.assert_allclose(scalars.outputs[[0, 2], 0], 6.0)


@pytest.mark.parametrize(
    ("inputs", "error", "name", "value"),
    [
        (np.ones((3, 10)), ValueError, "inputs", "3"),
        (np.ones((5, 10)), ValueError, "inputs", "5"),
        ([np.ones(3)] * 3, ValueError, "inputs", "3"),
        ([np.ones(3), np.ones(3), np.ones(3), np.ones(4)], ValueError, "inputs", "(4,)"),
        (
            [np.ones((2, 3)), np.ones((2, 3)), np.ones((2, 3)), np.ones((3, 2))],
            ValueError,
            "inputs",
            "(3, 2)",
        ),
        (np.ones((4, 0)), ValueError, "inputs", "(0,)"),
        (np.ones((4, 3), dtype=complex), TypeError, "inputs", "complex128"),
        (np.array([["a"]] * 4), TypeError, "inputs", "<U1"),
        ("abcd", TypeError, "inputs", "str"),
        (None, TypeError, "inputs", "NoneType"),
        (4.0, TypeError, "inputs", "float"),
    ],
)
def test_invalid_inputs(inputs, error: type[Exception], name: str, value: str) -> None:
    code = codes.perturbed(4, 8, 0.01)
    with pytest.raises(error) as info:
        simulate(code, inputs)
    message = str(info.value)
    assert f"'{name}'" in message and value in message, message


@pytest.mark.parametrize(
    ("kwargs", "error", "name", "value"),
    [
        ({"packet_dtype": "fp4"}, ValueError, "packet_dtype", "'fp4'"),
        ({"packet_dtype": None}, ValueError, "packet_dtype", "None"),
        ({"packet_dtype": np.int32}, ValueError, "packet_dtype", "int32"),
        ({"packet_dtype": torch.int64}, ValueError, "packet_dtype", "torch.int64"),
        ({"code": "perturbed"}, TypeError, "code", "str"),
        ({"code": None}, TypeError, "code", "NoneType"),
    ],
)
def test_invalid_simulate_arguments(kwargs: dict, error: type[Exception], name: str, value: str) -> None:
    arguments = {"code": codes.exact(4), "inputs": np.ones((4, 8)), **kwargs}
    with pytest.raises(error) as info:
        simulate(**arguments)
    message = str(info.value)
    assert f"'{name}'" in message and value in message, message


def test_stack_inputs_names_its_argument() -> None:
    with pytest.raises(ValueError, match=r"'grads'.*2"):
        stack_inputs(np.ones((2, 3)), 3, name="grads")


# ---------------------------------------------------------------------------------------------
# Precisions and the rounder


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("fp32", "fp32"),
        ("float32", "fp32"),
        ("float", "fp32"),
        ("double", "fp64"),
        ("half", "fp16"),
        ("bfloat16", "bf16"),
        (np.float32, "fp32"),
        (np.float64, "fp64"),
        (np.float16, "fp16"),
        (np.dtype("float32"), "fp32"),
        (torch.float32, "fp32"),
        (torch.float64, "fp64"),
        (torch.float16, "fp16"),
        (torch.bfloat16, "bf16"),  # not "fp16": its name ends in "float16"
    ],
)
def test_precision_names(value, expected: str) -> None:
    assert precision_name(value) == expected


def test_precision_tables() -> None:
    assert set(UNIT_ROUNDOFF) == set(ITEMSIZE) == set(PRECISIONS)
    for p in PRECISIONS:
        x = np.float64(1.0) + 3 * UNIT_ROUNDOFF[p]  # representable above 1 only after rounding
        assert rounder(p)(np.array([x]))[0] != 1.0 or p == "fp64"


def _awkward_float32(rng: np.random.Generator, size: int) -> np.ndarray:
    values = rng.standard_normal(size) * np.exp2(rng.integers(-140, 128, size))
    bits = rng.integers(0, 2**32, size // 4, dtype=np.uint64).astype(np.uint32)
    raw = bits.view(np.float32)
    with np.errstate(over="ignore"):
        values = np.concatenate([values.astype(np.float32), raw])
    ties = (rng.integers(0, 2**16, 1000, dtype=np.uint32) << np.uint32(16)) | np.uint32(0x8000)
    ties = ties[(ties & np.uint32(0x7F800000)) != np.uint32(0x7F800000)].view(np.float32)
    specials = np.array(
        [0.0, -0.0, np.inf, -np.inf, np.nan, 3.4028235e38, -3.4028235e38, 1e-45, -1e-45, 1.17549435e-38],
        dtype=np.float32,
    )
    return np.concatenate([values, ties, specials])


def test_bf16_rounder_matches_torch() -> None:
    rng = np.random.default_rng(0)
    x = _awkward_float32(rng, 200_000)
    ours = rounder("bf16")(x)
    assert ours.dtype == np.float32
    theirs = torch.from_numpy(x).to(torch.bfloat16).to(torch.float32).numpy()
    nan = np.isnan(theirs)
    np.testing.assert_array_equal(np.isnan(ours), nan)
    np.testing.assert_array_equal(ours[~nan].view(np.uint32), theirs[~nan].view(np.uint32))  # bit-exact
    # float64 data: the simulator rounds to float32 first, as torch's conversion does.
    y = rng.standard_normal(50_000) * 10.0 ** rng.uniform(-20, 20, 50_000)
    ours64 = rounder("bf16")(y)
    theirs64 = torch.from_numpy(y).to(torch.bfloat16).to(torch.float32).numpy()
    np.testing.assert_array_equal(ours64, theirs64)


def test_fp16_and_fp32_rounders_match_torch() -> None:
    rng = np.random.default_rng(1)
    y = rng.standard_normal(50_000) * 10.0 ** rng.uniform(-9, 6, 50_000)
    for name, dtype in (("fp16", torch.float16), ("fp32", torch.float32)):
        for data in (y, y.astype(np.float32)):  # torch casts float64 -> float16 through float32
            with np.errstate(over="ignore"):  # above 65504: inf, in both
                ours = rounder(name)(data)
            theirs = torch.from_numpy(data).to(dtype).to(torch.float64).numpy()
            np.testing.assert_array_equal(ours.astype(np.float64), theirs)
    np.testing.assert_array_equal(rounder("fp64")(y), y)


@pytest.mark.parametrize("wire", ["int8", "fp8"])
def test_simulate_with_8bit_packets(wire: str) -> None:
    from cerar.coding.blocks import BlockFormat

    code = codes.perturbed(4, 8, 0.05, max_error=None)
    x = np.random.default_rng(3).standard_normal((4, 8 * 512))
    fmt = BlockFormat(wire, 32, "bf16")
    result = simulate(code, x, wire, block_format=fmt)
    exact_arithmetic = simulate(code, x, "fp64").worst_relative_error
    # The packets' rounding adds error to the code's own, and stays below the 8-bit wire's scale.
    assert exact_arithmetic < result.worst_relative_error < 1.0
    assert result.values_sent.tolist() == [(8 + 4 - 2) * 512] * 4
    # The default block format is BlockFormat()'s, with the wire asked for.
    default = simulate(code, x, wire)
    same = simulate(code, x, wire, block_format=BlockFormat("int8" if wire == "fp8" else "fp8"))
    assert np.array_equal(default.outputs, same.outputs)
    with pytest.raises(ValueError, match="'block_format'"):
        simulate(code, x, "fp16", block_format=fmt)
    with pytest.raises(TypeError, match="'block_format'"):
        simulate(code, x, wire, block_format=wire)
