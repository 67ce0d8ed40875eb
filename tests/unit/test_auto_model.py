"""``method="auto"`` in one process: the candidates and their errors, the cost model's fit, the
decision (budget, margin, hysteresis, pins), and the engine's schedule driven by scripted
timings, two engines agreeing through a fake side group (threads) on differing timings."""

from __future__ import annotations

import math
import random
import statistics
import threading
from collections.abc import Callable
from dataclasses import replace

import pytest

from cerar.comm.auto.candidates import Candidate, build_candidates, ring_error
from cerar.comm.auto.engine import AutoConfig, AutoEngine
from cerar.comm.auto.link import LinkClock
from cerar.comm.auto.model import decide_slot, fit_cost_model
from cerar.comm.auto.pins import PinnedTable

N = 4
EXACT = Candidate("exact", "fp32", "torch", N)
FP16 = Candidate("fp16", "fp16", "torch", N)
CERAR = Candidate("cerar", "fp32", "cerar", N, 8)
CERAR16 = Candidate("cerar-fp16", "fp16", "cerar", N, 8)
CANDIDATES = [EXACT, FP16, CERAR, CERAR16]
#: The "true" costs the scripted timings follow: alpha per transport, beta, gamma per candidate.
ALPHA, BETA = {"torch": 1e-4, "cerar": 5e-4}, 2e-8
GAMMA = {"fp16": 1e-10, "cerar c=8": 2e-9, "cerar-fp16 c=8": 1e-9}


def true_time(candidate: Candidate, values: float) -> float:
    gamma = GAMMA.get(candidate.label, 0.0)
    return candidate.rounds * ALPHA[candidate.transport] + candidate.bytes_per_value * values * BETA + values * gamma


def test_candidates_by_budget() -> None:
    assert ring_error(4, "fp16") == pytest.approx(2.0**-11 * math.sqrt(2.5))  # u sqrt((N+1)/2)
    names = {budget: [c.name for c in build_candidates(4, budget)[0]] for budget in (1e-5, 1e-3, 2e-2)}
    assert names == {1e-5: ["exact"], 1e-3: ["exact", "fp16", "cerar"], 2e-2: ["exact", "fp16", "cerar", "cerar-fp16"]}
    admitted, refused = build_candidates(4, 1e-3)
    assert [c.label for c in refused] == ["cerar-fp16 c=8"] and admitted[2].components == 8
    assert all(c.predicted_error <= 1e-3 for c in admitted) and refused[0].predicted_error > 1e-3
    assert [c.name for c in build_candidates(2, None)[0]] == ["exact", "fp16"]  # N = 2: CERAR is the ring
    with pytest.raises(ValueError, match="Argument 'candidates'"):
        build_candidates(4, 1e-3, ("exact", "nccl"))


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
    assert model.predict(Candidate("bf16", "bf16", "torch", N), 2**20) == math.inf  # never measured
    assert fit_cost_model([(EXACT, 100.0, math.inf)]) is None


def test_decision_margin_hysteresis_budget() -> None:
    def decide(times: list[float], **options: object) -> tuple[str, str]:
        settings = {"margin": 0.03, "hysteresis": 0.05, "allowed": range(len(times)), **options}
        choice = decide_slot(CANDIDATES, times, **settings)  # type: ignore[arg-type]
        return CANDIDATES[choice.candidate].name, choice.reason

    assert decide([1.0, 0.6, 0.5, 0.7]) == ("cerar", "fastest")  # 17% under the best ring
    assert decide([1.0, 0.6, 0.59, 0.7]) == ("fp16", "margin")  # 1.7%: not by the margin
    assert decide([1.0, 0.6, 0.59, 0.7], margin=0.0) == ("cerar", "fastest")
    assert decide([1.0, 0.6, 0.5, 0.7], previous=1) == ("cerar", "fastest")  # 17% beats the hysteresis
    assert decide([1.0, 0.52, 0.5, 0.7], previous=1, margin=0.0) == ("fp16", "hysteresis")
    assert decide([1.0, 0.6, 0.5, 0.7], allowed=[0]) == ("exact", "budget")
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
    with pytest.raises(ValueError, match="Argument 'pinned' must be a table or a file"):
        AutoConfig(pinned="no-such-file.txt")


# ---------------------------------------------------------------------------------------------
# The engine, driven by scripted timings.

SLOTS = {0: 2**16, 1: 2**22}  # a 256 KiB bucket and a 16 MiB one


class Identity:
    def max(self, values: list[float]) -> list[float]:
        return list(values)

    def min(self, values: list[int]) -> list[int]:
        return list(values)


Timing = Callable[[int, Candidate, int], float]  # (step, candidate, numel) -> seconds


def drive(engine: AutoEngine, steps: range, timing: Timing, slots: dict[int, int] = SLOTS) -> float:
    """Run ``steps``: each slot by its choice, the step's time the sum of its slots' times
    (given to the engine of steps only: the collective's calls pass no clock)."""
    now = 0.0
    for step in steps:
        engine.begin_step(step)
        for slot, numel in slots.items():
            choice = engine.choose(step, slot, numel, 4 * numel)
            seconds = timing(step, engine.candidates[choice.candidate], numel)
            engine.measured(step, slot, choice.candidate, seconds)
            now += seconds
        if engine.steps:
            engine.end_step(step, now)
    return now


def drive_plans(
    engine: AutoEngine,
    steps: range,
    call_time: Timing,
    step_cost: Timing,
    slots: dict[int, int] = SLOTS,
    lead: float = 0.0,
    clock: bool = True,
    ran: dict[int, dict[int, str]] | None = None,
) -> dict[int, dict]:
    """Like :func:`drive`, with the calls timed by ``call_time`` and the step by ``lead`` (the
    compute before its first slot) plus the sum of ``step_cost`` (which may differ from the
    calls: what a method costs the step beyond them); returns the plan at each step's start
    and fills ``ran`` with the method each slot ran at each step.
    ``clock=False``: the step's start is not given to the engine (it cannot time the lead)."""
    now, plans = 0.0, {}
    for step in steps:
        now += lead
        engine.begin_step(step, now if clock else None)
        plans[step] = plan_of(engine)
        for slot, numel in slots.items():
            choice = engine.choose(step, slot, numel, 4 * numel)
            candidate = engine.candidates[choice.candidate]
            if ran is not None:
                ran.setdefault(step, {})[slot] = candidate.name
            engine.measured(step, slot, choice.candidate, call_time(step, candidate, numel))
            now += step_cost(step, candidate, numel)
        engine.end_step(step, now)
    return plans


def plan_of(engine: AutoEngine) -> dict[int, tuple[str, str]]:
    return {s: (engine.candidates[c.candidate].name, c.reason) for s, c in engine.plan.items()}


# No trial cut short here (the tests of the cut are below): every candidate runs its trials.
CONFIG = AutoConfig(warmup=1, trials=3, verify_every=2, redecide_every=None, prune_tol=None)
DECIDED = CONFIG.calibration_steps(len(CANDIDATES))  # 13: the first step by the plan
ORDER = [3, 1, 2, 0]  # the first round's order, by bytes sent: 16-bit CERAR, the float16 ring, CERAR, exact


def rounds(trials: int, order: list[int] = ORDER) -> list[tuple[int, int]]:
    """The trial steps as (candidate, round): rounds of one step each, every other one reversed."""
    return [(k, i) for i in range(trials) for k in (order[::-1] if i % 2 else order)]


