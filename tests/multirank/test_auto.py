"""``method="auto"`` on Gloo ranks: every rank runs the same tournament and crowns the same method
(DDP and the collective); settings that differ between ranks raise on every rank naming the
setting; a candidate that fails is out and its call goes exact; ``nonfinite="raise"`` holds under
every candidate; the collective's streams are bounded; 16-bit CERAR takes a fresh scale only
after another method's call."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch._dynamo  # DDP imports it when first built: once here, not in every forked rank
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from multirank import RankFailure, check, run_ranks

pytestmark = pytest.mark.multirank
TIMEOUT = 120.0


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))


def _ddp_auto(rank: int, world_size: int, fail_cerar: bool) -> dict[str, Any]:
    from cerar.comm.auto import ddp as auto_ddp
    from cerar.ddp import AutoConfig, AutoState, auto_hook

    if fail_cerar:  # every CERAR candidate fails to start, on every rank

        start = auto_ddp._start

        def refuse(state: Any, candidate: Any, *args: Any) -> Any:
            if candidate.route.coded:
                raise ValueError("injected failure")
            return start(state, candidate, *args)

        auto_ddp._start = refuse
    model = DDP(_model(), bucket_cap_mb=0.005)  # several buckets
    state = AutoState(max_error=0.1, auto=AutoConfig(trials=1, recheck_every=3))
    model.register_comm_hook(state, auto_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    reasons, methods = set(), []
    for step in range(20):
        g = torch.Generator().manual_seed(100 * step + rank)
        optimizer.zero_grad()
        model(torch.randn(8, 16, generator=g)).square().mean().backward()
        optimizer.step()
        assert state.last_step is not None
        reasons |= {b.reason for b in state.last_step.buckets}
        methods.append(sorted({b.method for b in state.last_step.buckets}))
    events = [{k: v for k, v in h.items() if k != "run"} for h in state.decisions]
    return {"events": events, "methods": methods, "reasons": reasons, "plan": state.plan}


@pytest.mark.parametrize("fail_cerar", [False, True])
def test_ddp_ranks_run_the_same_tournament(fail_cerar: bool) -> None:
    results = check(run_ranks(_ddp_auto, 3, fail_cerar, timeout=TIMEOUT))
    assert results[0]["events"] == results[1]["events"] == results[2]["events"]  # agreed times, one rule
    assert results[0]["methods"] == results[1]["methods"] == results[2]["methods"]
    events = [e["event"] for e in results[0]["events"]]
    assert "decision" in events and "duel" in events  # recheck_every=3: a duel in 20 steps
    if fail_cerar:
        failed = {e["candidate"] for e in results[0]["events"] if e["event"] == "failed"}
        assert failed == {"cerar c=6", "cerar-fp16 c=6"} and "fallback" in results[0]["reasons"]
        assert results[0]["plan"]["winner"] in ("exact", "fp16")


def _ddp_resumed(rank: int, world_size: int) -> dict[str, Any]:
    from cerar.ddp import AutoConfig, AutoState, auto_hook

    model = DDP(_model(), bucket_cap_mb=0.005)
    state = AutoState(max_error=0.1, auto=AutoConfig(trials=1))
    model.register_comm_hook(state, auto_hook)

    def step(seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        model(torch.randn(8, 16, generator=g)).square().mean().backward()

    for i in range(4):
        step(10 * i + rank)
    side = state.side
    saved = AutoState(max_error=1e-3, auto=AutoConfig(trials=2)).state_dict()  # a checkpoint's settings
    state.load_state_dict(saved)
    for i in range(4, 8):
        step(10 * i + rank)
    assert state.last_step is not None
    return {"same_side": state.side is side, "max_error": state.max_error, "trials": state.auto.trials,
            "reasons": sorted({b.reason for b in state.last_step.buckets})}  # fmt: skip


def test_ddp_a_checkpoint_loaded_mid_run_restarts_the_tournament_on_the_same_side_group() -> None:
    results = check(run_ranks(_ddp_resumed, 2, timeout=TIMEOUT))
    assert results[0] == results[1]
    assert results[0]["same_side"] and results[0]["max_error"] == 1e-3 and results[0]["trials"] == 2


def _ddp_differing(rank: int, world_size: int) -> str:
    from cerar.ddp import AutoState, auto_hook

    model = DDP(_model())
    model.register_comm_hook(AutoState(max_error=1e-3 if rank == 1 else 0.1), auto_hook)
    model(torch.randn(8, 16)).sum().backward()
    return "no error"


def test_ddp_settings_that_differ_raise_on_every_rank() -> None:
    results = run_ranks(_ddp_differing, 3, timeout=TIMEOUT, pg_timeout=20.0)
    for failure in results:
        assert isinstance(failure, RankFailure) and "SettingsMismatchError" in failure.message + failure.type_name
        assert "different max_error" in failure.message and "rank 1: 0.001" in failure.message


def _collective(rank: int, world_size: int, fail_fp16: bool) -> dict[str, Any]:
    from cerar.comm.auto import collective as auto_collective
    from cerar.comm.auto.candidates import Candidate
    from cerar.comm.auto.tournament import AutoConfig

    if fail_fp16:
        start = Candidate.start

        def refusing(candidate: Any, *args: Any) -> Any:
            if candidate.name == "fp16":
                raise ValueError("injected failure")
            return start(candidate, *args)

        Candidate.start = refusing  # type: ignore[method-assign]
    x = torch.randn(4096, generator=torch.Generator().manual_seed(rank))
    exact = x.clone()
    dist.all_reduce(exact)
    errors = []
    for _ in range(1 + 4 * 3 + 3):  # the warm-up, three rounds of up to four, then the winner
        y = x.clone()
        auto_collective.auto_all_reduce(y, max_error=0.1, config=AutoConfig(trials=2))  # a short tournament
        errors.append(float((y - exact).norm() / exact.norm()))
    (stream,) = auto_collective.auto_status()
    return {"history": [{k: v for k, v in h.items() if k != "run"} for h in stream["history"]],
            "choice": stream["choice"], "errors": errors}  # fmt: skip


@pytest.mark.parametrize("fail_fp16", [False, True])
def test_collective_ranks_choose_alike(fail_fp16: bool) -> None:
    results = check(run_ranks(_collective, 3, fail_fp16, timeout=TIMEOUT))
    assert results[0]["history"] == results[1]["history"] == results[2]["history"]
    assert results[0]["choice"] is not None and results[0]["choice"] == results[2]["choice"]
    for r in results:
        assert max(r["errors"]) < 0.1  # every candidate within the budget
    if fail_fp16:
        assert {"event": "failed", "candidate": "fp16"} in results[0]["history"]


def _collective_differing(rank: int, world_size: int, setting: str) -> str:
    import cerar

    x = torch.randn(1000)
    kwargs: dict[str, Any] = {"max_error": 0.1, "op": "sum"}
    if rank == 1:
        if setting == "max_error":
            kwargs["max_error"] = 1e-3
        elif setting == "op":
            kwargs["op"] = "avg"
        elif setting == "dtype":
            x = x.double()
        else:
            x = torch.randn(1001)
    cerar.all_reduce(x, method="auto", **kwargs)
    return "no error"


@pytest.mark.parametrize("setting", ["max_error", "op", "dtype", "size"])
def test_collective_settings_that_differ_raise_on_every_rank(setting: str) -> None:
    results = run_ranks(_collective_differing, 3, setting, timeout=TIMEOUT, pg_timeout=20.0)
    for failure in results:
        assert isinstance(failure, RankFailure) and failure.type_name == "SettingsMismatchError", failure
        assert f"different {setting}" in failure.message


def _nonfinite(rank: int, world_size: int) -> list[str]:
    import cerar
    from cerar.comm.auto.collective import auto_all_reduce, auto_status
    from cerar.comm.auto.tournament import AutoConfig

    config = AutoConfig(pins="0,-,ring,fp16,-")  # the float16 ring after the exact warm-up
    outcomes = []
    for _ in range(3):
        x = torch.ones(1000)
        if rank == 1:
            x[7] = float("nan")
        try:
            auto_all_reduce(x, nonfinite="raise", config=config)
            outcomes.append("passed")
        except cerar.NonFiniteError:
            outcomes.append("raised")
    (stream,) = auto_status()
    return [*outcomes, stream["choice"]["method"]]


def test_collective_nonfinite_raise_holds_under_the_rings() -> None:
    results = check(run_ranks(_nonfinite, 3, timeout=TIMEOUT))
    assert results[0] == results[1] == results[2] == ["raised", "raised", "raised", "fp16"]


def _exact_bytes(rank: int, world_size: int) -> list[int]:
    from cerar.comm.auto.collective import auto_all_reduce
    from cerar.comm.auto.tournament import AutoConfig
    from cerar.comm.runtime.stats import CommStats

    config = AutoConfig(pins="0,-,ring,fp32,-")  # the exact candidate only
    sent = []
    for _ in range(3):
        stats = CommStats()
        auto_all_reduce(torch.ones(3000), config=config, stats=stats)
        sent.append(stats.bytes_sent)
    return sent


def test_collective_counts_the_exact_candidates_bytes_by_the_ring_formula() -> None:
    for sent in check(run_ranks(_exact_bytes, 3, timeout=TIMEOUT)):
        assert sent == [2 * 2 * 1000 * 4] * 3  # 2(N-1)/N of 12 kB


def _streams(rank: int, world_size: int) -> list[int]:
    from cerar.comm.auto.collective import auto_all_reduce, auto_status
    from cerar.comm.auto.tournament import AutoConfig

    config = AutoConfig(max_streams=3)
    for size in (100, 200, 300, 400, 500, 200):
        auto_all_reduce(torch.ones(size), config=config)
    return [s["numel"] for s in auto_status()]


def test_collective_streams_are_bounded_least_recently_used_first() -> None:
    results = check(run_ranks(_streams, 2, timeout=TIMEOUT))
    assert results[0] == results[1] == [400, 500, 200]


def _fresh_scales(rank: int, world_size: int) -> dict[str, Any]:
    from cerar.comm.auto import collective as auto_collective
    from cerar.comm.auto.tournament import AutoConfig
    from cerar.comm.collective import routes

    fresh: list[bool] = []  # per 16-bit CERAR call, whether it took a fresh scale
    cerar_call = routes.cerar_call

    def recording(request: Any, *args: Any, **kwargs: Any) -> Any:
        if request.packet_dtype is not None:
            fresh.append(bool(request.fresh_scale))
        return cerar_call(request, *args, **kwargs)

    routes.cerar_call = recording
    config = AutoConfig(trials=2, pins="0,-,cerar,fp16,-")  # 16-bit CERAR only, after the warm-up
    x = torch.randn(4096, generator=torch.Generator().manual_seed(rank))
    exact = x.clone()
    dist.all_reduce(exact)
    errors = []
    for _ in range(5):
        y = x.clone()
        auto_collective.auto_all_reduce(y, max_error=2e-2, config=config)
        errors.append(float((y - exact).norm() / exact.norm()))
    return {"fresh": fresh, "error": max(errors)}


def test_16bit_cerar_takes_a_fresh_scale_only_after_another_methods_call() -> None:
    results = check(run_ranks(_fresh_scales, 3, timeout=TIMEOUT))
    for r in results:
        assert r["fresh"] == [True, False, False, False]  # after the exact warm-up, then its own calls
        assert r["error"] < 2e-2
    assert not math.isnan(results[0]["error"])
