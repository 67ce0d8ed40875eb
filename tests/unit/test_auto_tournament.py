"""The rules of ``method="auto"``'s tournament, driven by scripted times in one process: the warm-up
and the uncounted first round, successive halving, the order reversed between rounds, CERAR against
the rings by the margin, the duel (ABBA, a hand-over only on a margin win), agreement among ranks
that measured different times, failures out at once, and the pins' subset."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence

import pytest

from cerar.comm.auto.candidates import Candidate
from cerar.comm.auto.tournament import CUT, AutoConfig, Tournament
from cerar.comm.collective.routes import ROUTES

N = 4
EXACT = Candidate("exact", ROUTES["exact"], N)
FP16 = Candidate("fp16", ROUTES["torch-fp16"], N)
CERAR = Candidate("cerar", ROUTES["cerar"], N, 8)
CERAR16 = Candidate("cerar-fp16", ROUTES["cerar-fp16"], N, 8)
CANDIDATES = [EXACT, FP16, CERAR, CERAR16]
Times = Callable[[int, int], float]  # (candidate, run number) -> seconds


def agree_alone(values: Sequence[float]) -> list[float]:
    return list(values)


Agree = Callable[[Sequence[float]], list[float]]


def drive(t: Tournament, times: Times, runs: int, agree: Agree = agree_alone) -> list[int]:
    """Run ``runs`` runs; the candidate of each."""
    ran = []
    for _ in range(runs):
        if t.agree_due():
            t.close_round(agree)
        run = t.next()
        ran.append(run.candidate)
        t.measured(run, times(run.candidate, t.runs))
    return ran


def calibrate(t: Tournament, times: Times) -> None:
    """The warm-up, every round of every candidate (none cut), and the decision."""
    drive(t, times, 1 + (t.trials + 1) * len(t.remaining))
    t.close_round(agree_alone)


def fixed(per_candidate: Sequence[float]) -> Times:
    return lambda k, _: per_candidate[k]


def tournament(trials: int = 2, margin: float = 0.03, recheck_every: int | None = None, **kwargs: object) -> Tournament:
    return Tournament(CANDIDATES, trials, margin, recheck_every, **kwargs)  # type: ignore[arg-type]


def test_warmup_then_rounds_in_turns_then_the_winner() -> None:
    t = tournament(trials=2)
    ran = drive(t, fixed([1.0, 0.9, 0.95, 0.92]), 1 + 3 * 4 + 3)
    # The warm-up (exact), then rounds by bytes (16-bit first), reversed every other round.
    assert ran[:13] == [0, 3, 1, 2, 0, 0, 2, 1, 3, 3, 1, 2, 0]
    assert t.phase == "decided" and t.winner == 1 and ran[13:] == [1, 1, 1]  # fp16: no CERAR by the margin
    rounds = [h for h in t.history if h["event"] == "round"]
    assert [r["counted"] for r in rounds] == [False, True, True]  # the first round warms each up
    assert t.counted[1] == [0.9, 0.9] and t.counted[0] == [1.0, 1.0]


@pytest.mark.parametrize(("cerar_time", "cut"), [(1.3, True), (1.2, False)])
def test_halving_drops_a_hopeless_candidate_after_its_first_counted_round(cerar_time: float, cut: bool) -> None:
    t = tournament(trials=3)
    drive(t, fixed([2.0, 1.0, cerar_time, 1.0]), 1 + 4 + 4 + 1)  # the first counted round, agreed
    assert (2 not in t.remaining) is cut  # its best counted time against CUT x the fastest median
    assert 0 in t.remaining  # exact is never cut: the reference
    assert CUT == 1.25


def test_the_first_round_never_cuts() -> None:
    t = tournament(trials=2)
    drive(t, lambda k, run: 50.0 if run <= 5 and k == 3 else 1.0, 1 + 4)  # a slow first call of 16-bit CERAR
    t.close_round(agree_alone)
    assert 3 in t.remaining


@pytest.mark.parametrize(("cerar_time", "winner"), [(0.96, "fp16"), (0.9, "cerar-fp16 c=8")])
def test_cerar_wins_only_by_the_margin_over_the_fastest_ring(cerar_time: float, winner: str) -> None:
    t = tournament(trials=2, margin=0.05)
    calibrate(t, fixed([1.2, 1.0, 1.1, cerar_time]))
    assert t.label(t.winner) == winner  # type: ignore[arg-type]
    # The runner-up is the other side: the duel's challenger.
    assert t.label(t.runner_up) == ("cerar-fp16 c=8" if winner == "fp16" else "fp16")  # type: ignore[arg-type]


def test_turns_keep_a_steady_drift_from_deciding() -> None:
    # Two equal candidates on a machine that gets faster at every run: reversed rounds keep one
    # from always running later (faster), and their medians come out equal.
    t = tournament(trials=4, margin=0.0, allowed=[1, 3])
    calibrate(t, lambda k, run: 1.0 - 0.01 * run)
    medians = next(h for h in t.history if h["event"] == "decision")["medians"]
    assert medians["fp16"] == pytest.approx(medians["cerar-fp16 c=8"], rel=0.011)


@pytest.mark.parametrize(("challenger", "handed"), [(0.9, True), (0.98, False)])
def test_the_duel_hands_over_only_on_a_margin_win(challenger: float, handed: bool) -> None:
    t = tournament(trials=2, margin=0.05, recheck_every=5)
    calibrate(t, fixed([1.2, 1.0, 1.1, 1.02]))
    assert t.winner == 1 and t.runner_up == 3
    ran = drive(t, fixed([1.2, 1.0, 1.1, challenger]), 5 + 4 + 1)
    assert ran[5:9] == [1, 3, 3, 1]  # ABBA
    duel = next(h for h in t.history if h["event"] == "duel")
    assert duel["handed_over"] is handed and t.winner == (3 if handed else 1)
    assert ran[9] == t.winner


def test_ranks_that_measure_differently_decide_alike() -> None:
    """Three ranks in threads, each with its own times, agreeing by elementwise max; alone each
    would crown another method, together they crown the slowest rank's best."""
    local = [[1.0, 2.0, 2.0, 0.5], [1.0, 0.5, 2.0, 1.8], [0.5, 1.9, 1.9, 1.9]]  # maxima: 1.0, 2.0, 2.0, 1.9
    barrier, slots = threading.Barrier(3), [[] for _ in range(3)]

    def agree_as(rank: int) -> Agree:
        def agree(values: Sequence[float]) -> list[float]:
            slots[rank] = list(values)
            barrier.wait()
            out = [max(v) for v in zip(*slots, strict=True)]
            barrier.wait()
            return out

        return agree

    tournaments = [tournament(trials=2) for _ in range(3)]
    runs: list[list[int]] = [[] for _ in range(3)]

    def rank(r: int) -> None:
        runs[r] = drive(tournaments[r], fixed(local[r]), 1 + 3 * 4 + 2, agree_as(r))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert runs[0] == runs[1] == runs[2]
    assert {t.winner for t in tournaments} == {0}  # exact: 1.0 against 2.0, 2.0 and 1.9