def test_engine_schedule_and_decision() -> None:
    engine = AutoEngine(CANDIDATES, CONFIG, Identity())  # type: ignore[arg-type]
    drive(engine, range(DECIDED + 1), lambda step, c, v: true_time(c, v))
    # The candidates take turns, a round of one step each (the first round warms them up).
    assert [engine.phase(s) for s in range(DECIDED + 1)] == [
        ("warmup", 0, 0), *[("trial", k, i) for k, i in rounds(CONFIG.trials)], ("run", 0, 0)
    ]  # fmt: skip
    # The small bucket is latency-bound (the float16 ring, torch's few rounds), the large one
    # bandwidth-bound (16-bit CERAR, the fewest bytes).
    assert plan_of(engine) == {0: ("fp16", "fastest"), 1: ("cerar-fp16", "fastest")}
    assert engine.plan[1].predicted_s == pytest.approx(true_time(CERAR16, 2**22), rel=1e-3)
    assert [e["event"] for e in engine.history] == ["calibrate", "decide"]


LARGE = {0: 2**22, 1: 2**22}  # two 16 MiB buckets: 16-bit CERAR in both, a plan of one method


def test_engine_verify_and_step_check() -> None:
    every = CONFIG.verify_every

    def slower_cerar(step: int, c: Candidate, v: int) -> float:  # CERAR 3x slower than in its trials
        return true_time(c, v) * (3.0 if step >= DECIDED and c.components else 1.0)

    engine = AutoEngine(CANDIDATES, CONFIG, Identity())  # type: ignore[arg-type]
    drive(engine, range(DECIDED + 1), slower_cerar, LARGE)
    assert plan_of(engine) == {0: ("cerar-fp16", "fastest"), 1: ("cerar-fp16", "fastest")}
    drive(engine, range(DECIDED + 1, DECIDED + every + 1), slower_cerar, LARGE)
    # Measured worse than predicted: the baseline.
    assert plan_of(engine) == {0: ("fp16", "verify"), 1: ("fp16", "verify")}

    # Steps of a one-method plan (the float16 ring, its calls the fastest) slower than a method
    # whose trial steps were only a little faster (no challenger: 1%, not the margin), though
    # within the plan's own verification: the whole plan becomes that method at the check.
    def call_time(step: int, c: Candidate, v: int) -> float:
        return true_time(c, v) * (2.0 if c is CERAR16 else 1.0)

    def step_cost(step: int, c: Candidate, v: int) -> float:
        if c is CERAR16:  # its calls slower, its steps 1% under the ring's trial steps
            return true_time(FP16, v) * 0.99
        return true_time(c, v) * (1.1 if c is FP16 and step >= DECIDED else 1.0)

    engine = AutoEngine(CANDIDATES, CONFIG, Identity())  # type: ignore[arg-type]
    plans = drive_plans(engine, range(DECIDED + every + 1), call_time, step_cost, LARGE)
    assert plans[DECIDED] == {0: ("fp16", "fastest"), 1: ("fp16", "fastest")}
    assert plans[DECIDED + every] == {0: ("cerar-fp16", "step"), 1: ("cerar-fp16", "step")}


@pytest.mark.parametrize("slow", ["calls", "steps"])
def test_engine_verifies_steps_by_the_window_step_not_the_calls(slow: str) -> None:
    """DDP: after the decision, either the first bucket's calls take twice their prediction
    while the steps stay as in the trials (the call waits for the ranks and shares the cores
    with backward, time the step spends anyway), or the calls stay as predicted while the steps
    take 1.3x the plan's trial steps (the coding takes from backward). The steps judge: only
    the second sends the plan's CERAR slots to their baselines."""
    engine = AutoEngine(CANDIDATES, CONFIG, Identity())  # type: ignore[arg-type]

    def call_time(step: int, c: Candidate, v: int) -> float:
        return true_time(c, v) * (2.0 if slow == "calls" and step >= DECIDED and c is CERAR16 else 1.0)

    def step_cost(step: int, c: Candidate, v: int) -> float:
        return true_time(c, v) * (1.3 if slow == "steps" and step >= DECIDED and c is CERAR16 else 1.0)

    every = CONFIG.verify_every
    plans = drive_plans(engine, range(DECIDED + every + 1), call_time, step_cost, LARGE)
    assert plans[DECIDED] == {0: ("cerar-fp16", "fastest"), 1: ("cerar-fp16", "fastest")}
    after = ("fp16", "verify") if slow == "steps" else ("cerar-fp16", "fastest")
    assert plans[DECIDED + every] == {0: after, 1: after}


@pytest.mark.parametrize("cerar_slows", [True, False])
def test_engine_contests_a_mixed_plan_with_the_fastest_single_method(cerar_slows: bool) -> None:
    """The plan mixes the float16 ring (small bucket) and 16-bit CERAR (large one), a plan the
    trials never ran whole: it duels the fastest single method (16-bit CERAR) over the next two
    windows, their halves alternating (mixed, CERAR | CERAR, mixed), and the one with the
    faster median step stays. If CERAR turned 3x slower after the decision, the mixed plan
    stays, and the next window's verification sends the large bucket to the ring."""
    engine = AutoEngine(CANDIDATES, CONFIG, Identity())  # type: ignore[arg-type]
    every = CONFIG.verify_every

    def timing(step: int, c: Candidate, v: int) -> float:
        return true_time(c, v) * (3.0 if cerar_slows and step >= DECIDED and c.components else 1.0)

    def step_cost(step: int, c: Candidate, v: int) -> float:  # the mixed plan's steps cost more
        mixed = step >= DECIDED and c is FP16  # the ring runs only in the mixed plan by then
        return timing(step, c, v) + (0.5 if mixed and not cerar_slows else 0.0)

    mixed_plan = {0: ("fp16", "fastest"), 1: ("cerar-fp16", "fastest")}
    ran: dict[int, dict[int, str]] = {}
    plans = drive_plans(engine, range(DECIDED + 3 * every + 1), timing, step_cost, ran=ran)
    mixed, cerar = {0: "fp16", 1: "cerar-fp16"}, {0: "cerar-fp16", 1: "cerar-fp16"}
    assert [ran[DECIDED + i] for i in range(2 * every)] == [mixed, cerar, cerar, mixed]
    cerar16 = {0: ("cerar-fp16", "step"), 1: ("cerar-fp16", "step")}
    assert plans[DECIDED] == plans[DECIDED + every] == mixed_plan  # the duel decides after two windows
    if cerar_slows:
        assert plans[DECIDED + 2 * every] == mixed_plan
        assert plans[DECIDED + 3 * every] == {0: ("fp16", "fastest"), 1: ("fp16", "verify")}
    else:
        assert plans[DECIDED + 2 * every] == plans[DECIDED + 3 * every] == cerar16


