"""``method="auto"`` on Gloo ranks: ranks whose measured timings differ (injected, a different
table per rank, each of which alone would choose another method) end with the same choice, their
results within the chosen method's error; a candidate whose call fails falls back to exact."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch._dynamo  # DDP imports it when first built: once here, not in every forked rank
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from multirank import check, run_ranks

pytestmark = pytest.mark.multirank
TIMEOUT = 120.0

#: Seconds per value each rank "measures" per candidate. Alone, rank 0 would pick 16-bit CERAR,
#: rank 1 exact, rank 2 the float16 ring; the slowest rank's figures (the elementwise maximum:
#: 10, 9, 10, 5) make 16-bit CERAR the choice of all, and the float16 ring without CERAR.
FACTORS = [
    {"exact": 10.0, "fp16": 9.0, "cerar": 10.0, "cerar-fp16": 1.0},
    {"exact": 1.0, "fp16": 8.0, "cerar": 8.0, "cerar-fp16": 5.0},
    {"exact": 3.0, "fp16": 1.0, "cerar": 9.0, "cerar-fp16": 5.0},
]


def _inject_timings(rank: int) -> None:
    """Replace this rank's measurements by ``FACTORS[rank]`` x the slot's values (failures stay inf)."""
    from cerar.comm.auto.engine import AutoEngine

    original = AutoEngine.measured

    def measured(self: AutoEngine, step: int, slot: int, candidate: int, seconds: float) -> None:
        numel = self.layout.get(slot, (1, 0))[0]
        if math.isfinite(seconds):
            seconds = FACTORS[rank][self.candidates[candidate].name] * numel * 1e-9
        original(self, step, slot, candidate, seconds)

    AutoEngine.measured = measured  # type: ignore[method-assign]  # this forked rank only


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))


def _ddp_auto(rank: int, world_size: int, fail_cerar: bool) -> dict[str, Any]:
    from cerar.comm.auto import ddp as auto_ddp
    from cerar.ddp import AutoConfig, AutoState, auto_hook

    _inject_timings(rank)
    if fail_cerar:  # every CERAR candidate fails to start, on every rank

        def refuse(*args: Any) -> Any:
            raise ValueError("injected failure")

        auto_ddp.STARTS.update({"cerar": refuse, "cerar-fp16": refuse})
    module = _model()
    model = DDP(module, bucket_cap_mb=0.005)  # several buckets
    # The timings are injected per call; the steps' own times are real and noisy here, so no
    # trial is cut by them, nor is a plan handed to a ring by them at the decision (both have
    # their tests in tests/unit/test_auto_model.py).
    config = AutoConfig(trials=2, verify_every=100, prune_tol=None, duel_tol=None)
    state = AutoState(max_error=0.1, auto=config)
    model.register_comm_hook(state, auto_hook)
    calibration = config.calibration_steps(4)
    steps = calibration + 2
    reasons = set()
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(32, 16, generator=g), torch.randn(32, 4, generator=g)
        # Gradients 2**6 times larger at every step of the calibration: a 16-bit CERAR trial
        # step's packet scale, remembered from its previous trial step, would no longer fit.
        # (Not where the float16 ring is to be chosen: torch's fp16 hook does not scale, and
        # such gradients overflow float16.)
        growth = 1.0 if fail_cerar else 64.0 ** min(step, calibration - 1)
        # The exact average, from this rank's own gradient (autograd.grad runs no DDP hook).
        local = torch.autograd.grad(growth * nn.functional.mse_loss(module(x), y), list(module.parameters()))
        exact = torch.cat([t.reshape(-1) for t in local])
        dist.all_reduce(exact)
        exact /= world_size
        model.zero_grad()
        (growth * nn.functional.mse_loss(model(x), y)).backward()
        reasons |= {b.reason for b in state.last_step.buckets}
    got = torch.cat([p.grad.reshape(-1) for p in module.parameters()])
    chosen = {b["method"] for b in state.plan}
    errors = {c.label: c.predicted_error for c in state.candidates}
    decided = [e for e in state.decisions if e["event"] == "decide"]
    return {
        "plan": [(b["slot"], b["method"], b["reason"]) for b in state.plan],
        "trial_steps": decided[0]["step_s"] if decided else None,
        "error": float((got - exact).norm() / exact.norm()),
        "bound": 3 * max(errors[m] for m in chosen),
        "reasons": reasons,
        "rescales": state.stats.rescales,
    }


def test_ddp_ranks_with_differing_timings_choose_alike() -> None:
    results = check(run_ranks(_ddp_auto, 3, False, timeout=TIMEOUT))
    assert results[0]["plan"] == results[1]["plan"] == results[2]["plan"]
    assert {method for _, method, _ in results[0]["plan"]} == {"cerar-fp16 c=6"}
    assert {"warmup", "trial", "fastest"} <= results[0]["reasons"]
    # Every candidate's counted trial step was timed (from its pass's last bucket to the next
    # pass's) and agreed: the same positive figures on every rank.
    steps = results[0]["trial_steps"]
    assert steps is not None and len(steps) == 4 and all(t is not None and t > 0.0 for t in steps.values()), steps
    assert results[1]["trial_steps"] == results[2]["trial_steps"] == steps
    for r in results:  # 16-bit CERAR's error: above float32 rounding, within its prediction
        assert 1e-5 < r["error"] < r["bound"], r
        # Its trial steps took turns with the other methods' while the gradients grew: every
        # switch back to it took its scale from the data, so no call was redone.
        assert r["rescales"] == 0, r


def test_ddp_failed_candidate_falls_back_to_exact() -> None:
    results = check(run_ranks(_ddp_auto, 3, True, timeout=TIMEOUT))
    assert results[0]["plan"] == results[1]["plan"] == results[2]["plan"]
    assert "fallback" in results[0]["reasons"]
    # CERAR failed in its trials: ruled out; the slowest rank's best of the rest is the float16 ring.
    assert {method for _, method, _ in results[0]["plan"]} == {"fp16"}
    assert all(r["error"] < 2.0**-11 * math.sqrt(2) for r in results)  # the float16 ring's prediction


def _collective_auto(rank: int, world_size: int, fail_fp16: bool) -> dict[str, Any]:
    import cerar
    from cerar.comm.auto import collective as auto_collective

    _inject_timings(rank)
    if fail_fp16:
        start = auto_collective._start

        def refusing(candidate: Any, *args: Any) -> Any:
            if candidate.name == "fp16":
                raise ValueError("injected failure")
            return start(candidate, *args)

        auto_collective._start = refusing
    x = torch.randn(4096, generator=torch.Generator().manual_seed(rank))
    exact = x.clone()
    dist.all_reduce(exact)
    errors = []
    # 1 exact warm-up, up to 6 trial calls of each of fp16 and exact (COLLECTIVE_CONFIG), the plan.
    calibration = auto_collective.COLLECTIVE_CONFIG.calibration_steps(2)
    for _ in range(calibration + 3):
        y = x.clone()
        cerar.all_reduce(y, method="auto", max_error=1e-3)
        errors.append(float((y - exact).norm() / exact.norm()))
    stream = auto_collective.auto_status()[0]
    return {"choice": stream["choice"]["method"], "error": errors[-1], "trial_errors": max(errors[:calibration])}


@pytest.mark.parametrize("fail_fp16", [False, True])
def test_collective_ranks_choose_alike(fail_fp16: bool) -> None:
    results = check(run_ranks(_collective_auto, 2, fail_fp16, timeout=TIMEOUT))
    assert results[0]["choice"] == results[1]["choice"] == ("exact" if fail_fp16 else "fp16")
    bound = 2.0**-11 * math.sqrt(1.5)  # the float16 ring's predicted error at N = 2
    for r in results:
        assert r["error"] < (1e-6 if fail_fp16 else bound) and r["trial_errors"] < bound


def _collective_mismatch(rank: int, world_size: int, async_op: bool) -> dict[str, Any]:
    import cerar
    from cerar.comm.auto import collective as auto_collective
    from cerar.comm.ring.handshake import SettingsMismatchError

    calls = [0]
    ring_call = auto_collective.ring_call

    def mismatching(*args: Any) -> Any:  # the float16 ring's third call: a mismatch on every rank
        calls[0] += 1
        if calls[0] == 3:
            raise SettingsMismatchError("injected mismatch")
        return ring_call(*args)

    auto_collective.ring_call = mismatching
    x = torch.randn(4096, generator=torch.Generator().manual_seed(rank))
    exact = x.clone()
    dist.all_reduce(exact)
    n = auto_collective.COLLECTIVE_CONFIG.calibration_steps(2) + 3
    ys = [x.clone() for _ in range(n)]
    if async_op:  # two calls in flight at a time
        for i in range(0, n, 2):
            works = [cerar.all_reduce(y, method="auto", max_error=1e-3, async_op=True) for y in ys[i : i + 2]]
            for work in works:
                work.wait()
    else:
        for y in ys:
            cerar.all_reduce(y, method="auto", max_error=1e-3)
    errors = [float((y - exact).norm() / exact.norm()) for y in ys]
    stream = auto_collective.auto_status()[0]
    return {"choice": stream["choice"]["method"], "errors": errors, "mismatched": calls[0] >= 3}


@pytest.mark.parametrize("async_op", [False, True])
def test_collective_mismatch_is_redone_exactly_and_rules_the_candidate_out(async_op: bool) -> None:
    # Calls 1-6 are the float16 ring's trial (after one exact warm-up); its third call (call 3)
    # raises a handshake mismatch: that call is redone exactly, and the ring is out at the decision.
    results = check(run_ranks(_collective_mismatch, 2, async_op, timeout=TIMEOUT))
    bound = 2.0**-11 * math.sqrt(1.5)
    for r in results:
        assert r["mismatched"] and r["choice"] == "exact"
        assert r["errors"][3] < 1e-6 and max(r["errors"]) < bound
        assert all(e < 1e-6 for e in r["errors"][-3:])  # the plan: exact


def _collective_scales(rank: int, world_size: int) -> dict[str, Any]:
    import cerar
    from cerar.comm.auto import collective as auto_collective

    _inject_timings(rank)  # 16-bit CERAR the choice, so that it runs after the decision too
    fresh: list[bool] = []  # per 16-bit CERAR call, whether it took a fresh scale
    cerar_call = auto_collective.cerar_call

    def recording(*args: Any) -> Any:  # (tensor, op, ring, code, nonfinite, stats, packet, fresh)
        if args[6] is not None:
            fresh.append(bool(args[7]))
        return cerar_call(*args)

    auto_collective.cerar_call = recording
    x = torch.randn(4096, generator=torch.Generator().manual_seed(rank))
    exact = x.clone()
    dist.all_reduce(exact)
    errors = []
    for _ in range(auto_collective.COLLECTIVE_CONFIG.calibration_steps(4) + 3):
        y = x.clone()
        cerar.all_reduce(y, method="auto", max_error=2e-2)
        errors.append(float((y - exact).norm() / exact.norm()))
    stream = auto_collective.auto_status()[0]
    return {"choice": stream["choice"]["method"], "fresh": fresh, "error": max(errors)}


def test_collective_counted_trial_calls_keep_their_packet_scale() -> None:
    # 16-bit CERAR's calls in the calibration follow other methods' calls (turns); its warm-up
    # call takes a fresh scale from the data, its counted ones the scale of its call before
    # (as a stream of its calls would), and after the decision it runs on without a fresh one.
    from cerar.comm.auto.collective import COLLECTIVE_CONFIG

    results = check(run_ranks(_collective_scales, 3, timeout=TIMEOUT))
    fresh = results[0]["fresh"]
    assert results[1]["fresh"] == results[2]["fresh"] == fresh
    assert results[0]["choice"] == "cerar-fp16 c=6" and len(fresh) >= COLLECTIVE_CONFIG.trials + 3
    assert fresh == [True] + [False] * (len(fresh) - 1)
    for r in results:
        assert r["error"] < 2e-2