def test_a_failed_candidate_is_out_at_once_and_its_runs_go_exact() -> None:
    t = tournament(trials=2)
    drive(t, fixed([1.0, 0.9, 0.8, 0.7]), 1 + 2)  # the warm-up, then fp16 and 16-bit CERAR's first runs
    t.failed(2)  # float32 CERAR, the next in the round, fails to start on every rank
    assert 2 not in t.remaining
    assert t.next().candidate == 0  # its place in the round goes exact
    t.failed(0)
    assert 0 in t.remaining  # exact is what failures fall back to: never out


def test_a_run_measured_as_failed_is_out_at_the_agreement() -> None:
    t = tournament(trials=2)
    drive(t, lambda k, run: math.inf if k == 3 else 1.0, 1 + 4 + 1)
    assert 3 not in t.remaining


def test_a_failed_winner_hands_over_to_the_runner_up() -> None:
    t = tournament(trials=2)
    calibrate(t, fixed([1.2, 1.0, 1.1, 0.9]))
    assert t.winner == 3
    t.failed(3)
    assert t.winner == 1 and t.next().candidate == 1


def test_pins_restrict_the_competitors() -> None:
    t = tournament(trials=2, allowed=[3])
    ran = drive(t, fixed([0.5, 0.5, 0.5, 1.0]), 4)
    assert ran == [0, 3, 3, 3] and t.winner == 3  # the warm-up, one uncounted run, then decided


def test_config_is_checked_and_defaults_by_context() -> None:
    assert AutoConfig().trials_for(steps=True) == 2 and AutoConfig().trials_for(steps=False) == 10
    assert AutoConfig(trials=5).trials_for(steps=True) == 5
    with pytest.raises(ValueError, match="Argument 'margin'"):
        AutoConfig(margin=-0.1)
    with pytest.raises(ValueError, match="Argument 'trials'"):
        AutoConfig(trials=0)
    with pytest.raises(ValueError, match="Argument 'candidates'"):
        AutoConfig(candidates=("exact", "nccl"))
    with pytest.raises(ValueError, match="Argument 'pins' must be a table or a file"):
        AutoConfig(pins="no-such-file.txt")


def test_the_runner_up_may_be_a_cut_candidate_but_never_a_failed_one() -> None:
    t = tournament(trials=2, recheck_every=2)
    drive(t, lambda k, _: math.inf if k == 2 else [1.0, 1.5, 0.0, 1.6][k], 1 + 4 + 3 + 1)
    assert t.remaining == [0] and t.winner == 0  # fp16 and 16-bit CERAR cut, float32 CERAR failed
    assert t.runner_up == 1  # the next best that ran: a recheck shows whether conditions changed
    ran = drive(t, fixed([1.0, 0.5, 0.5, 0.5]), 1 + 4 + 1)
    assert ran[1:5] == [0, 1, 1, 0] and ran[5] == t.winner == 1 and 1 in t.remaining  # it won its way back