@pytest.mark.parametrize("steps", [True, False])
def test_engine_compares_a_slot_with_its_baseline_in_calls_only(steps: bool) -> None:
    """After the decision 16-bit CERAR's large bucket measures 5% above the float16 ring's
    trial calls, within its own prediction. In the collective (one call at a time) it duels the
    ring, which is faster, and goes back to it; in DDP no call is compared (the ring's calls
    overlap on Gloo's threads while cerar's queue, and a call's time is not what it costs the
    step): the steps judge."""
    engine = AutoEngine(CANDIDATES, CONFIG, Identity(), steps=steps)  # type: ignore[arg-type]

    def timing(step: int, c: Candidate, v: int) -> float:
        if step >= DECIDED and c is CERAR16:
            assert true_time(FP16, v) * 1.05 < true_time(CERAR16, v) * (1 + CONFIG.verify_tol)
            return true_time(FP16, v) * 1.05
        return true_time(c, v)

    drive(engine, range(DECIDED + (3 if steps else 3 * CONFIG.verify_every + 1)), timing)  # calls: the duel too
    assert (plan_of(engine)[1] == ("fp16", "verify")) is not steps, plan_of(engine)


@pytest.mark.parametrize("verified_holds", [True, False])
def test_engine_keeps_a_verification_in_steps_only_if_its_steps_are_faster(verified_holds: bool) -> None:
    """After the decision 16-bit CERAR's large bucket times 1.5x its prediction, so the
    verification sends it to its baseline; in steps that plan runs one window and stays only if
    its steps are faster (here the slow calls either do cost the step, or do not: the ring's
    calls take the cores backward needs, say). Sent back, the bucket is not verified again."""
    engine = AutoEngine(CANDIDATES, CONFIG, Identity())  # type: ignore[arg-type]
    every = CONFIG.verify_every

    def call_time(step: int, c: Candidate, v: int) -> float:
        return true_time(c, v) * (1.5 if step >= DECIDED and c is CERAR16 else 1.0)

    def step_cost(step: int, c: Candidate, v: int) -> float:
        extra = 1.0 if c is FP16 and step >= DECIDED and not verified_holds else 0.0
        return call_time(step, c, v) + extra

    plans = drive_plans(engine, range(DECIDED + 3 * every + 1), call_time, step_cost, LARGE)
    assert plans[DECIDED] == {0: ("cerar-fp16", "fastest"), 1: ("cerar-fp16", "fastest")}
    assert plans[DECIDED + every] == {0: ("fp16", "verify"), 1: ("fp16", "verify")}
    after = ("fp16", "verify") if verified_holds else ("cerar-fp16", "step")
    assert plans[DECIDED + 2 * every] == {0: after, 1: after}
    assert plans[DECIDED + 3 * every] == {0: after, 1: after}  # settled: not verified again


def drive_calls(engine: AutoEngine, calls: range, timing: Timing, numel: int = 2**22) -> tuple[dict, list[str]]:
    """A collective's stream (one slot, calls): the plan at each call's start, and the method
    each call ran."""
    plans, ran = {}, []
    for step in calls:
        engine.begin_step(step)
        plans[step] = plan_of(engine)
        choice = engine.choose(step, 0, numel, 4 * numel)
        ran.append(engine.candidates[choice.candidate].name)
        engine.measured(step, 0, choice.candidate, timing(step, engine.candidates[choice.candidate], numel))
    return plans, ran


@pytest.mark.parametrize("case", ["ring faster", "both slowed", "cerar ahead by less than the margin"])
def test_calls_verification_duels_the_baseline(case: str) -> None:
    """A collective's stream: after the decision 16-bit CERAR's calls take 1.25x their trial
    time, above the float16 ring's trial calls, so the verification has the two duel over the
    next two windows, their halves alternating (the plan unchanged until it ends). The ring's
    calls may have slowed too (the calls around them changed: a benchmark's other methods in
    turn, say): CERAR stays (not verified again) only if its calls in the duel beat the ring's
    by the margin."""
    engine = AutoEngine(CANDIDATES, CONFIG, Identity(), steps=False)  # type: ignore[arg-type]
    every = CONFIG.verify_every
    cerar_late = true_time(CERAR16, 2**22) * 1.25
    ring_slowed = {
        "ring faster": 1.0,
        "both slowed": 1.25,
        "cerar ahead by less than the margin": cerar_late / (0.99 * true_time(FP16, 2**22)),
    }[case]

    def timing(step: int, c: Candidate, v: int) -> float:
        slower = 1.0 if step < DECIDED else 1.25 if c is CERAR16 else ring_slowed
        return true_time(c, v) * slower

    plans, ran = drive_calls(engine, range(DECIDED + 4 * every + 1), timing)
    assert plans[DECIDED] == plans[DECIDED + every] == {0: ("cerar-fp16", "fastest")}
    assert ran[DECIDED + every : DECIDED + 3 * every] == ["cerar-fp16", "fp16", "fp16", "cerar-fp16"]
    after = {0: ("cerar-fp16", "step")} if case == "both slowed" else {0: ("fp16", "verify")}
    assert plans[DECIDED + 3 * every] == plans[DECIDED + 4 * every] == after  # settled: no second duel
    assert engine.history[-2]["duel"]["challenger_kept"] is (case != "both slowed")


def test_a_calls_duel_is_not_decided_by_a_drift_of_the_machine() -> None:
    """As above, with 16-bit CERAR's calls 1.4x their trial time at the decision and every
    call after it 2% faster than the one before (a slow phase of the machine passing), CERAR
    truly faster than the ring by more than the margin. A window of CERAR and then one of the
    ring would hand the ring the stream by the drift alone; the duel's alternating halves keep
    CERAR."""
    config = replace(CONFIG, verify_every=10)
    engine = AutoEngine(CANDIDATES, config, Identity(), steps=False)  # type: ignore[arg-type]
    decided, every = config.calibration_steps(len(CANDIDATES)), config.verify_every
    assert true_time(CERAR16, 2**22) < (1 - 2 * config.margin) * true_time(FP16, 2**22)

    def timing(step: int, c: Candidate, v: int) -> float:
        return true_time(c, v) * (1.0 if step < decided else 1.4 * 0.98 ** (step - decided))

    def window(first: int, c: Candidate) -> float:
        return statistics.median(timing(first + i, c, 2**22) for i in range(every))

    # One window of each in turn: the ring's, the later, wins by the margin.
    assert window(decided + every, FP16) < (1 - config.margin) * window(decided, CERAR16)
    plans, ran = drive_calls(engine, range(decided + 3 * every + 1), timing)
    assert plans[decided + every] == {0: ("cerar-fp16", "fastest")}  # the duel runs, the plan unchanged
    half = every // 2
    assert (
        ran[decided + every : decided + 3 * every] == ["cerar-fp16"] * half + ["fp16"] * every + ["cerar-fp16"] * half
    )
    assert plans[decided + 3 * every] == {0: ("cerar-fp16", "step")}


