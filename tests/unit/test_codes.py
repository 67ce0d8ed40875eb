"""Constructions: exact, perturbed roots of unity, Vandermonde; their scalings, checked by simulation."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from cerar import Code, codes, simulate
from cerar.coding.linear_code import SingularCodeError


def _slope(x: list[float] | np.ndarray, y: list[float] | np.ndarray) -> float:
    return float(np.polyfit(np.log(x), np.log(y), 1)[0])


# ---------------------------------------------------------------------------------------------
# exact


@pytest.mark.parametrize("n_ranks", range(2, 17))
def test_exact_code_sums_to_float32_rounding(n_ranks: int) -> None:
    code = codes.exact(n_ranks)
    assert code.components == n_ranks and code.construction == "exact"
    rng = np.random.default_rng(n_ranks)
    inputs = rng.standard_normal((n_ranks, 300 * n_ranks + 1)).astype(np.float32)
    result = simulate(code, inputs, "fp32")
    exact_sum = inputs.astype(np.float64).sum(axis=0)
    np.testing.assert_array_equal(result.exact, exact_sum)
    errors = np.linalg.norm(result.outputs - exact_sum, axis=1) / np.linalg.norm(exact_sum)
    assert errors.shape == (n_ranks,)
    assert np.all(errors < 1e-6), errors


# ---------------------------------------------------------------------------------------------
# cluster sizes


def test_cluster_sizes_even_and_symmetric() -> None:
    for n_ranks in range(2, 21):
        for c in range(1, 4 * n_ranks + 1):
            sizes = codes.cluster_sizes(n_ranks, c)
            assert len(sizes) == n_ranks and sum(sizes) == c
            assert max(sizes) - min(sizes) <= 1
            assert max(sizes) == math.ceil(c / n_ranks)
            for k in range(1, n_ranks):
                assert sizes[k] == sizes[n_ranks - k], (n_ranks, c, sizes)


@pytest.mark.parametrize(
    ("n_ranks", "c"), [(2, 3), (3, 5), (4, 7), (4, 8), (5, 13), (6, 17), (8, 12), (9, 36)]
)
def test_perturbed_node_clusters(n_ranks: int, c: int) -> None:
    delta = 0.01
    code = codes.perturbed(n_ranks, c, delta)
    nodes = code.nodes
    assert nodes is not None and len(nodes) == c
    np.testing.assert_allclose(np.abs(nodes), 1.0)
    # Each node within its cluster: angle relative to the nearest root of unity.
    angle = np.angle(nodes)
    k = np.round(angle * n_ranks / (2 * math.pi))
    offset = angle - 2 * math.pi * k / n_ranks
    sizes = codes.cluster_sizes(n_ranks, c)
    counts = np.bincount(k.astype(int) % n_ranks, minlength=n_ranks)
    assert counts.tolist() == sizes
    for cluster in range(n_ranks):
        expected = delta * (np.arange(sizes[cluster]) - (sizes[cluster] - 1) / 2)
        got = np.sort(offset[k.astype(int) % n_ranks == cluster])
        np.testing.assert_allclose(got, expected, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# perturbed: error O(delta), cond O(delta^-r)


PERTURBED_CASES = [(3, 5), (4, 8), (4, 11), (5, 13), (4, 16), (6, 24), (8, 12)]


@pytest.mark.parametrize(("n_ranks", "c"), PERTURBED_CASES)
def test_perturbed_scalings_in_float64(n_ranks: int, c: int) -> None:
    assert n_ranks < c <= 4 * n_ranks
    r = math.ceil(c / n_ranks) - 1
    deltas = np.array([1e-2, 3e-3, 1e-3]) if r < 3 else np.array([3e-2, 1e-2, 3e-3])
    inputs = np.random.default_rng(c).standard_normal((n_ranks, 64 * c))
    errors, conds = [], []
    for delta in deltas:
        # Simulated at fp64: the fp32 error limit does not apply (max_error=None).
        code = codes.perturbed(n_ranks, c, float(delta), max_error=None)
        result = simulate(code, inputs, "fp64")
        errors.append(result.worst_relative_error)
        conds.append(float(np.max(code.cond)))
    assert abs(_slope(deltas, errors) - 1) <= 0.15, errors
    assert abs(_slope(deltas, conds) + r) <= 0.3, conds
    assert errors[-1] < errors[0] / 5


def test_perturbed_cond_same_order_for_every_rank() -> None:
    # Nodes on the unit circle: cond(M_j) is the same for every j; the weighted system of the
    # mixed decoder changes it by a bounded factor only.
    code = codes.perturbed(8, 20, 1e-2)
    cond = code.cond
    assert cond.max() / cond.min() < 3


@pytest.mark.parametrize(("n_ranks", "c"), [(4, 8), (4, 12), (8, 16)])
def test_perturbed_default_delta_balances_wrap_and_rounding(n_ranks: int, c: int) -> None:
    # docs/protocol.md, "Where the error floor comes from": the fp32 best delta is about u^(1/(r+1)) (modest factor).
    r = math.ceil(c / n_ranks) - 1
    code = codes.perturbed(n_ranks, c)
    delta = code.params["delta"]
    assert code.params["precision"] == "fp32"
    guess = (2.0**-24) ** (1 / (r + 1))
    assert guess / 30 < delta < guess * 30, (delta, guess)
    # It is a local optimum of the predicted error.
    worst = code.predicted_worst_error("fp32")
    for factor in (0.5, 2.0):
        other = codes.perturbed(n_ranks, c, delta * factor)
        assert other.predicted_worst_error("fp32") > worst
    # fp64 packets allow a much smaller delta.
    assert codes.perturbed(n_ranks, c, precision="fp64").params["delta"] < delta / 10


def test_perturbed_c_at_most_n_is_exact() -> None:
    for n_ranks, c in [(4, 1), (4, 3), (5, 5), (6, 4)]:
        code = codes.perturbed(n_ranks, c)
        assert code.is_exact, (n_ranks, c)
        assert code.params["delta"] == 0.0
        inputs = np.random.default_rng(0).standard_normal((n_ranks, 50 * c))
        assert simulate(code, inputs, "fp64").worst_relative_error < 1e-12


# ---------------------------------------------------------------------------------------------
# vandermonde


@pytest.mark.parametrize(("n_ranks", "c"), [(3, 6), (4, 6)])
def test_vandermonde_error_to_zero_and_worse_conditioned(n_ranks: int, c: int) -> None:
    inputs = np.random.default_rng(7).standard_normal((n_ranks, 64 * c))
    epsilons = [5e-2, 2e-2, 1e-2, 5e-3, 3e-3]
    v_errors, v_conds = [], []
    for eps in epsilons:
        code = codes.vandermonde(n_ranks, c, eps, max_error=None)  # the sweep's poor codes too
        assert code.construction == "vandermonde" and code.params["eps"] == eps
        v_errors.append(simulate(code, inputs, "fp64").worst_relative_error)
        v_conds.append(float(np.max(code.cond)))
    assert all(a > b for a, b in itertools.pairwise(v_errors))  # error -> 0 as eps -> 0
    assert abs(_slope(epsilons, v_errors) - 1) < 0.15
    assert v_errors[-1] < 0.05
    assert _slope(epsilons, v_conds) < -(c - 1) + 0.5  # cond ~ eps^-(c-1)

    deltas = [5e-1, 3e-1, 1e-1, 3e-2, 1e-2, 3e-3, 1e-3, 3e-4]
    p_errors, p_conds = [], []
    for delta in deltas:
        code = codes.perturbed(n_ranks, c, delta, max_error=None)
        p_errors.append(simulate(code, inputs, "fp64").worst_relative_error)
        p_conds.append(float(np.max(code.cond)))
    # The perturbed code's cond at each Vandermonde error, interpolated on log-log axes.
    assert all(a > b for a, b in itertools.pairwise(p_errors))
    log_e, log_k = np.log(p_errors[::-1]), np.log(p_conds[::-1])
    for error, cond in zip(v_errors, v_conds, strict=True):
        assert log_e[0] <= math.log(error) <= log_e[-1], (error, p_errors)
        perturbed_cond = math.exp(np.interp(math.log(error), log_e, log_k))
        assert cond > 100 * perturbed_cond, (error, cond, perturbed_cond)


def test_vandermonde_nodes_real() -> None:
    code = codes.vandermonde(4, 5, 0.1, max_error=None)
    nodes = code.nodes
    assert nodes is not None
    np.testing.assert_allclose(nodes.imag, 0)
    np.testing.assert_allclose(np.sort(nodes.real), 1.1 ** np.arange(5))


def test_vandermonde_too_small_eps_is_singular() -> None:
    code = codes.vandermonde(4, 8, 1e-4, max_error=None)  # built lazily without the limit
    with pytest.raises(SingularCodeError):
        code.decoder(1)
    with pytest.raises(ValueError, match=r"vandermonde\(N=4, c=8\) at fp32 packets cannot be decoded"):
        codes.vandermonde(4, 8, 1e-4)  # the limit's check decodes, so it refuses


def test_vandermonde_default_eps() -> None:
    code = codes.vandermonde(4, 6, max_error=None)  # its best is still above the default limit
    eps = code.params["eps"]
    assert 1e-6 <= eps <= 1.0
    assert (
        code.predicted_worst_error("fp32")
        <= codes.vandermonde(4, 6, min(1.0, 2 * eps), max_error=None).predicted_worst_error()
    )
    assert (
        code.predicted_worst_error("fp32")
        <= codes.vandermonde(4, 6, eps / 2, max_error=None).predicted_worst_error()
    )
    # The ill-conditioned limit: at its best it is far worse than the perturbed code.
    assert code.predicted_worst_error() > 3 * codes.perturbed(4, 6).predicted_worst_error()


# ---------------------------------------------------------------------------------------------
# Argument checks


@pytest.mark.parametrize(
    ("call", "error", "name", "value"),
    [
        (lambda: codes.exact(1), ValueError, "world_size", "1"),
        (lambda: codes.exact(0), ValueError, "world_size", "0"),
        (lambda: codes.exact(4.0), TypeError, "world_size", "4.0"),
        (lambda: codes.exact(True), TypeError, "world_size", "True"),
        (lambda: codes.exact("4"), TypeError, "world_size", "'4'"),
        (lambda: codes.perturbed(1, 4), ValueError, "world_size", "1"),
        (lambda: codes.perturbed(-3, 4), ValueError, "world_size", "-3"),
        (lambda: codes.perturbed(4, 0), ValueError, "components", "0"),
        (lambda: codes.perturbed(4, 8.0), TypeError, "components", "8.0"),
        (lambda: codes.perturbed(4, False), TypeError, "components", "False"),
        (lambda: codes.perturbed(4, None), TypeError, "components", "None"),
        (lambda: codes.perturbed(4, 8, math.nan), ValueError, "delta", "nan"),
        (lambda: codes.perturbed(4, 8, math.inf), ValueError, "delta", "inf"),
        (lambda: codes.perturbed(4, 8, -0.01), ValueError, "delta", "-0.01"),
        (lambda: codes.perturbed(4, 8, 0.0), ValueError, "delta", "0.0"),
        (lambda: codes.perturbed(4, 8, 1.0), ValueError, "delta", "1.0"),
        (lambda: codes.perturbed(4, 8, True), TypeError, "delta", "True"),
        (lambda: codes.perturbed(4, 8, "0.1"), TypeError, "delta", "'0.1'"),
        (lambda: codes.perturbed(4, 8, 0.01, "fp8"), ValueError, "precision", "'fp8'"),
        (lambda: codes.perturbed(4, 8, 0.01, None), ValueError, "precision", "None"),
        (lambda: codes.perturbed(4, 8, 0.01, reference="B"), ValueError, "reference", "'B'"),
        (lambda: codes.vandermonde(1, 4), ValueError, "world_size", "1"),
        (lambda: codes.vandermonde(4, 0), ValueError, "components", "0"),
        (lambda: codes.vandermonde(4, 2.5), TypeError, "components", "2.5"),
        (lambda: codes.vandermonde(4, 8, math.nan), ValueError, "eps", "nan"),
        (lambda: codes.vandermonde(4, 8, -0.1), ValueError, "eps", "-0.1"),
        (lambda: codes.vandermonde(4, 8, 0.0), ValueError, "eps", "0.0"),
        (lambda: codes.vandermonde(4, 8, 2.0), ValueError, "eps", "2.0"),
        (lambda: codes.vandermonde(4, 8, False), TypeError, "eps", "False"),
        (lambda: codes.vandermonde(4, 8, 0.1, "int8"), ValueError, "precision", "'int8'"),
        (lambda: codes.vandermonde(4, 8, 0.1, reference=""), ValueError, "reference", "''"),
        (lambda: codes.cluster_sizes(1, 4), ValueError, "world_size", "1"),
        (lambda: codes.cluster_sizes(4, 0), ValueError, "components", "0"),
    ],
)
def test_invalid_arguments(call, error: type[Exception], name: str, value: str) -> None:
    with pytest.raises(error) as info:
        call()
    message = str(info.value)
    assert f"'{name}'" in message and value in message, message


def test_numpy_integers_accepted() -> None:
    code = codes.perturbed(np.int64(4), np.int32(8), np.float64(0.01))
    assert isinstance(code, Code) and code.world_size == 4 and code.components == 8
    assert type(code.world_size) is int and type(code.components) is int


@pytest.mark.parametrize("c", [3, 8, 13])
def test_two_ranks_always_exact(c: int) -> None:
    # N = 2: rank 0 sees only wrapped packets and rank 1 only unwrapped ones, so neither mixes.
    code = codes.perturbed(2, c)
    assert code.is_exact
    assert np.max(code.cond) < 10  # nothing to trade: the automatic delta spreads the nodes out
    inputs = np.random.default_rng(c).standard_normal((2, 30 * c))
    assert simulate(code, inputs, "fp32").worst_relative_error < 1e-6


# ---------------------------------------------------------------------------------------------
# the registry and the one parameter search


def test_registry_names_every_construction() -> None:
    assert list(codes.CONSTRUCTIONS) == ["perturbed", "optimized", "vandermonde", "exact"]
    for name in codes.__all__:
        assert getattr(codes, name) is not None  # no lazy names left: everything is defined
    assert not hasattr(codes, "__getattr__")


@pytest.mark.parametrize(
    ("name", "components", "direct"),
    [
        ("perturbed", 8, lambda: codes.perturbed(4, 8, None, "fp64")),
        ("vandermonde", 5, lambda: codes.vandermonde(4, 5, None, "fp64")),
        ("exact", 4, lambda: codes.exact(4)),
        ("optimized", 8, lambda: codes.optimized(4, 8, "fp64", refine=False, cache=False)),
    ],
)
def test_build_equals_the_construction(name: str, components: int, direct) -> None:
    options = {"refine": False, "cache": False} if name == "optimized" else {}
    built = codes.build(name, 4, components, "fp64", **options)
    assert built == direct()
    assert codes.CONSTRUCTIONS[name](4, components, "fp64", **options) == built
    assert built.reference == "mixed"


def test_build_passes_options_and_reference() -> None:
    assert codes.build("perturbed", 4, 8, delta=0.01, spread_seam=True) == codes.perturbed(4, 8, 0.01, spread_seam=True)
    assert codes.build("vandermonde", 4, 6, eps=0.05, reference="A", max_error=None) == codes.vandermonde(
        4, 6, 0.05, reference="A", max_error=None
    )
    assert codes.build("exact", 4, 4, reference="A") == codes.exact(4).with_reference("A")
    optimized = codes.optimized(4, 8, refine=False, cache=False)
    assert codes.build("optimized", 4, 8, reference="A", refine=False, cache=False) == optimized.with_reference("A")
    assert codes.build("optimized", 4, 8, refine=False, kappa=1e3).params["kappa"] == 1e3
    # The automatic delta is tuned for the decoder it is built with, not swapped in afterwards.
    assert codes.build("perturbed", 4, 10, reference="A") == codes.perturbed(4, 10, reference="A")


@pytest.mark.parametrize(
    ("call", "error", "words"),
    [
        (lambda: codes.build("magic", 4, 8), ValueError, ["'name'", "'magic'", "'perturbed'", "'exact'"]),
        (lambda: codes.build(None, 4, 8), ValueError, ["'name'", "None"]),  # type: ignore[arg-type]
        (lambda: codes.build("exact", 4, 5), ValueError, ["'components'", "5", "exact"]),
        (lambda: codes.build("exact", 4, 4, "fp8"), ValueError, ["'precision'", "'fp8'"]),
        (lambda: codes.build("exact", 4, 4, reference="B"), ValueError, ["'reference'", "'B'"]),
        (lambda: codes.build("vandermonde", 4, 6, delta=0.1), TypeError, ["'delta'", "'vandermonde'", "eps"]),
        (lambda: codes.build("perturbed", 4, 8, eps=0.1), TypeError, ["'eps'", "'perturbed'", "delta"]),
        (lambda: codes.build("exact", 4, 4, delta=0.1), TypeError, ["'delta'", "'exact'", "reference"]),
        (lambda: codes.build("optimized", 4, 8, eps=0.1), TypeError, ["'eps'", "kappa", "refine", "cache"]),
        (lambda: codes.build("perturbed", 1, 8), ValueError, ["'world_size'", "1"]),
    ],
)
def test_build_rejects(call, error: type[Exception], words: list[str]) -> None:
    with pytest.raises(error) as info:
        call()
    message = str(info.value)
    assert all(word in message for word in words), message


def test_search_finds_a_minimum_across_decades() -> None:
    from cerar.coding.search import minimise_log_parameter

    calls: list[float] = []

    def score(value: float) -> float:
        calls.append((math.log(value) - math.log(3e-5)) ** 2)
        return calls[-1]

    found = minimise_log_parameter(score, 1e-9, 1.0, points=28, refinements=12)
    assert found.parameter == pytest.approx(3e-5, rel=1e-3)
    assert len(calls) == 28 + 2 + 12  # grid, two golden points, one per refinement
    assert found.score == min(calls) == score(found.parameter)  # the best point it scored
    assert minimise_log_parameter(score, 1e-9, 1.0) == found  # deterministic


def test_search_treats_nan_and_inf_as_worst() -> None:
    from cerar.coding.search import minimise_log_parameter

    def score(value: float) -> float:
        return math.nan if value < 1e-3 else (math.inf if value > 0.5 else value)

    found = minimise_log_parameter(score, 1e-6, 1.0, points=10, refinements=4)
    assert 1e-3 <= found.parameter <= 0.5 and found.score == found.parameter


@pytest.mark.parametrize(
    ("kwargs", "error", "name"),
    [
        ({"low": 0.0, "high": 1.0}, ValueError, "low"),
        ({"low": 1.0, "high": 1.0}, ValueError, "high"),
        ({"low": 1e-3, "high": math.inf}, ValueError, "high"),
        ({"low": 1e-3, "high": 1.0, "points": 1}, ValueError, "points"),
        ({"low": 1e-3, "high": 1.0, "refinements": -1}, ValueError, "refinements"),
        ({"low": 1e-3, "high": 1.0, "points": 2.0}, TypeError, "points"),
    ],
)
def test_search_bad_arguments(kwargs: dict, error: type[Exception], name: str) -> None:
    from cerar.coding.search import minimise_log_parameter

    with pytest.raises(error, match=f"'{name}'"):
        minimise_log_parameter(lambda value: value, **kwargs)


# ---------------------------------------------------------------------------------------------
# Refusing codes that cannot work (issue 12, part 3)
@pytest.mark.parametrize(
    ("build", "words"),
    [
        (lambda: codes.perturbed(4, 64), ["perturbed(N=4, c=64)", "fp32 packets", "0.459", "limit 0.1"]),
        (lambda: codes.perturbed(3, 24, precision="fp16"), ["perturbed(N=3, c=24)", "fp16 packets", "(limit 0.1)"]),
        (lambda: codes.vandermonde(4, 8), ["vandermonde(N=4, c=8)", "fp32 packets", "26.5"]),
        (lambda: codes.build("perturbed", 4, 64), ["perturbed(N=4, c=64)", "0.459"]),
        (lambda: codes.perturbed(4, 12, 0.05, max_error=1e-3), ["perturbed(N=4, c=12)", "(limit 0.001)"]),
    ],
)
def test_codes_above_the_error_limit_are_refused(build, words: list[str]) -> None:
    with pytest.raises(ValueError) as caught:
        build()
    message = str(caught.value)
    for word in [*words, "predicted worst-rank error", "max_error=None"]:
        assert word in message, (word, message)


def test_max_error_none_builds_anyway_and_the_limit_is_the_prediction() -> None:
    code = codes.perturbed(4, 64, max_error=None)
    assert code.predicted_worst_error("fp32") > 0.1
    assert codes.perturbed(4, 64, max_error=0.5) == code  # the same code passes a looser limit
    assert codes.build("perturbed", 4, 64, max_error=None) == code
    assert code.check_error("fp32", None) is code and code.check_error(max_error=0.5) is code
    with pytest.raises(ValueError, match="at fp32 packets"):
        code.check_error()
    # The check is at the precision asked for: an fp32-tuned code is noise with bf16 packets.
    default = codes.perturbed(4, 8)
    assert default.check_error("fp32") is default
    with pytest.raises(ValueError, match=r"perturbed\(N=4, c=8\) at bf16 packets"):
        default.check_error("bf16")


def test_the_limit_applies_to_the_decoder_build_returns() -> None:
    mixed = codes.build("optimized", 4, 8, refine=False, cache=False, max_error=None)
    tight = 1.01 * mixed.predicted_worst_error("fp32")
    assert codes.build("optimized", 4, 8, refine=False, cache=False, max_error=tight) == mixed
    with_a = mixed.with_reference("A")
    if with_a.predicted_worst_error("fp32") > tight:
        with pytest.raises(ValueError, match="optimized"):
            codes.build("optimized", 4, 8, reference="A", refine=False, cache=False, max_error=tight)
    assert codes.build("exact", 4, 4, max_error=1e-3) == codes.exact(4)
    with pytest.raises(ValueError, match=r"exact\(N=4, c=4\) at bf16 packets"):
        codes.build("exact", 4, 4, "bf16", max_error=1e-6)


@pytest.mark.parametrize("n_ranks", range(2, 9))
def test_default_codes_pass_the_default_limit(n_ranks: int) -> None:
    for precision in ("fp32", "fp16", "bf16", "fp64"):
        code = codes.perturbed(n_ranks, 2 * n_ranks, precision=precision)
        assert code.predicted_worst_error(precision) <= 0.1
    assert codes.exact(n_ranks).check_error("bf16") is not None
    assert codes.perturbed(n_ranks, 3 * n_ranks).predicted_worst_error("fp32") <= 0.1


@pytest.mark.parametrize(
    ("build", "error", "words"),
    [
        (lambda: codes.perturbed(4, 8, max_error=0.0), ValueError, ["'max_error'", "0.0"]),
        (lambda: codes.perturbed(4, 8, max_error=-1), ValueError, ["'max_error'", "-1"]),
        (lambda: codes.perturbed(4, 8, max_error=math.nan), ValueError, ["'max_error'", "nan"]),
        (lambda: codes.vandermonde(4, 5, max_error="0.1"), TypeError, ["'max_error'", "'0.1'"]),
        (lambda: codes.optimized(4, 8, max_error=True), TypeError, ["'max_error'", "True"]),
        (lambda: codes.build("exact", 4, 4, max_error=0), ValueError, ["'max_error'"]),
        (lambda: codes.exact(4).check_error("fp8"), ValueError, ["'precision'", "'fp8'"]),
    ],
)
def test_max_error_bad_values(build, error: type[Exception], words: list[str]) -> None:
    with pytest.raises(error) as caught:
        build()
    for word in words:
        assert word in str(caught.value)


@pytest.mark.parametrize(
    ("build", "limit", "value"),
    [
        (lambda: codes.perturbed(4, 512), 256, 512),
        (lambda: codes.perturbed(4, 512, max_error=None), 256, 512),  # the cost limit is not the error's
        (lambda: codes.perturbed(4, 257, 1e-3), 256, 257),
        (lambda: codes.vandermonde(8, 300, max_error=None), 256, 300),
        (lambda: codes.build("perturbed", 16, 1024), 256, 1024),
        (lambda: codes.optimized(4, 65, cache=False, max_error=None), 64, 65),
        (lambda: codes.build("optimized", 4, 128, refine=False), 64, 128),
    ],
)
def test_large_c_is_refused_up_front(build, limit: int, value: int, monkeypatch) -> None:
    from cerar.coding import linear_code as code_module

    def no_code(*args, **kwargs):
        raise AssertionError("a Code was built before the refusal")

    monkeypatch.setattr(code_module.Code, "__init__", no_code)  # refused before any design work
    with pytest.raises(ValueError) as caught:
        build()
    message = str(caught.value)
    assert "Argument 'components' must be at most" in message and f"{limit}" in message
    assert f"not {value}" in message


def test_the_component_limits_leave_exact_and_documented_codes_alone() -> None:
    assert codes.MAX_COMPONENTS == 256 and codes.OPTIMIZED_MAX_COMPONENTS == 64
    assert codes.perturbed(64, 256, 1e-2, max_error=None).components == 256  # at the limit: builds
    assert codes.perturbed(5, 3).is_exact  # c <= N: no tuning, no limit
