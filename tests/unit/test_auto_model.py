"""``method="auto"``'s pieces beside the tournament, in one process: the candidates and their
errors, the cost model's fit and its decision for ``cerar plan`` (budget, margin), and the
pinned table."""

from __future__ import annotations

import math

import pytest

from cerar.comm.auto.candidates import Candidate, build_candidates
from cerar.comm.auto.pins import PinnedTable
from cerar.comm.auto.tournament import AutoConfig
from cerar.comm.collective.routes import ROUTES
from cerar.experiments.bench.model import decide_slot, fit_cost_model, rounds

N = 4
EXACT = Candidate("exact", ROUTES["exact"], N)
FP16 = Candidate("fp16", ROUTES["torch-fp16"], N)
CERAR = Candidate("cerar", ROUTES["cerar"], N, 8)
CERAR16 = Candidate("cerar-fp16", ROUTES["cerar-fp16"], N, 8)
CANDIDATES = [EXACT, FP16, CERAR, CERAR16]
#: The "true" costs the scripted timings follow: alpha per transport, beta, gamma per candidate.
ALPHA, BETA = {"torch": 1e-4, "cerar": 5e-4}, 2e-8
GAMMA = {"fp16": 1e-10, "cerar c=8": 2e-9, "cerar-fp16 c=8": 1e-9}


def true_time(candidate: Candidate, values: float) -> float:
    alpha, gamma = ALPHA[candidate.route.transport], GAMMA.get(candidate.label, 0.0)
    return rounds(candidate) * alpha + candidate.bytes_per_value * values * BETA + values * gamma


def test_candidates_by_budget() -> None:
    fp16 = build_candidates(4, None, context="collective")[0][1]  # its row's prediction
    assert fp16.route.name == "ring-fp16" and fp16.predicted_error == pytest.approx(2.0**-11 * math.sqrt(2.5))
    names = {budget: [c.name for c in build_candidates(4, budget)[0]] for budget in (1e-5, 1e-3, 2e-2)}
    # The int8 ring (predicted 1.1e-2 at N = 4) is admitted from a budget of about 1e-2 on.
    assert names == {
        1e-5: ["exact"], 1e-3: ["exact", "fp16", "cerar"], 2e-2: ["exact", "fp16", "int8", "cerar", "cerar-fp16"],
    }  # fmt: skip
    admitted, refused = build_candidates(4, 1e-3)
    # 16-bit CERAR within 1e-3 takes the exact code (the one rule, code_within): no candidate.
    assert [c.label for c in refused] == ["int8"] and admitted[2].components == 8
    assert all(c.predicted_error <= 1e-3 for c in admitted) and refused[0].predicted_error > 1e-3
    assert [c.name for c in build_candidates(2, None)[0]] == ["exact", "fp16", "int8"]  # N = 2: CERAR is the ring
    with pytest.raises(ValueError, match="Argument 'candidates'"):
        AutoConfig(candidates=("exact", "nccl"))


def test_fit_recovers_the_constants() -> None:
    sizes = [2**16, 2**18, 2**20, 2**22]
    observations = [(c, v, true_time(c, v)) for c in CANDIDATES for v in sizes]
    model = fit_cost_model(observations)
    assert model is not None and model.max_rel_residual < 1e-6
    assert model.beta_s_per_byte == pytest.approx(BETA, rel=1e-4)
    assert model.alpha_s["torch"] == pytest.approx(ALPHA["torch"], rel=1e-3)
    assert model.alpha_s["cerar"] == pytest.approx(ALPHA["cerar"], rel=1e-3)
    assert model.gamma_s_per_value["cerar c=8"] == pytest.approx(GAMMA["cerar c=8"], rel=1e-3)
    assert model.predict(CERAR16, 2**24) == pytest.approx(true_time(CERAR16, 2**24), rel=1e-4)
    assert model.predict(Candidate("bf16", ROUTES["torch-bf16"], N), 2**20) == math.inf  # never measured
    assert fit_cost_model([(EXACT, 100.0, math.inf)]) is None


def test_decision_margin_and_budget() -> None:
    def decide(times: list[float], margin: float = 0.03, candidates: list[Candidate] = CANDIDATES) -> tuple[str, str]:
        choice = decide_slot(candidates, times, margin=margin)
        return candidates[choice.candidate].name, choice.reason

    assert decide([1.0, 0.6, 0.5, 0.7]) == ("cerar", "fastest")  # 17% under the best ring
    assert decide([1.0, 0.6, 0.59, 0.7]) == ("fp16", "margin")  # 1.7%: not by the margin
    assert decide([1.0, 0.6, 0.59, 0.7], margin=0.0) == ("cerar", "fastest")
    assert decide([1.0], candidates=[EXACT]) == ("exact", "budget")
    assert decide([1.0, math.inf, math.inf, 0.9]) == ("cerar-fp16", "fastest")  # failed ones are out
    assert decide([math.inf] * 4) == ("exact", "fastest")  # nothing known: exact


def test_pinned_table() -> None:
    table = PinnedTable.parse("# sizes, knobs\n0, 1M, ring, -, -\n16M, -, cerar, fp16, -  # big ones\n")
    assert str(table.rows[1]) == "16M,-,cerar,fp16,-"
    assert table.allowed(CANDIDATES, 4096) == ([0, 1], True)
    assert table.allowed(CANDIDATES, 4 << 20) == ([0, 1, 2, 3], False)  # no row: decided freely
    assert table.allowed(CANDIDATES, 64 << 20) == ([3], True)
    with pytest.raises(ValueError, match=r"line 2 .*expected 5 fields"):
        PinnedTable.parse("0,1M,ring,-,-\n1M,2M,cerar\n")
    with pytest.raises(ValueError, match="algorithm"):
        PinnedTable.parse("0,-,nccl,-,-")
    with pytest.raises(ValueError, match="matches no candidate"):
        PinnedTable.parse("0,-,cerar,bf16,-").check(CANDIDATES)
    with pytest.raises(ValueError, match="Argument 'pins' must be a table or a file"):
        AutoConfig(pins="no-such-file.txt")
    assert PinnedTable.parse(table.text() or "") == table  # the text round-trips (checkpoints)
    assert PinnedTable().text() is None