@pytest.mark.parametrize("clear", [True, False])
@pytest.mark.parametrize("challenger_holds", [True, False])
def test_engine_contests_a_plan_with_the_fastest_trial_steps(challenger_holds: bool, clear: bool) -> None:
    # Per call the float16 ring wins both buckets (16-bit CERAR takes twice as long), but its
    # steps take two seconds longer in the trials (exact's and float32 CERAR's four; its calls
    # taking the cores backward needs, say, which no call time shows). 16-bit CERAR challenges
    # the plan; here CERAR's steps either stay fast (it holds) or turn out slow once it runs
    # (trial noise: the plan returns). When one of CERAR's two counted trial steps was slow too
    # (not ``clear``), the plan and CERAR duel over two windows, their halves alternating, and
    # the one with the faster median step stays; when both were fast by far (``clear``), CERAR
    # runs first and stays if its window beats the ring's trial steps.
    engine = AutoEngine(CANDIDATES, CONFIG, Identity())  # type: ignore[arg-type]
    every = CONFIG.verify_every
    first_counted = 1 + 4 + 3  # 16-bit CERAR's step in the second (reversed) round

    def call_time(c: Candidate, v: int) -> float:
        return true_time(FP16, v) * (2.0 if c is CERAR16 else 1.0 if c is FP16 else 3.0)

    def step_cost(step: int, c: Candidate, v: int) -> float:
        extra = 1.0 if c is FP16 else 0.0 if c is CERAR16 else 2.0
        if c is CERAR16 and step == first_counted and not clear:
            extra = 0.8  # its median stays 3% under the ring's, its spread is wider than the gap
        if c is CERAR16 and step >= DECIDED and not challenger_holds:
            extra = 2.0
        return call_time(c, v) + extra

    ran: dict[int, dict[int, str]] = {}
    plans = drive_plans(engine, range(DECIDED + 3 * every + 1), lambda step, c, v: call_time(c, v), step_cost, ran=ran)
    assert engine.phase(first_counted) == ("trial", 3, 1)
    ring = {0: ("fp16", "fastest"), 1: ("fp16", "fastest")}
    cerar16 = {0: ("cerar-fp16", "step"), 1: ("cerar-fp16", "step")}
    if clear:
        assert plans[DECIDED] == cerar16
        assert plans[DECIDED + every] == (cerar16 if challenger_holds else ring)
    else:
        assert plans[DECIDED] == plans[DECIDED + every] == ring
        assert [ran[DECIDED + i][0] for i in range(2 * every)] == ["fp16", "cerar-fp16", "cerar-fp16", "fp16"]
        assert plans[DECIDED + 2 * every] == (cerar16 if challenger_holds else ring)
    assert plans[DECIDED + 3 * every] == plans[DECIDED + 2 * every]  # settled: no second contest


def test_a_duel_is_not_decided_by_a_drift_of_the_machine() -> None:
    """The ring's calls win (the plan), 16-bit CERAR's trial steps were 5% faster but not
    clearly (one of its counted steps was slow), so the two duel. After the decision every step
    gets 2% slower than the one before (the machine's pace drifting: load, a slow phase), and
    CERAR's steps are truly 5% faster: taken in turns, a window of the plan then one of CERAR,
    CERAR's later window would lose by the drift; the duel's alternating halves cancel it."""
    config = AutoConfig(warmup=1, trials=3, verify_every=10, redecide_every=None, prune_tol=None)
    engine = AutoEngine(CANDIDATES, config, Identity())  # type: ignore[arg-type]
    decided, every = config.calibration_steps(len(CANDIDATES)), config.verify_every
    first_counted = 1 + 4 + 3  # 16-bit CERAR's step in the second (reversed) round

    def call_time(step: int, c: Candidate, v: int) -> float:
        return true_time(FP16, v) * (2.0 if c is CERAR16 else 1.0 if c is FP16 else 3.0)

    def step_cost(step: int, c: Candidate, v: int) -> float:  # per slot, two slots a step
        if step >= decided:
            return (0.95 if c is CERAR16 else 1.0) * (1.0 + 0.02 * (step - decided))
        if c is CERAR16:
            return 0.99 if step == first_counted else 0.9
        return 1.0 if c is FP16 else 2.0

    ran: dict[int, dict[int, str]] = {}
    plans = drive_plans(engine, range(decided + 2 * every + 1), call_time, step_cost, LARGE, ran=ran)
    assert plans[decided] == {0: ("fp16", "fastest"), 1: ("fp16", "fastest")}
    half = every // 2
    turns = ["fp16"] * half + ["cerar-fp16"] * every + ["fp16"] * half
    assert [ran[decided + i][0] for i in range(2 * every)] == turns
    assert plans[decided + 2 * every] == {0: ("cerar-fp16", "step"), 1: ("cerar-fp16", "step")}
    duel = engine.history[-1]["duel"]
    assert duel["challenger_kept"] and duel["challenger_s"] < duel["plan_s"]


def test_cerar_must_beat_the_rings_by_the_margin_in_steps() -> None:
    """Per call 16-bit CERAR wins both buckets, but its trial steps are no faster than the
    float16 ring's (on loopback its coding takes from backward what no call time shows): the
    ring challenges the plan, and in the duel CERAR's steps, 1% faster, do not beat the ring's
    by the margin: the ring takes the plan."""
    engine = AutoEngine(CANDIDATES, CONFIG, Identity())  # type: ignore[arg-type]
    every = CONFIG.verify_every

    def step_cost(step: int, c: Candidate, v: int) -> float:  # per slot
        if c is CERAR16:
            return 0.99 if step >= DECIDED else 1.0
        return 1.0 if c is FP16 else 2.0

    ran: dict[int, dict[int, str]] = {}
    plans = drive_plans(
        engine, range(DECIDED + 2 * every + 1), lambda step, c, v: true_time(c, v), step_cost, LARGE, ran=ran
    )
    assert plans[DECIDED] == {0: ("cerar-fp16", "fastest"), 1: ("cerar-fp16", "fastest")}
    assert [ran[DECIDED + i][0] for i in range(2 * every)] == ["cerar-fp16", "fp16", "fp16", "cerar-fp16"]
    assert plans[DECIDED + 2 * every] == {0: ("fp16", "step"), 1: ("fp16", "step")}
    duel = engine.history[-1]["duel"]
    assert duel["challenger_kept"] and duel["plan_s"] < duel["challenger_s"]  # faster, not by the margin


@pytest.mark.parametrize("exact_step", [0.94, 1.03])
def test_a_ring_is_challenged_by_a_ring_that_came_within_the_margin(exact_step: float) -> None:
    """The float16 ring's calls win both buckets and exact's trial steps came within 1% of the
    ring's (a near tie, which two counted steps each cannot settle; the CERAR methods far
    slower). Exact challenges the plan in a duel, and its steps decide: truly 6% faster, exact
    takes the plan; 3% slower, the ring keeps it. Before, no ring challenged a ring plan within
    the margin, and whichever the calls chose ran the rest of the run."""
    config = AutoConfig(warmup=1, trials=3, verify_every=10, redecide_every=None, prune_tol=None)
    engine = AutoEngine(CANDIDATES, config, Identity())  # type: ignore[arg-type]
    decided, every = config.calibration_steps(len(CANDIDATES)), config.verify_every

    def call_time(step: int, c: Candidate, v: int) -> float:
        return true_time(FP16, v) * (1.0 if c is FP16 else 1.1 if c is EXACT else 3.0)

    def step_cost(step: int, c: Candidate, v: int) -> float:  # per slot
        if c is EXACT:
            return exact_step if step >= decided else 1.01
        return 1.0 if c is FP16 else 2.0

    ran: dict[int, dict[int, str]] = {}
    plans = drive_plans(engine, range(decided + 2 * every + 1), call_time, step_cost, LARGE, ran=ran)
    assert plans[decided] == {0: ("fp16", "fastest"), 1: ("fp16", "fastest")}
    half = every // 2
    assert [ran[decided + i][0] for i in range(2 * every)] == ["fp16"] * half + ["exact"] * every + ["fp16"] * half
    duel = engine.history[-1]["duel"]
    if exact_step < 1.0:
        assert plans[decided + 2 * every] == {0: ("exact", "step"), 1: ("exact", "step")}
        assert duel["challenger_kept"]
    else:
        assert plans[decided + 2 * every] == plans[decided]
        assert not duel["challenger_kept"]


