"""The ring schedule, and an independent route to the protocol's answer.

The reference at the bottom of this file follows the send rule of docs/protocol.md, "The ring rounds", literally,
``p_i(t) = p_{i-1}(t-1) + a_i(t) - a_i(t-N)`` with ``a_i(t) = F(t-i) X_i``, tracking symbolically
which rank's injection ``F(n) X_i`` sits in which packet. It builds each rank's observation
system from that bookkeeping alone (no :class:`cerar.Schedule`, no
``Code.observation_matrices``) and decodes with the definitions of docs/protocol.md, "Decoders".
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest

from cerar import Code, RankPlan, RoundStep, Schedule, codes, simulate

# ---------------------------------------------------------------------------------------------
# Schedule and RankPlan


@pytest.mark.parametrize(("n_ranks", "components"), [(2, 1), (2, 5), (3, 3), (4, 8), (5, 13), (8, 3)])
def test_rounds_and_steps(n_ranks: int, components: int) -> None:
    schedule = Schedule(n_ranks, components)
    assert schedule.rounds == components + n_ranks - 2
    for rank in range(n_ranks):
        steps = schedule.steps(rank)
        assert [s.round for s in steps] == list(range(1, schedule.rounds + 1))
        for s in steps:
            assert isinstance(s, RoundStep)
            assert s.rank == rank
            assert s.add == s.round - rank
            assert s.remove == (s.round - n_ranks - rank if s.round > n_ranks else None)
        slots = [s.slot for s in steps if s.slot is not None]
        assert slots == list(range(components))  # c observations, one per round N-1 .. L
        first = next(s for s in steps if s.slot is not None)
        assert first.round == n_ranks - 1
        assert first.slot_remove is None  # nothing of ours in the first observed packet yet
        for s in steps:
            if s.slot is not None and s.round >= n_ranks:
                assert s.slot_remove == s.round - n_ranks + 1 - rank


def test_plan_shapes_and_slots() -> None:
    code = codes.perturbed(4, 8, 1e-2)
    schedule = Schedule.for_code(code)
    plan = schedule.plan(code, 2)
    assert isinstance(plan, RankPlan)
    assert plan.rounds == schedule.rounds == 10
    assert plan.increments.shape == (10, 8)
    assert plan.decode.shape == (8, 16)
    assert plan.first_observed_round == 3
    assert [plan.slot(t) for t in range(1, 11)] == [None, None, *range(8)]
    # increments fold a(t) - a(t-N): row t-1 is F(t-j) - F(t-N-j) once t > N.
    for t in range(1, 11):
        expected = code.F(t - 2) - (code.F(t - 4 - 2) if t > 4 else 0.0)
        np.testing.assert_array_equal(plan.increments[t - 1], expected)


def test_schedule_invalid_arguments() -> None:
    with pytest.raises(ValueError, match=r"'world_size'.*1"):
        Schedule(1, 4)
    with pytest.raises(ValueError, match=r"'components'.*0"):
        Schedule(4, 0)
    with pytest.raises(TypeError, match=r"'world_size'.*4.0"):
        Schedule(4.0, 4)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"'components'.*True"):
        Schedule(4, True)
    schedule = Schedule(4, 8)
    with pytest.raises(ValueError, match=r"'rank'.*4"):
        schedule.step(4, 1)
    with pytest.raises(ValueError, match=r"'rank'.*-1"):
        schedule.step(-1, 1)
    with pytest.raises(ValueError, match=r"'round_index'.*0"):
        schedule.step(0, 0)
    with pytest.raises(ValueError, match=r"'round_index'.*11"):
        schedule.step(0, 11)
    with pytest.raises(ValueError, match=r"'code'.*c=12"):
        schedule.plan(codes.perturbed(4, 12, 1e-2), 0)


# ---------------------------------------------------------------------------------------------
# The independent reference

Packet = dict[tuple[int, int], int]  # (rank i, exponent n) -> coefficient of F(n) X_i


def _injection(rank: int, t: int) -> Packet:
    return {(rank, t - rank): 1} if t >= 1 else {}


def _combine(*terms: tuple[int, Packet]) -> Packet:
    out: dict[tuple[int, int], int] = defaultdict(int)
    for sign, packet in terms:
        for key, value in packet.items():
            out[key] += sign * value
    return {key: value for key, value in out.items() if value != 0}


def symbolic_observations(n_ranks: int, components: int) -> list[list[Packet]]:
    """Per rank, its ``c`` observations ``o_j(t) = r_j(t) - a_j(t-N+1)``, t = N-1 .. c+N-2."""
    rounds = components + n_ranks - 2
    sent: list[Packet] = [{} for _ in range(n_ranks)]  # p_i(0) = 0
    observations: list[list[Packet]] = [[] for _ in range(n_ranks)]
    for t in range(1, rounds + 1):
        sent = [
            _combine((1, sent[(i - 1) % n_ranks]), (1, _injection(i, t)), (-1, _injection(i, t - n_ranks)))
            for i in range(n_ranks)
        ]
        for j in range(n_ranks):
            if t >= n_ranks - 1:
                received = sent[(j - 1) % n_ranks]
                observations[j].append(_combine((1, received), (-1, _injection(j, t - n_ranks + 1))))
    return observations


def reference_matrices(code: Code, rank: int) -> dict[int, np.ndarray]:
    """Rank ``rank``'s observation system: ``O_j = sum_{i != j} M_i X_i``, from the bookkeeping."""
    n_ranks, c = code.world_size, code.components
    table = code.rows  # the code's row function F(n), n = 2-N .. c+N-2

    def row(n: int) -> np.ndarray:
        return table[n - (2 - n_ranks)]

    observed = symbolic_observations(n_ranks, c)[rank]
    assert len(observed) == c
    matrices = {i: np.zeros((c, c)) for i in range(n_ranks) if i != rank}
    for k, packet in enumerate(observed):
        # Exactly one injection of every other rank, none of ours.
        assert sorted(i for i, _ in packet) == sorted(matrices)
        assert all(value == 1 for value in packet.values())
        for (i, n), _ in packet.items():
            matrices[i][k] = row(n)
    return matrices


