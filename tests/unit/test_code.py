"""`Code`: sizes and rates, decoders (both references, both routes), JSON, repr, argument checks."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from cerar import Code, codes, simulate
from cerar.coding.linear_code import REFERENCES, SingularCodeError


@pytest.mark.parametrize(("n_ranks", "c"), [(2, 1), (2, 4), (4, 4), (4, 8), (8, 20), (16, 48)])
def test_sizes_and_rates(n_ranks: int, c: int) -> None:
    code = codes.perturbed(n_ranks, c, 1e-3) if c > n_ranks else codes.perturbed(n_ranks, c)
    assert code.world_size == n_ranks and code.components == c
    assert code.rounds == c + n_ranks - 2
    assert code.comm_rate == pytest.approx(1 + (n_ranks - 2) / c)
    assert code.ring_comm_rate == pytest.approx(2 * (n_ranks - 1) / n_ranks)
    assert code.storage_rate == pytest.approx(1 + n_ranks / c)
    assert code.rows.shape == (c + 2 * n_ranks - 3, c)
    assert code.cond.shape == code.error_bound.shape == (n_ranks,)


def test_rows_read_only_and_F_range() -> None:
    code = codes.perturbed(4, 8, 1e-2)
    with pytest.raises(ValueError):
        code.rows[0, 0] = 1.0
    with pytest.raises(ValueError):
        code.decoder(1)[0, 0] = 1.0
    np.testing.assert_array_equal(code.F(-2), code.rows[0])
    np.testing.assert_array_equal(code.F(10), code.rows[-1])
    np.testing.assert_array_equal(code.F(np.array([0, 1])), code.rows[2:4])
    with pytest.raises(ValueError, match=r"'n'.*-3"):
        code.F(-3)
    with pytest.raises(ValueError, match=r"'n'.*11"):
        code.F(11)


def test_rows_follow_nodes() -> None:
    # F(n) = u^T Q^n: a pair e^{+-i theta} gives (cos n theta, sin n theta), a real node z^n.
    code = Code.from_nodes(3, [1.0, 0.9, 1.1], [0.0, 1.0, math.pi])
    n = np.arange(-1, code.components + 2)
    np.testing.assert_allclose(code.rows[:, 0], np.ones_like(n, dtype=float))
    np.testing.assert_allclose(code.rows[:, 1], 0.9**n * np.cos(n))
    np.testing.assert_allclose(code.rows[:, 2], 0.9**n * np.sin(n))
    np.testing.assert_allclose(code.rows[:, 3], (-1.1) ** n)
    assert code.components == 4
    nodes = code.nodes
    assert nodes is not None and len(nodes) == 4
    np.testing.assert_allclose(sorted(np.abs(nodes)), [0.9, 0.9, 1.0, 1.1])
    assert Code(3, code.rows).nodes is None


def test_perturbed_nodes_on_unit_circle_and_conjugate_closed() -> None:
    code = codes.perturbed(6, 17, 1e-2)
    nodes = code.nodes
    assert nodes is not None and len(nodes) == 17
    np.testing.assert_allclose(np.abs(nodes), 1.0)
    np.testing.assert_allclose(np.sort_complex(nodes), np.sort_complex(np.conj(nodes)), atol=1e-12)


CODES = [
    lambda: codes.exact(5),
    lambda: codes.perturbed(4, 8, 1e-2),
    lambda: codes.perturbed(5, 13, 2e-2),
    lambda: codes.perturbed(7, 10, 3e-2, reference="A"),
    lambda: codes.vandermonde(4, 6, 0.05, max_error=None),  # a poor code, built for the maths
    lambda: Code.from_nodes(4, [1.02, 0.97, 1.0, 1.05], [0.1, 0.5, math.pi, 0.0]),
]


@pytest.mark.parametrize("make", CODES)
@pytest.mark.parametrize("reference", REFERENCES)
def test_node_route_equals_generic_rows_route(make, reference: str) -> None:
    by_nodes = make().with_reference(reference)
    by_rows = Code(by_nodes.world_size, by_nodes.rows, reference=reference)
    assert by_nodes.nodes is not None and by_rows.nodes is None
    # The two routes round differently: allow float64 rounding amplified by the conditioning.
    slack = 1e-14 * float(np.max(by_rows.cond))
    for j in range(by_nodes.world_size):
        w = by_rows.decoder(j)
        np.testing.assert_allclose(by_nodes.decoder(j), w, rtol=0, atol=slack * np.abs(w).max())
        for e_nodes, e_rows in zip(by_nodes.wrap_errors(j), by_rows.wrap_errors(j), strict=True):
            np.testing.assert_allclose(e_nodes, e_rows, atol=slack)
    np.testing.assert_allclose(by_nodes.error_bound, by_rows.error_bound, rtol=1e-7, atol=10 * slack)
    assert np.max(by_nodes.error_bound) > 1e3 * slack or by_nodes.construction == "exact"
    np.testing.assert_allclose(by_nodes.cond, by_rows.cond, rtol=1e-7)
    np.testing.assert_allclose(by_nodes.predicted_error(), by_rows.predicted_error(), rtol=1e-7)


@pytest.mark.parametrize("reference", REFERENCES)
def test_decoder_inverts_the_weighted_system(reference: str) -> None:
    code = codes.perturbed(5, 12, 2e-2, reference=reference)
    n_ranks, c = 5, 12
    for j in range(n_ranks):
        m_a, m_b = code.observation_matrices(j)
        w = code.decoder(j)
        if reference == "mixed":
            system = (j * m_a + (n_ranks - 1 - j) * m_b) / (n_ranks - 1)
        else:
            system = m_a if j > 0 else m_b
        np.testing.assert_allclose(w @ system, np.eye(c), atol=1e-9)
        e_a, e_b = code.wrap_errors(j)
        if reference == "mixed":  # exact on the shared part: |A| E_A + |B| E_B = 0
            np.testing.assert_allclose(j * e_a + (n_ranks - 1 - j) * e_b, 0, atol=1e-9)


@pytest.mark.parametrize("reference", REFERENCES)
def test_ranks_0_and_last_decode_exactly(reference: str) -> None:
    code = codes.perturbed(5, 15, 0.05, reference=reference, max_error=None)
    bound = code.error_bound
    assert bound[0] < 1e-12 and bound[-1] < 1e-12
    assert np.all(bound[1:-1] > 1e-3)
    inputs = np.random.default_rng(3).standard_normal((5, 15 * 20))
    errors = simulate(code, inputs, "fp64").relative_errors
    assert errors[0] < 1e-12 and errors[-1] < 1e-12
    assert np.all(errors[1:-1] > 1e-4)


def test_mixed_beats_reference_a_on_interior_ranks() -> None:
    # docs/protocol.md, "Mixed reference": it roughly halves the worst rank's error on i.i.d. inputs.
    mixed = codes.perturbed(6, 18, 0.02)
    ref_a = mixed.with_reference("A")
    inputs = np.random.default_rng(4).standard_normal((6, 18 * 100))
    e_mixed = simulate(mixed, inputs, "fp64").relative_errors
    e_a = simulate(ref_a, inputs, "fp64").relative_errors
    assert e_mixed.max() < 0.8 * e_a.max()


def test_exact_code_properties() -> None:
    code = codes.exact(6)
    assert code.is_exact
    assert code.components == 6
    assert code.comm_rate == pytest.approx(code.ring_comm_rate)  # ring all-reduce's rate at c = N
    assert np.all(code.predicted_error("fp32") < 1e-6)
    np.testing.assert_allclose(code.cond, math.sqrt(2))  # N >= 3: a 2x2 rotation block of scale 1/sqrt(2)
    assert not codes.perturbed(6, 12, 1e-2).is_exact


def test_with_reference() -> None:
    code = codes.perturbed(4, 8, 1e-2)
    other = code.with_reference("A")
    assert other.reference == "A" and code.reference == "mixed"
    np.testing.assert_array_equal(other.rows, code.rows)
    assert other.params == code.params and other.construction == code.construction
    assert other != code and other.with_reference("mixed") == code


# ---------------------------------------------------------------------------------------------
# Identity, JSON and repr


@pytest.mark.parametrize("make", CODES)
def test_json_round_trip(make) -> None:
    code = make()
    text = code.to_json()
    again = Code.from_json(text)
    assert again.fingerprint == code.fingerprint
    assert again == code and hash(again) == hash(code)
    assert again.to_json() == text
    assert (again.construction, again.params, again.reference) == (
        code.construction,
        code.params,
        code.reference,
    )
    np.testing.assert_array_equal(again.rows, code.rows)
    for j in range(code.world_size):
        np.testing.assert_array_equal(again.decoder(j), code.decoder(j))
    np.testing.assert_array_equal(again.error_bound, code.error_bound)
    # A rows-only code round-trips through its row table.
    raw = Code(code.world_size, code.rows, construction="raw", params={"note": "x"})
    raw_again = Code.from_json(raw.to_json())
    assert raw_again == raw and "rows" in json.loads(raw.to_json())
    np.testing.assert_array_equal(raw_again.rows, raw.rows)


def test_fingerprint_distinguishes_codes() -> None:
    a = codes.perturbed(4, 8, 1e-2)
    assert a.fingerprint == codes.perturbed(4, 8, 1e-2).fingerprint
    assert len(a.fingerprint) == 64
    assert a.fingerprint != codes.perturbed(4, 8, 1.1e-2).fingerprint
    assert a.fingerprint != codes.perturbed(4, 9, 1e-2).fingerprint
    assert a != "not a code"


def test_from_json_rejects_malformed() -> None:
    with pytest.raises(ValueError, match=r"'text'"):
        Code.from_json("{not json")
    with pytest.raises(ValueError, match=r"'data'"):
        Code.from_json(json.dumps({"format": "something/else"}))
    with pytest.raises(ValueError, match=r"'data'"):
        Code.from_dict([1, 2, 3])  # type: ignore[arg-type]
    data = codes.perturbed(4, 8, 1e-2).to_dict()
    data["components"] = 9
    with pytest.raises(ValueError, match=r"components"):
        Code.from_dict(data)
    data = codes.perturbed(4, 8, 1e-2).to_dict()
    data["world_size"] = 1
    with pytest.raises(ValueError, match=r"'world_size'"):
        Code.from_dict(data)


def test_describe_shows_every_field_at_full_precision() -> None:
    a, b = codes.perturbed(4, 8, 0.1), codes.perturbed(4, 8, 0.1000001)
    assert repr(a) == repr(b)  # repr stays short (3 significant digits) ...
    assert a.describe() != b.describe()  # ... describe() tells them apart
    assert "delta=0.1," in a.describe() and "delta=0.1000001," in b.describe()
    text = a.describe()
    assert text.startswith("perturbed(N=4, c=8, delta=0.1, precision='fp32')")
    assert "decoder=mixed" in text and "spread_seam=False" in text
    assert f"fingerprint={a.fingerprint[:16]}" in text
    spread = codes.perturbed(4, 12, spread_seam=True)
    assert f"delta={spread.params['delta']!r}" in spread.describe()
    assert "spread_seam=True" in spread.describe()
    assert "decoder=A" in codes.exact(3).with_reference("A").describe()
    # Equal codes describe equally; codes differing only in their rows differ in the fingerprint.
    assert codes.perturbed(4, 8, 0.1).describe() == text
    rows = np.ones((4, 3))
    other = rows.copy()
    other[0, 0] = 1 + 1e-15
    assert Code(2, rows).describe() != Code(2, other).describe()
    assert Code(2, rows, params={"w": [0.1, np.float64(0.2)], "n": 3}).describe().startswith(
        "custom(N=2, c=3, w=[0.1, 0.2], n=3)"
    )


def test_repr() -> None:
    text = repr(codes.perturbed(4, 8, 1e-2))
    assert text.startswith("<Code perturbed(N=4, c=8")
    assert "delta=0.01" in text and "precision='fp32'" in text
    assert "L=10" in text and "comm_rate=1.250" in text and "ring 1.500" in text
    assert "decoder=mixed" in text
    assert "decoder=A" in repr(codes.exact(3).with_reference("A"))
    assert repr(Code(2, np.ones((4, 3)))).startswith("<Code custom(N=2, c=3)")


# ---------------------------------------------------------------------------------------------
# Argument checks: the message names the argument and the value


@pytest.mark.parametrize(
    ("call", "error", "name", "value"),
    [
        (lambda: Code(1, np.eye(2)), ValueError, "world_size", "1"),
        (lambda: Code(2.0, np.eye(3)), TypeError, "world_size", "2.0"),
        (lambda: Code(True, np.eye(3)), TypeError, "world_size", "True"),
        (lambda: Code(2, np.ones(3)), ValueError, "rows", "(3,)"),
        (lambda: Code(2, np.ones((3, 0))), ValueError, "rows", "(3, 0)"),
        (lambda: Code(3, np.ones((4, 2))), ValueError, "rows", "4"),
        (lambda: Code(2, np.array([[1.0, np.nan], [0, 1], [1, 1]])), ValueError, "rows", "NaN"),
        (lambda: Code(2, np.ones((4, 3)), reference="B"), ValueError, "reference", "'B'"),
        (lambda: codes.exact(3).with_reference("mixed "), ValueError, "reference", "'mixed '"),
        (lambda: Code.from_nodes(1, [1.0], [0.0]), ValueError, "world_size", "1"),
        (lambda: Code.from_nodes(2, [1.0, 1.0], [0.0]), ValueError, "radii", "2 and 1"),
        (lambda: Code.from_nodes(2, [], []), ValueError, "radii", "0 and 0"),
        (lambda: Code.from_nodes(2, [-1.0], [0.0]), ValueError, "radii", "-1.0"),
        (lambda: Code.from_nodes(2, [np.nan], [0.0]), ValueError, "radii", "nan"),
        (lambda: Code.from_nodes(2, [1.0], [4.0]), ValueError, "angles", "4.0"),
        (lambda: Code.from_nodes(2, [1.0], [-0.5]), ValueError, "angles", "-0.5"),
        (lambda: codes.exact(4).decoder(4), ValueError, "rank", "4"),
        (lambda: codes.exact(4).decoder(-1), ValueError, "rank", "-1"),
        (lambda: codes.exact(4).decoder(1.0), TypeError, "rank", "1.0"),
        (lambda: codes.exact(4).observation_matrices(True), TypeError, "rank", "True"),
        (lambda: codes.exact(4).wrap_errors(7), ValueError, "rank", "7"),
        (lambda: codes.exact(4).error_scale(np.ones((4, 3)), 9), ValueError, "rank", "9"),
        (lambda: codes.exact(4).error_scale(np.ones((3, 4)), 0), ValueError, "inputs", "(3, 4)"),
        (lambda: codes.exact(4).error_scale(np.ones(8), 0), ValueError, "inputs", "(8,)"),
        (lambda: codes.exact(4).error_scale(np.float64(1.0), 0), ValueError, "inputs", "()"),
        (lambda: codes.exact(4).predicted_error("fp8"), ValueError, "precision", "'fp8'"),
        (lambda: codes.exact(4).predicted_error(None), ValueError, "precision", "None"),
        (lambda: codes.exact(4).predicted_error("fp32", ranks=[5]), ValueError, "rank", "5"),
    ],
)
def test_invalid_arguments(call, error: type[Exception], name: str, value: str) -> None:
    with pytest.raises(error) as info:
        call()
    message = str(info.value)
    assert f"'{name}'" in message and value in message, message


def test_singular_code_raises() -> None:
    # Two coinciding nodes: the Krylov rows are rank-deficient.
    code = Code(3, np.ones((4, 1)) @ np.ones((1, 1)))  # c = 1, F(n) = 1: fine
    assert code.decoder(1).shape == (1, 1)
    singular = Code(2, np.ones((3, 2)))
    with pytest.raises(SingularCodeError, match=r"singular"):
        singular.decoder(0)
    assert issubclass(SingularCodeError, ValueError)