@pytest.mark.parametrize("cerar_step", [1.12, 1.02])
def test_cerar_far_behind_the_ring_in_its_trial_steps_gets_no_duel(cerar_step: float) -> None:
    """Per call 16-bit CERAR wins both buckets (the plan), but even its fastest counted trial
    step is 12% slower than the float16 ring's: the ring takes every bucket at the decision,
    without the ten steps of the plan a duel would run (``duel_tol`` 10%). Its fastest 2%
    slower (its other step 10%: not clearly slower either), the two duel."""
    engine = AutoEngine(CANDIDATES, CONFIG, Identity())  # type: ignore[arg-type]
    every = CONFIG.verify_every

    def step_cost(step: int, c: Candidate, v: int) -> float:  # per slot; its counted steps are 8 and 9
        return cerar_step + 0.08 * (step % 2 == 0) if c is CERAR16 else 1.0 if c is FP16 else 2.0

    ran: dict[int, dict[int, str]] = {}
    plans = drive_plans(
        engine, range(DECIDED + 2 * every + 1), lambda step, c, v: true_time(c, v), step_cost, LARGE, ran=ran
    )
    if cerar_step > 1.0 + CONFIG.duel_tol:
        assert plans[DECIDED] == plans[DECIDED + 2 * every] == {0: ("fp16", "step"), 1: ("fp16", "step")}
        assert {ran[DECIDED + i][0] for i in range(2 * every)} == {"fp16"}
        assert not any("duel" in e for e in engine.history)
    else:
        assert plans[DECIDED] == {0: ("cerar-fp16", "fastest"), 1: ("cerar-fp16", "fastest")}
        assert [ran[DECIDED + i][0] for i in range(2 * every)] == ["cerar-fp16", "fp16", "fp16", "cerar-fp16"]
        assert plans[DECIDED + 2 * every] == {0: ("fp16", "step"), 1: ("fp16", "step")}


def test_engine_hands_a_mixed_plan_to_the_fastest_single_method_when_its_estimate_loses() -> None:
    """Per call the float16 ring takes the large bucket (its calls 10% under 16-bit CERAR's)
    and 16-bit CERAR the small one: a mixed plan, as the calls alone decide it. But every
    step by the ring takes 50 ms more (its calls taking the cores backward needs, say), so the
    plan's estimate, its methods' trial steps weighted by the bytes each runs (80% the ring's),
    is far above 16-bit CERAR's trial steps: in steps 16-bit CERAR takes both buckets at the
    decision, and no window runs the mixed plan."""
    slots = {0: 2**22, 1: 2**20}

    def call_time(step: int, c: Candidate, v: int) -> float:
        return true_time(CERAR16, v) * 0.9 if c is FP16 and v == slots[0] else true_time(c, v)

    def step_cost(step: int, c: Candidate, v: int) -> float:
        return call_time(step, c, v) + (0.05 if c is FP16 else 0.0)

    calls = AutoEngine(CANDIDATES, CONFIG, Identity(), steps=False)  # type: ignore[arg-type]
    drive(calls, range(DECIDED + 1), call_time, slots)
    assert {slot: method for slot, (method, _) in plan_of(calls).items()} == {0: "fp16", 1: "cerar-fp16"}
    engine = AutoEngine(CANDIDATES, CONFIG, Identity())  # type: ignore[arg-type]
    every = CONFIG.verify_every
    plans = drive_plans(engine, range(DECIDED + 2 * every + 1), call_time, step_cost, slots)
    cerar16 = {0: ("cerar-fp16", "step"), 1: ("cerar-fp16", "step")}
    assert plans[DECIDED] == plans[DECIDED + every] == plans[DECIDED + 2 * every] == cerar16


def test_engine_size_change_and_hysteresis() -> None:
    # Calls (no step rules): the per-slot decision alone. In steps the slower 16-bit CERAR's
    # trial steps would hand both slots to the ring (a mixed plan's estimate losing by the margin).
    config = AutoConfig(warmup=1, trials=3, verify_every=50, redecide_every=2, hysteresis=0.5, prune_tol=None)
    engine = AutoEngine(CANDIDATES, config, Identity(), steps=False)  # type: ignore[arg-type]
    drive(engine, range(DECIDED + 1), lambda step, c, v: true_time(c, v))
    assert engine.choose(DECIDED, 1, 2**20, 2**22).reason == "size"  # a rebuilt bucket: exact for now
    engine.begin_step(DECIDED + 1)
    assert engine.history[-1] == {"step": DECIDED + 1, "event": "calibrate", "reason": "size"}
    # Re-calibrated with 16-bit CERAR 20% slower: the ring now wins the large bucket by 4%, not
    # by the 50% the hysteresis asks.
    slower = {"cerar-fp16": 1.2}
    drive(engine, range(DECIDED + 1, 2 * DECIDED + 2), lambda step, c, v: true_time(c, v) * slower.get(c.name, 1.0))
    assert plan_of(engine) == {0: ("fp16", "fastest"), 1: ("cerar-fp16", "hysteresis")}


class PairedGroup:
    """Two engines' side group, one thread each: elementwise max/min over both."""

    def __init__(self) -> None:
        self.barrier = threading.Barrier(2)
        self.slots: list[list[float]] = [[], []]

    def member(self, rank: int) -> Identity:
        group = self

        class Member(Identity):
            def max(self, values: list[float]) -> list[float]:
                return group.exchange(rank, values, max)

            def min(self, values: list[int]) -> list[int]:
                return [int(v) for v in group.exchange(rank, values, min)]

        return Member()

    def exchange(self, rank: int, values: list, pick: Callable) -> list:
        self.slots[rank] = list(values)
        self.barrier.wait()
        out = [pick(a, b) for a, b in zip(*self.slots, strict=True)]
        self.barrier.wait()
        return out