def reference_decoder(code: Code, rank: int, reference: str) -> np.ndarray:
    """``W_j`` from the definitions of docs/protocol.md, "Decoders", applied to the bookkeeping's matrices.

    mixed: the decoder that is exact when every other rank holds the same ``g``:
    ``O = (sum_i M_i) g`` and ``S - X_j = (N-1) g``. A: exact when the code does not wrap, i.e.
    invert the matrix shared by the ranks before ``j`` (after it, for rank 0).
    """
    n_ranks = code.world_size
    matrices = reference_matrices(code, rank)
    if reference == "mixed":
        return (n_ranks - 1) * np.linalg.inv(sum(matrices.values()))
    group = [i for i in matrices if i < rank] or [i for i in matrices if i > rank]
    for i in group:  # the ranks on one side of j all see the same rows
        np.testing.assert_array_equal(matrices[i], matrices[group[0]])
    return np.linalg.inv(matrices[group[0]])


def literal_ring(code: Code, inputs: np.ndarray) -> list[np.ndarray]:
    """Run the send rule on numbers (float64), returning each rank's ``c x m`` observations."""
    n_ranks, c = code.world_size, code.components
    rounds = c + n_ranks - 2
    m = -(-inputs.shape[1] // c)
    x = np.zeros((n_ranks, c * m))
    x[:, : inputs.shape[1]] = inputs
    x = x.reshape(n_ranks, m, c).transpose(0, 2, 1)  # component k: every c-th value
    table = code.rows

    def inject(i: int, t: int) -> np.ndarray:
        return table[t - i - (2 - n_ranks)] @ x[i] if t >= 1 else np.zeros(m)

    sent = [np.zeros(m) for _ in range(n_ranks)]
    observed: list[list[np.ndarray]] = [[] for _ in range(n_ranks)]
    for t in range(1, rounds + 1):
        sent = [sent[(i - 1) % n_ranks] + inject(i, t) - inject(i, t - n_ranks) for i in range(n_ranks)]
        for j in range(n_ranks):
            if t >= n_ranks - 1:
                observed[j].append(sent[(j - 1) % n_ranks] - inject(j, t - n_ranks + 1))
    return [np.array(o) for o in observed]


def test_symbolic_bookkeeping_matches_design_formula() -> None:
    # docs/protocol.md, "Observations": o_j(t) = sum_{h=1}^{N-1} F((t-h+1) - (j-h mod N)) X_{j-h}.
    for n_ranks, c in [(2, 3), (3, 5), (4, 8), (5, 7)]:
        observations = symbolic_observations(n_ranks, c)
        for j in range(n_ranks):
            for k, packet in enumerate(observations[j]):
                t = n_ranks - 1 + k
                expected = {
                    ((j - h) % n_ranks, (t - h + 1) - ((j - h) % n_ranks)): 1 for h in range(1, n_ranks)
                }
                assert packet == expected


CASES = [
    ("exact", 3, 3),
    ("perturbed", 2, 5),
    ("perturbed", 3, 7),
    ("perturbed", 4, 8),
    ("perturbed", 5, 12),
    ("vandermonde", 4, 5),
]


def _build(kind: str, n_ranks: int, c: int, reference: str) -> Code:
    if kind == "exact":
        return codes.exact(n_ranks).with_reference(reference)
    if kind == "vandermonde":
        return codes.vandermonde(n_ranks, c, 0.05, reference=reference, max_error=None)  # a poor code
    return codes.perturbed(n_ranks, c, 0.03, reference=reference)


@pytest.mark.parametrize("reference", ["mixed", "A"])
@pytest.mark.parametrize(("kind", "n_ranks", "c"), CASES)
def test_independent_reference_agrees_with_code_and_simulator(
    kind: str, n_ranks: int, c: int, reference: str
) -> None:
    code = _build(kind, n_ranks, c, reference)
    rng = np.random.default_rng(n_ranks * 100 + c)
    d = 7 * c + 3  # not a multiple of c: exercises the padding
    inputs = rng.standard_normal((n_ranks, d))
    observed = literal_ring(code, inputs)
    simulated = simulate(code, inputs, "fp64")
    m = -(-d // c)
    x = np.zeros((n_ranks, c * m))
    x[:, :d] = inputs
    for j in range(n_ranks):
        w = reference_decoder(code, j, reference)
        scale = np.linalg.norm(w) * np.linalg.norm(np.linalg.inv(w))
        np.testing.assert_allclose(code.decoder(j), w, rtol=0, atol=1e-12 * scale * np.abs(w).max())
        # Observations from the literal ring equal the bookkeeping's matrices times the inputs.
        matrices = reference_matrices(code, j)
        components = x.reshape(n_ranks, m, c).transpose(0, 2, 1)  # component k: every c-th value
        predicted = sum(mat @ components[i] for i, mat in matrices.items())
        np.testing.assert_allclose(observed[j], predicted, atol=1e-12 * np.abs(predicted).max())
        decoded = (components[j] + w @ observed[j]).T.reshape(-1)[:d]
        tolerance = 1e-12 * scale * np.linalg.norm(inputs)
        assert np.linalg.norm(simulated.outputs[j] - decoded) <= tolerance


@pytest.mark.parametrize(("n_ranks", "c"), [(3, 3), (4, 4), (5, 5)])
def test_independent_reference_exact_code_is_exact(n_ranks: int, c: int) -> None:
    code = codes.exact(n_ranks)
    inputs = np.random.default_rng(5).standard_normal((n_ranks, 6 * c))
    observed = literal_ring(code, inputs)
    for j in range(n_ranks):
        w = reference_decoder(code, j, "mixed")
        decoded = inputs[j].reshape(6, c).T + w @ observed[j]
        np.testing.assert_allclose(decoded.T.reshape(-1), inputs.sum(axis=0), atol=1e-12)


def test_independent_reference_reference_a_ranks_0_and_last_exact() -> None:
    code = codes.perturbed(4, 10, 0.05, reference="A")
    inputs = np.random.default_rng(9).standard_normal((4, 40))
    observed = literal_ring(code, inputs)
    errors = []
    for j in range(4):
        w = reference_decoder(code, j, "A")
        decoded = (inputs[j].reshape(4, 10).T + w @ observed[j]).T.reshape(-1)
        errors.append(np.linalg.norm(decoded - inputs.sum(axis=0)))
    assert errors[0] < 1e-10 and errors[3] < 1e-10
    assert errors[1] > 1e-4 and errors[2] > 1e-4  # the interior ranks see the wrap