def in_two_threads(rank_main: Callable[[int], None]) -> None:
    """Run ``rank_main(0)`` and ``rank_main(1)`` side by side (two ranks of a PairedGroup)."""
    threads = [threading.Thread(target=rank_main, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)


def test_engines_that_measured_differently_agree() -> None:
    # Rank 0 sees the 16-bit ring slow, rank 1 sees 16-bit CERAR slow: alone they would differ.
    skew = [{"fp16": 4.0}, {"cerar-fp16": 4.0}]
    alone = []
    for rank in (0, 1):
        engine = AutoEngine(CANDIDATES, CONFIG, Identity())  # type: ignore[arg-type]
        drive(engine, range(DECIDED + 1), lambda s, c, v, r=rank: true_time(c, v) * skew[r].get(c.name, 1.0))
        alone.append(plan_of(engine))
    assert alone[0] != alone[1]
    group, plans = PairedGroup(), [None, None]

    def rank_main(rank: int) -> None:
        engine = AutoEngine(CANDIDATES, CONFIG, group.member(rank))  # type: ignore[arg-type]
        drive(engine, range(DECIDED + 1), lambda s, c, v: true_time(c, v) * skew[rank].get(c.name, 1.0))
        plans[rank] = plan_of(engine)

    in_two_threads(rank_main)
    assert plans[0] == plans[1] is not None
    # The agreed numbers are the slowest rank's: both the 16-bit ring and 16-bit CERAR slowed.
    assert plans[0] == {0: ("exact", "fastest"), 1: ("cerar", "fastest")}


def _slow_steps(factors: dict[str, float]) -> Timing:
    """The scripted costs, with whole candidates slowed by ``factors`` (a method whose steps are
    slow: exact on a slow link, float32 CERAR's coding)."""
    return lambda step, c, v: true_time(c, v) * factors.get(c.name, 1.0)


@pytest.mark.parametrize("steps", [True, False])
def test_engine_cuts_the_trial_of_a_hopeless_candidate(steps: bool) -> None:
    # Exact and float32 CERAR take three times the best step here: with steps both are cut at
    # their turns in the first round without a step, against the warm-up steps before them,
    # since the warm-up's exact calls alone (for CERAR, 5/6 of them: its bytes) took longer, so
    # that the decision comes at step 1 + 2 + 2 + 2 = 7, not 13. Calls (noisier; six trials
    # each, as the collective's default) are cut by the faster of two counted calls, in the third
    # round, at 1 + 4 x 3 + 2 x 3 = 19, not 25. The float16 ring, 20% slower than 16-bit CERAR,
    # stays within prune_tol (25%) and runs its whole trial.
    config = replace(CONFIG, prune_tol=0.25, trials=3 if steps else 6)
    engine = AutoEngine(CANDIDATES, config, Identity(), steps=steps)  # type: ignore[arg-type]
    timing = _slow_steps({"exact": 3.0, "cerar": 3.0})
    trials, cut_at = config.trials, 0 if steps else 2
    cerar_at = 1 + 4 * cut_at + 2  # float32 CERAR's step of the round it is cut in: third of four
    decided = 1 + 4 * (cut_at + 1) + 2 * (trials - cut_at - 1) - (2 if steps else 0)
    drive(engine, range(decided + 1), timing)
    cut = [(e["step"], e["candidate"], e["trial_step"]) for e in engine.history if e["event"] == "prune"]
    assert cut == [(cerar_at, "cerar c=8", cut_at), (cerar_at + (0 if steps else 1), "exact", cut_at)]
    assert [e["step_s"] is None for e in engine.history if e["event"] == "prune"] == [steps, steps]
    # With steps, the cut candidates' turns went to the next round; calls ran theirs.
    assert engine.pruned == {0, 2} and engine.phase(cerar_at)[:2] == (("trial", 1) if steps else ("trial", 2))
    assert engine.phase(decided)[0] == "run"
    # After the cut the two left take turns to the end of their trials.
    left = [(k, i) for k, i in rounds(trials, [3, 1]) if i > cut_at]
    first_left = cerar_at + (0 if steps else 2)
    assert [engine.phase(s)[1:] for s in range(first_left, decided)] == left
    assert [e["event"] for e in engine.history] == ["calibrate", "prune", "prune", "decide"]
    # A cut candidate is no choice; exact, cut too, stays the baseline a slot goes back to.
    assert {name for name, _ in plan_of(engine).values()} <= {"fp16", "cerar-fp16"}
    assert all(choice.baseline in (0, 1) for choice in engine.plan.values())
    # With the cut off, the same timings run every calibration step to the same plan.
    full = AutoEngine(CANDIDATES, replace(config, prune_tol=None), Identity(), steps=steps)  # type: ignore[arg-type]
    drive(full, range(config.calibration_steps(len(CANDIDATES)) + 1), timing)
    assert full.pruned == set() and plan_of(full) == plan_of(engine)


@pytest.mark.parametrize("slow_on", ["both", "both-far", "one", "none"])
def test_exact_is_cut_at_its_turn_when_its_warmup_calls_alone_are_too_slow(slow_on: str) -> None:
    # The warm-up step runs exact and carries every first-time cost (here 10 s beyond its calls):
    # its time is no measure, but its calls bound any step by exact from below. Exact's calls
    # take 1.1x 16-bit CERAR's, but in the warm-up 1.25x more on both ranks (exact is cut at its
    # turn in the first round, without a step, and the decision comes three steps sooner), 3x
    # (float32 CERAR, which sends 5/6 of exact's bytes in more rounds, is cut at its turn too,
    # but not the float16 ring, a baseline), on one rank only (that rank waited for the other to
    # join each call: the least over the ranks is the bound, no cut), or on none.
    factors = {"cerar-fp16": 1.0, "fp16": 1.05, "cerar": 1.1, "exact": 1.1}
    warm = {"both": 1.25, "both-far": 3.0}.get(slow_on, 3.0)
    config = replace(CONFIG, prune_tol=0.25)
    group, engines = PairedGroup(), [None, None]

    def rank_main(rank: int) -> None:
        engine = AutoEngine(CANDIDATES, config, group.member(rank))  # type: ignore[arg-type]
        slow = slow_on.startswith("both") or (slow_on == "one" and rank == 0)

        def call_time(step: int, c: Candidate, v: int) -> float:
            return v * 1e-9 * factors[c.name] * (warm if step == 0 and slow else 1.0)

        def step_cost(step: int, c: Candidate, v: int) -> float:
            return call_time(step, c, v) + (10.0 if step == 0 else 0.0)

        drive_plans(engine, range(DECIDED + 1), call_time, step_cost)
        engines[rank] = engine

    in_two_threads(rank_main)
    histories = [
        [(e["step"], e["event"], e.get("candidate")) for e in engine.history if e["event"] != "verify"]
        for engine in engines
    ]
    assert histories[0] == histories[1]
    exact_turn = 1 + 3  # the warm-up, then 16-bit CERAR, the float16 ring and float32 CERAR
    if slow_on == "both-far":
        assert histories[0] == [
            (0, "calibrate", None), (exact_turn - 1, "prune", "cerar c=8"), (exact_turn - 1, "prune", "exact"),
            (DECIDED - 6, "decide", None),
        ]  # fmt: skip
        assert engines[0].pruned == {0, 2} and engines[0].phase(exact_turn - 1) == ("trial", 1, 1)
    elif slow_on == "both":
        assert histories[0] == [(0, "calibrate", None), (exact_turn, "prune", "exact"), (DECIDED - 3, "decide", None)]
        assert engines[0].pruned == {0} and engines[0].phase(exact_turn) == ("trial", 2, 1)
    else:
        assert histories[0] == [(0, "calibrate", None), (DECIDED, "decide", None)]
        assert engines[0].pruned == set() and engines[0].phase(exact_turn) == ("trial", 0, 0)


@pytest.mark.parametrize("clock", [True, False])
def test_the_warmup_bound_adds_the_compute_before_the_first_slot(clock: bool) -> None:
    """Steps as much compute as communication (a 100 Mbit/s link): each step spends 0.3 before
    its first slot (the lead), then its calls (16-bit CERAR 0.2, the float16 ring 0.24, float32
    CERAR 0.4, exact 0.48 over the two slots). At float32 CERAR's first turn the fastest step
    before it took 0.5 (16-bit CERAR's; prune_tol 0.25: 0.625): the warm-up's exact calls
    scaled to its bytes (0.4) or whole (0.48, exact's turn) do not exceed it, but with the lead
    (0.7, 0.78) they do, and both are cut without a step. An engine not given the steps'
    starts cannot time the lead: the two run their first steps and are cut after them, and the
    decision comes two steps later."""
    lead, calls = 0.3, {"cerar-fp16": 0.2, "fp16": 0.24, "cerar": 0.4, "exact": 0.48}
    engine = AutoEngine(CANDIDATES, replace(CONFIG, prune_tol=0.25), Identity())  # type: ignore[arg-type]

    def call_time(step: int, c: Candidate, v: int) -> float:  # per slot
        return calls[c.name] / len(LARGE)

    def step_cost(step: int, c: Candidate, v: int) -> float:  # the warm-up carries first-time costs
        return call_time(step, c, v) + (10.0 if step == 0 else 0.0)

    drive_plans(engine, range(DECIDED + 1), call_time, step_cost, LARGE, lead=lead, clock=clock)
    cuts = [e for e in engine.history if e["event"] == "prune"]
    turn = 1 + 2  # the warm-up, 16-bit CERAR, the float16 ring: float32 CERAR's turn, then exact's
    if clock:
        assert [(e["step"], e["candidate"], e["step_s"]) for e in cuts] == [
            (turn, "cerar c=8", None), (turn, "exact", None)
        ]  # fmt: skip
        assert [e["lead_s"] for e in cuts] == [pytest.approx(lead)] * 2
        assert [e["bound_s"] for e in cuts] == [pytest.approx(0.48 * 5 / 6 + lead), pytest.approx(0.48 + lead)]
    else:
        assert [(e["step"], e["candidate"], e["step_s"]) for e in cuts] == [
            (turn, "cerar c=8", pytest.approx(0.7)), (turn + 1, "exact", pytest.approx(0.78))
        ]  # fmt: skip
    decided = [e["step"] for e in engine.history if e["event"] == "decide"]
    assert decided == [DECIDED - 6 if clock else DECIDED - 4]
    assert {name for name, _ in plan_of(engine).values()} == {"cerar-fp16"}


def test_exact_and_float32_cerar_are_cut_at_a_later_turn() -> None:
    # Steps that are their calls. The first steps carry first-time costs, so the first round
    # cuts nothing; in the second (reversed) round exact's counted step comes first, with no
    # counted step of another to be judged against, and one counted step cuts no candidate.
    # At their third-round turns both are cut before those steps run, and the decision comes
    # two steps sooner, by the warm-up's bound against the fastest counted median (16-bit
    # CERAR's 1.0, prune_tol 0.25): exact's warm-up calls (1.6 per step) and float32 CERAR's
    # share of them (5/6: 1.33) exceed 1.25.
    total = {"cerar-fp16": 1.0, "fp16": 1.1, "cerar": 1.4, "exact": 1.6}
    first_time = {"cerar-fp16": 1.0, "fp16": 1.0, "cerar": 0.5, "exact": 0.0}
    engine = AutoEngine(CANDIDATES, replace(CONFIG, prune_tol=0.25), Identity())  # type: ignore[arg-type]

    def call_time(step: int, c: Candidate, v: int) -> float:  # per slot
        return total[c.name] / len(LARGE)

    def step_cost(step: int, c: Candidate, v: int) -> float:  # per slot: half the step
        kind, _, i = engine.phase(step)
        return (total[c.name] + (first_time[c.name] if kind == "trial" and i == 0 else 0.0)) / len(LARGE)

    drive_plans(engine, range(DECIDED + 1), call_time, step_cost, LARGE)
    third = 1 + 4 + 4 + 2  # the third round's third step: float32 CERAR's turn, then exact's
    cuts = [e for e in engine.history if e["event"] == "prune"]
    assert [(e["step"], e["candidate"], e["trial_step"], e["step_s"]) for e in cuts] == [
        (third, "cerar c=8", 2, None), (third, "exact", 2, None)
    ]  # fmt: skip
    assert [e["bound_s"] for e in cuts] == [pytest.approx(1.6 * 5 / 6), pytest.approx(1.6)]
    assert [e["own_s"] for e in cuts] == [None, None]  # one counted step each: not enough to judge by
    assert [e["step"] for e in engine.history if e["event"] == "decide"] == [DECIDED - 2]
    assert {name for name, _ in plan_of(engine).values()} == {"cerar-fp16"}


def test_one_slow_counted_step_does_not_cut_a_close_competitor() -> None:
    """DDP: 16-bit CERAR's first counted step still carries warm-up costs (1.5 where its steps
    take 1.0: another transport's steps ran between its first two), above 1.25x the float16
    ring's 1.1. Judged by the fastest of at least two counted steps, it is not cut there, runs
    its last trial step and is the decision's plan (its calls the fastest)."""
    total = {"cerar-fp16": 1.0, "fp16": 1.1, "cerar": 1.2, "exact": 1.2}
    engine = AutoEngine(CANDIDATES, replace(CONFIG, prune_tol=0.25), Identity())  # type: ignore[arg-type]

    def call_time(step: int, c: Candidate, v: int) -> float:  # per slot
        return total[c.name] / len(LARGE)

    def step_cost(step: int, c: Candidate, v: int) -> float:
        i = engine.phase(step)[2]
        warm = 1.0 if i == 0 else 0.5 if c is CERAR16 and i == 1 else 0.0  # 16-bit CERAR: two steps
        return (total[c.name] + warm) / len(LARGE)

    plans = drive_plans(engine, range(DECIDED + 1), call_time, step_cost, LARGE)
    assert engine.history[1]["event"] == "decide" and engine.pruned == set(), engine.history
    assert plans[DECIDED] == {0: ("cerar-fp16", "fastest"), 1: ("cerar-fp16", "fastest")}


def test_one_slow_call_does_not_cut_a_close_competitor() -> None:
    # Calls: the float16 ring is as fast as 16-bit CERAR but for one call three times slower;
    # judged by the faster of its counted calls, it runs its whole trial (and is chosen).
    config = replace(CONFIG, prune_tol=0.25, trials=6)
    engine = AutoEngine(CANDIDATES, config, Identity(), steps=False)  # type: ignore[arg-type]
    fp16_second = 1 + 6 + 2  # the float16 ring's second counted call

    def timing(step: int, c: Candidate, v: int) -> float:
        return 1e-3 * (3.0 if step == fp16_second else 1.0) * (0.9 if c.name == "fp16" else 1.0)

    drive(engine, range(config.calibration_steps(len(CANDIDATES)) + 1), timing, slots={0: 1000})
    assert 1 not in engine.pruned and plan_of(engine) == {0: ("fp16", "fastest")}


def test_engine_cuts_a_slow_first_candidate_by_two_counted_steps_and_never_at_a_trials_last_step() -> None:
    # Four trial steps each. 16-bit CERAR, first in the first round, has nothing to be compared
    # with there; its first counted step (last in the second, reversed, round) is one step, not
    # enough to cut by; after its second (first in the third round) it is cut against the
    # others' counted steps. The float16 ring slows only at its last trial step, which ends the
    # trial anyway. The other methods take as long as the ring.
    config = replace(CONFIG, prune_tol=0.25, trials=4)
    engine = AutoEngine(CANDIDATES, config, Identity())  # type: ignore[arg-type]
    # The third round's first step; the fourth round's last, three candidates left in it.
    cerar16_cut, fp16_last = 1 + 4 + 4, 1 + 4 + 4 + 4 + 2

    def timing(step: int, c: Candidate, v: int) -> float:
        slow = c.name == "cerar-fp16" or (c.name == "fp16" and step == fp16_last)
        return v * 1e-9 * (10.0 if slow else 1.0)

    drive(engine, range(config.calibration_steps(len(CANDIDATES))), timing)
    cut = [(e["step"], e["candidate"], e["trial_step"]) for e in engine.history if e["event"] == "prune"]
    assert cut == [(cerar16_cut, "cerar-fp16 c=8", 2)] and engine.pruned == {3}
    assert engine.phase(fp16_last) == ("trial", 1, 3) and engine.phase(fp16_last + 1)[0] == "run"
    assert [e["step"] for e in engine.history if e["event"] == "decide"] == [fp16_last + 1]


def test_taking_turns_keeps_a_steady_drift_from_favouring_the_last_candidate() -> None:
    # Every step 2% faster than the one before (a run settling), 16-bit CERAR truly 4% faster
    # than exact: tried one after the other, exact's trial steps would come 9 steps after 16-bit
    # CERAR's (18% of drift in its favour). In turns, with the rounds alternating, both methods'
    # two counted steps lie at the same mean step, so the drift leaves their ratio as it is.
    factors = {"cerar-fp16": 1.0, "exact": 1.04, "fp16": 1.1, "cerar": 1.1}
    engine = AutoEngine(CANDIDATES, CONFIG, Identity())  # type: ignore[arg-type]
    drive(engine, range(DECIDED + 1), lambda step, c, v: v * 1e-9 * factors[c.name] * (1 - 0.02 * step))
    uniform = next(e["step_s"] for e in engine.history if e["event"] == "decide")
    assert uniform["exact"] / uniform["cerar-fp16 c=8"] == pytest.approx(1.04)
    assert min(uniform, key=uniform.get) == "cerar-fp16 c=8"
    assert {name for name, _ in plan_of(engine).values()} == {"cerar-fp16"}


def test_engines_that_measured_differently_cut_alike() -> None:
    # Only rank 0 sees exact's steps slow: alone, rank 1 would try exact in full; agreed (the
    # slowest rank's step), both cut it at the same step and decide at the same step.
    skew = [{"exact": 3.0}, {}]
    group, engines = PairedGroup(), [None, None]
    config = replace(CONFIG, prune_tol=0.25)

    def flat(rank: int) -> Timing:  # every method alike, but for the skew
        return lambda step, c, v: v * 1e-9 * skew[rank].get(c.name, 1.0)

    def rank_main(rank: int) -> None:
        engine = AutoEngine(CANDIDATES, config, group.member(rank))  # type: ignore[arg-type]
        drive(engine, range(12), flat(rank))
        engines[rank] = engine

    alone = AutoEngine(CANDIDATES, config, Identity())  # type: ignore[arg-type]
    drive(alone, range(DECIDED + 1), flat(1))
    assert alone.pruned == set() and alone.phase(DECIDED - 1)[:2] == ("trial", 0)
    in_two_threads(rank_main)
    first, second = engines
    assert first is not None and second is not None
    assert first.pruned == second.pruned == {0}
    assert first.history == second.history and plan_of(first) == plan_of(second)
    assert [e["step"] for e in first.history if e["event"] == "decide"] == [11]  # 1 + 4 + 3 + 3


def test_prune_tol_is_checked() -> None:
    with pytest.raises(ValueError, match="prune_tol"):
        AutoConfig(prune_tol=-0.1)


def test_link_clock_splits_overlapping_calls() -> None:
    clock = LinkClock({"cerar": 1, "torch": 1})  # both one call at a time (torch on NCCL)
    # One transport: a call queued behind another is served from that one's completion.
    a, b = clock.launch("cerar", 0.0), clock.launch("cerar", 1.0)
    assert (clock.done(a, 3.0), clock.done(b, 5.0)) == (3.0, 2.0)
    # Two transports: the second overlaps the first for 1 s, which they share.
    c, d = clock.launch("cerar", 10.0), clock.launch("torch", 11.0)
    assert clock.done(d, 12.0) == pytest.approx(0.5)
    assert clock.done(c, 15.0) == pytest.approx(1.0 + 0.5 + 3.0)
    # A torch call queued behind another, both beside one CERAR call.
    e, f, g = clock.launch("cerar", 20.0), clock.launch("torch", 21.0), clock.launch("torch", 22.0)
    assert clock.done(f, 23.0) == pytest.approx(1.0)  # 21..23, shared
    assert clock.done(g, 24.0) == pytest.approx(0.5)  # served 23..24, shared
    assert clock.done(e, 26.0) == pytest.approx(1.0 + 1.5 + 2.0)
    # Gloo runs two of torch's calls side by side; a third waits for one of them.
    gloo = LinkClock({"cerar": 1, "torch": 2})
    f, g, h = gloo.launch("torch", 0.0), gloo.launch("torch", 1.0), gloo.launch("torch", 1.5)
    assert gloo.done(g, 2.0) == pytest.approx(0.5)  # 1..2 beside f
    assert gloo.done(f, 3.0) == pytest.approx(1.0 + 0.5 + 0.5)  # 0..1 alone, 1..3 shared (h from 2)
    assert gloo.done(h, 4.0) == pytest.approx(0.5 + 1.0)


@pytest.mark.parametrize("torch_servers", [1, 2])
def test_link_clock_shares_add_up_to_the_busy_time(torch_servers: int) -> None:
    """Random calls on two transports, against the union of their service intervals worked
    out apart: the shares add up to the time the link was busy, none negative or longer than its
    own service interval."""
    servers = {"cerar": 1, "torch": torch_servers}
    rng = random.Random(7)
    for _ in range(50):
        calls = []  # (launch, duration, transport)
        for transport in ("cerar", "torch"):
            t = 0.0
            for _ in range(rng.randint(1, 6)):
                t += rng.uniform(0.0, 2.0)
                calls.append((t, rng.uniform(0.1, 3.0), transport))
        # The service intervals, worked out without the clock: each call in launch order takes
        # the transport's server that frees first.
        intervals, free = {}, {name: [0.0] * count for name, count in servers.items()}
        for i, (launch, duration, transport) in sorted(enumerate(calls), key=lambda item: item[1][0]):
            first = min(range(len(free[transport])), key=free[transport].__getitem__)
            begin = max(launch, free[transport][first])
            free[transport][first] = begin + duration
            intervals[i] = (launch, begin, begin + duration)
        clock, events = LinkClock(servers), []
        for i, (launch, _, end) in intervals.items():
            events += [(launch, 0, i), (end, 1, i)]
        tokens, shares = {}, {}
        for time_s, kind, i in sorted(events):
            if kind == 0:
                tokens[i] = clock.launch(calls[i][2], time_s)
            else:
                shares[i] = clock.done(tokens[i], time_s)
        union, reach = 0.0, -math.inf
        for _, begin, end in sorted(intervals.values(), key=lambda v: v[1]):
            union += max(0.0, end - max(begin, reach))
            reach = max(reach, end)
        assert sum(shares.values()) == pytest.approx(union)
        for i, (_, begin, end) in intervals.items():
            assert 0.0 < shares[i] <= end - begin + 1e-12
