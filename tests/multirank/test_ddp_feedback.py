"""Error feedback in the DDP hooks (``CerarState(error_feedback=True)``): training keeps the replicas
bitwise equal with one residual per bucket of the bucket's padded size; the mean of the hook's
output over repeated calls converges to the exact mean; residuals survive ``state_dict`` (through
``torch.load(weights_only=True)``) bitwise, are dropped when a bucket's layout changes and at a
re-sync, stay finite after a NaN under ``nonfinite="ignore"``; the rows that take no feedback
refuse it at the first bucket, and ranks that disagree on it raise ``SettingsMismatchError``.

Every multi-rank test runs 4 Gloo ranks through :func:`multirank.run_ranks` with its own timeout.
"""

from __future__ import annotations

import copy
import functools
import io
import math
from typing import Any

import pytest
import torch
import torch._dynamo  # DDP imports it when first built: once here, not in every forked rank
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from cerar import ErrorFeedback
from cerar.comm.ddp.checkpoint import PREVIOUS_FORMAT
from cerar.ddp import STATE_DICT_FORMAT, CerarState, get_hook
from multirank import check, run_ranks

pytestmark = pytest.mark.multirank
TIMEOUT = 120.0
WORLD = 4
#: The rows whose hooks take error feedback, in both shapes.
FED = ("direct-int4", "ring-int4")
Log = list[list[tuple[int, int, str]]]


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    # With the tiny bucket cap, DDP rebuilds its one first bucket into two of different sizes.
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))


def _batch(rank: int, step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(32, 16, generator=g)
    return x, (x[:, :4] * 2.0).tanh() + 0.1 * torch.randn(32, 4, generator=g)


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def _flat_grad(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def _flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _ddp(model: nn.Module) -> DDP:
    return DDP(model, bucket_cap_mb=0.005)  # no buffers: nothing to broadcast


def _gather(tensor: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(out, tensor)
    return out


def _same_everywhere(tensor: torch.Tensor) -> bool:
    everyone = _gather(tensor)
    return all(torch.equal(t, everyone[0]) for t in everyone)


def _state(error_feedback: bool = True, **kwargs: Any) -> CerarState:
    # The test's buckets are far below the default bucket policy's threshold; int4 needs an error
    # budget above the default's.
    return CerarState(error_feedback=error_feedback, min_bucket_bytes=0, max_error=None, **kwargs)


def _layout(bucket: dist.GradBucket) -> str:
    return ";".join("x".join(map(str, p.shape)) for p in bucket.parameters())


def _recording(hook: Any, log: Log) -> Any:
    """``hook``, noting each bucket's (index, values, layout) under the current pass (DDP checks
    the annotations: ``wraps`` exposes the hook's own)."""

    @functools.wraps(hook)
    def recorded(state: CerarState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        log[-1].append((bucket.index(), bucket.buffer().numel(), _layout(bucket)))
        return hook(state, bucket)

    return recorded


def _hooked(method: str, state: CerarState, log: Log | None = None, seed: int = 0) -> DDP:
    model = _ddp(_model(seed))
    hook = get_hook(method)
    model.register_comm_hook(state, hook if log is None else _recording(hook, log))
    return model


def _padded(values: int) -> int:
    return WORLD * math.ceil(values / WORLD)


def _residuals_finite(state: CerarState) -> bool:
    return all(s.residual is None or bool(torch.isfinite(s.residual).all()) for _, s in state.residuals.values())


# ---------------------------------------------------------------------------------------------
# 1. Training: replicas bitwise equal, one residual per bucket of its padded size, the peak memory


def _train(rank: int, world_size: int, method: str) -> dict[str, Any]:
    fed_log: Log = [[]]
    plain_log: Log = [[]]
    fed, plain = _state(True), _state(False)
    models = {"fed": _hooked(method, fed, fed_log), "plain": _hooked(method, plain, plain_log)}
    optimizers = {name: torch.optim.SGD(m.parameters(), lr=0.2) for name, m in models.items()}
    identical, finite, held, differs = [], [], [], []
    for step in range(4):  # DDP rebuilds its buckets after the first step: the layouts change
        for name, model in models.items():
            optimizers[name].zero_grad()
            _loss(model, _batch(rank, step)).backward()
            optimizers[name].step()
        fed_log.append([])
        plain_log.append([])
        identical.append(_same_everywhere(_flat_params(models["fed"])))
        finite.append(_residuals_finite(fed))
        held.append(sum(float(s.residual.abs().sum()) for _, s in fed.residuals.values() if s.residual is not None))
        differs.append(not torch.equal(_flat_params(models["fed"]), _flat_params(models["plain"])))
    last = fed_log[-2]  # the last pass's buckets (index, values, layout)
    residuals = {i: (layout, store.identity, store.nbytes) for i, (layout, store) in fed.residuals.items()}
    return {
        "identical": identical,
        "finite": finite,
        "held": held,
        "differs": differs,
        "last": last,
        "passes": [len(p) for p in fed_log[:-1]],
        "residuals": residuals,
        "feedback_bytes": fed.feedback_bytes,
        "plain_residuals": (len(plain.residuals), plain.feedback_bytes),
        "largest": max(n for p in fed_log for _, n, _ in p),
        "peaks": (fed.stats.peak_extra_bytes, plain.stats.peak_extra_bytes),
        "calls": fed.stats.calls,
    }


@pytest.mark.parametrize("method", FED)
def test_training_keeps_replicas_equal_with_one_residual_per_bucket(method: str) -> None:
    for out in check(run_ranks(_train, WORLD, method, timeout=TIMEOUT)):
        assert all(out["identical"]), out["identical"]  # bitwise, after every step
        assert all(out["finite"]) and all(h > 0 for h in out["held"]), out["held"]  # held, finite
        assert any(out["differs"])  # the residuals change what is sent
        assert out["passes"][0] == 1 and out["passes"][-1] >= 2  # the rebuild ran
        last = out["last"]
        assert sorted(out["residuals"]) == sorted(i for i, _, _ in last)  # one per bucket, no stale one
        for index, values, layout in last:
            held_layout, identity, nbytes = out["residuals"][index]
            assert held_layout == f"{method}:{layout}"  # the row, then the parameters' shapes
            assert identity == (method, values, WORLD)
            assert nbytes == 4 * _padded(values)  # float32, the padded bucket's size
        assert out["feedback_bytes"] == sum(4 * _padded(values) for _, values, _ in last)
        assert out["plain_residuals"] == (0, 0)
        fed, plain = out["peaks"]
        assert fed - plain >= 4 * _padded(out["largest"]), (out["peaks"], out["largest"])
        assert out["calls"] == sum(out["passes"])


# ---------------------------------------------------------------------------------------------
# 2. The same gradient again and again: the mean of the hook's output converges with feedback


def _repeated(rank: int, world_size: int, method: str, repeats: int) -> dict[str, Any]:
    batch = _batch(rank, 7)
    plain_model = _model()
    _loss(plain_model, batch).backward()
    exact = torch.stack(_gather(_flat_grad(plain_model).double())).mean(0)
    fed, plain = _state(True), _state(False)
    models = {"fed": _hooked(method, fed), "plain": _hooked(method, plain)}
    outputs: dict[str, list[torch.Tensor]] = {name: [] for name in models}
    for repeat in range(repeats + 1):  # the first pass (DDP's one first bucket) is left out
        for name, model in models.items():
            model.zero_grad()
            _loss(model, batch).backward()
            if repeat:
                outputs[name].append(_flat_grad(model).double())
    fed_outputs, plain_outputs = outputs["fed"], outputs["plain"]
    fed_mean, plain_mean = torch.stack(fed_outputs).mean(0), torch.stack(plain_outputs).mean(0)

    def error(x: torch.Tensor) -> float:
        return float(torch.linalg.vector_norm(x - exact))

    return {
        "first_same": torch.equal(fed_outputs[0], plain_outputs[0]),  # the rebuilt buckets start from no residual
        "plain_repeats": all(torch.equal(o, plain_outputs[0]) for o in plain_outputs),
        "fed_changes": sum(not torch.equal(o, fed_outputs[0]) for o in fed_outputs),
        "means_differ": not torch.equal(fed_mean, plain_mean),
        "fed_error": error(fed_mean),
        "plain_error": error(plain_mean),
        "single_fed_error": max(error(o) for o in fed_outputs),
        "scale": float(torch.linalg.vector_norm(exact)),
    }


@pytest.mark.parametrize("method", FED)
def test_the_mean_of_repeated_outputs_converges_with_feedback(method: str) -> None:
    repeats = 8
    for out in check(run_ranks(_repeated, WORLD, method, repeats, timeout=TIMEOUT)):
        assert out["first_same"] and out["plain_repeats"]
        assert out["fed_changes"] >= repeats // 2 and out["means_differ"]
        assert 0 < out["plain_error"] < 0.5 * out["scale"]  # int4 really rounds
        # Without feedback every call rounds the same way: the mean keeps the one call's error.
        # With it, what one call rounds away the next sends: the mean's error shrinks about as 1/K.
        assert out["fed_error"] < 0.5 * out["plain_error"], out
        assert out["single_fed_error"] < 4 * out["plain_error"]  # each call stays about as good


# ---------------------------------------------------------------------------------------------
# 3. state_dict with residuals: weights_only round trip, and the loaded state continues bitwise


def _step(model: DDP, optimizer: torch.optim.Optimizer, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
    optimizer.zero_grad()
    _loss(model, batch).backward()
    optimizer.step()


def _resumed(module: nn.Module, method: str, saved: dict[str, Any], optimizer_saved: dict[str, Any]) -> Any:
    """A new DDP model at the saved parameters with a fresh state that loads ``saved`` once DDP has
    rebuilt its buckets (a fresh DDP's first pass runs one bucket of another layout, whatever the state)."""
    state = CerarState(max_error=None)  # the defaults: exact all-reduce for the warm-up pass, no feedback
    model = _ddp(module)
    model.register_comm_hook(state, get_hook(method))
    _loss(model, _batch(dist.get_rank(), 50)).backward()  # the warm-up: DDP rebuilds its buckets
    calls_before = state.stats.calls
    state.load_state_dict(saved)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    optimizer.load_state_dict(optimizer_saved)
    return model, state, optimizer, calls_before


def _checkpoint(rank: int, world_size: int, method: str) -> dict[str, Any]:
    state = _state(True)
    model = _hooked(method, state)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(2):
        _step(model, optimizer, _batch(rank, step))
    buffer = io.BytesIO()
    torch.save(state.state_dict(), buffer)
    module_saved = copy.deepcopy(model.module.state_dict())
    optimizer_saved = copy.deepcopy(optimizer.state_dict())
    _step(model, optimizer, _batch(rank, 2))  # the original carries on

    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    out: dict[str, Any] = {"format": loaded["format"], "error_feedback": loaded["error_feedback"], "saved": {}}
    for index, entry in loaded["residuals"].items():
        residual = entry["residual"]
        layout, identity = entry["layout"], entry["identity"]
        out["saved"][index] = (layout, identity, residual.dtype, residual.numel(), residual.device.type)
    runs = {}
    for name, saved in {"loaded": loaded, "without_residuals": {**loaded, "residuals": {}}}.items():
        module = _model(seed=1)  # other weights: the saved ones must be what counts
        module.load_state_dict(module_saved)
        resumed, resumed_state, resumed_optimizer, calls_before = _resumed(module, method, saved, optimizer_saved)
        held = {i: s.residual.clone() for i, (_, s) in resumed_state.residuals.items()}
        _step(resumed, resumed_optimizer, _batch(rank, 2))
        runs[name] = (resumed, resumed_state, held, calls_before)
    resumed, resumed_state, held, calls_before = runs["loaded"]
    out["warm_up_exact"] = calls_before == 0
    out["settings"] = (resumed_state.error_feedback, resumed_state.min_bucket_bytes, resumed_state.iteration)
    out["loaded_equal"] = sorted(held) == sorted(out["saved"]) and all(
        torch.equal(held[i], loaded["residuals"][i]["residual"]) for i in held
    )
    out["same_params"] = torch.equal(_flat_params(resumed), _flat_params(model))
    out["same_residuals"] = sorted(resumed_state.residuals) == sorted(state.residuals) and all(
        layout == resumed_state.residuals[i][0] and torch.equal(store.residual, resumed_state.residuals[i][1].residual)
        for i, (layout, store) in state.residuals.items()
    )
    out["without_residuals_differs"] = not torch.equal(_flat_params(runs["without_residuals"][0]), _flat_params(model))
    out["iterations"] = (state.iteration, resumed_state.iteration)
    return out


@pytest.mark.parametrize("method", FED)
def test_state_dict_round_trips_residuals_and_the_loaded_state_continues_bitwise(method: str) -> None:
    for out in check(run_ranks(_checkpoint, WORLD, method, timeout=TIMEOUT)):
        assert out["format"] == STATE_DICT_FORMAT == "cerar.comm.ddp.hooks.CerarState/4"
        assert out["error_feedback"] is True
        assert len(out["saved"]) == 2  # the rebuilt buckets' residuals
        for layout, identity, dtype, numel, device in out["saved"].values():
            assert isinstance(layout, str) and identity[0] == method and identity[2] == WORLD
            assert (dtype, numel, device) == (torch.float32, _padded(identity[1]), "cpu")
        assert out["warm_up_exact"] and out["settings"] == (True, 0, 3)
        assert out["loaded_equal"]
        assert out["same_params"] and out["same_residuals"]  # bitwise the original's step
        assert out["without_residuals_differs"]  # the residuals are what made it so
        assert out["iterations"] == (3, 3)


def test_a_format_3_state_dict_still_loads() -> None:
    saved = CerarState(min_bucket_bytes=4096, resync_every=3).state_dict()
    assert saved["format"] == STATE_DICT_FORMAT and saved["residuals"] == {} and saved["error_feedback"] is False
    old = {k: v for k, v in saved.items() if k not in ("error_feedback", "residuals")}
    old["format"] = PREVIOUS_FORMAT
    assert PREVIOUS_FORMAT == "cerar.comm.ddp.hooks.CerarState/3"
    state = CerarState(error_feedback=True)
    state.residuals[0] = ("4x4", ErrorFeedback())
    state.load_state_dict(old)
    assert (state.error_feedback, state.residuals, state.min_bucket_bytes, state.resync_every) == (False, {}, 4096, 3)
    assert state.state_dict() == saved  # saved again as format 4


def _filled(values: int = 6, padded: int = 8) -> dict[str, Any]:
    return {"identity": ("direct-int4", values, WORLD), "residual": torch.arange(padded, dtype=torch.float32)}


@pytest.mark.parametrize(
    "residuals",
    [
        5,
        {0: 3},
        {0: {"identity": None, "residual": None}},  # no layout
        {0: {"layout": 7, "identity": None, "residual": None}},
        {"0": {"layout": "4", "identity": None, "residual": None}},
        {-1: {"layout": "4", "identity": None, "residual": None}},
        {True: {"layout": "4", "identity": None, "residual": None}},
        {0: {"layout": "4", "identity": ("direct-int4", 6, WORLD), "residual": None}},
        {0: {"layout": "4", **_filled(), "residual": torch.zeros(8, dtype=torch.float64)}},
        {0: {"layout": "4", **_filled(), "identity": "abc"}},
        {0: {"layout": "4", **_filled(), "identity": ("direct-int4", -6, WORLD)}},
        {0: {"layout": "4", **_filled(), "residual": torch.zeros(2, 4)}},
        {0: {"layout": "4", **_filled(), "residual": torch.zeros(7)}},  # not the padded size of 6 values
    ],
)
def test_a_malformed_residual_is_refused_naming_the_key(residuals: Any) -> None:
    state = CerarState(error_feedback=True)
    before = state.state_dict()
    with pytest.raises((ValueError, TypeError, KeyError), match="'residuals'"):
        state.load_state_dict({**before, "residuals": residuals})
    assert state.state_dict() == before  # unchanged


def test_a_format_4_state_dict_without_residuals_is_refused() -> None:
    saved = CerarState().state_dict()
    del saved["residuals"]
    with pytest.raises(KeyError, match=r"missing keys \['residuals'\]"):
        CerarState().load_state_dict(saved)


def test_well_formed_residuals_load() -> None:
    entry = {"layout": "4;4x64", **_filled()}
    state = CerarState(error_feedback=True)
    state.load_state_dict({**state.state_dict(), "residuals": {0: entry, 3: {"layout": "2", "identity": None,
                                                                             "residual": None}}})  # fmt: skip
    assert sorted(state.residuals) == [0, 3] and state.residuals[0][0] == "4;4x64"
    assert state.residuals[0][1].identity == ("direct-int4", 6, WORLD) and state.residuals[3][1].identity is None
    assert torch.equal(state.residuals[0][1].residual, entry["residual"]) and state.feedback_bytes == 32


# ---------------------------------------------------------------------------------------------
# 4. A new layout drops a bucket's residual; so does every re-sync


def test_a_new_layout_gets_a_fresh_store_and_the_same_layout_keeps_its_own() -> None:
    state = CerarState(error_feedback=True)
    state.load_state_dict({**state.state_dict(), "residuals": {0: {"layout": "4;4x64", **_filled()}}})
    kept = state.residuals[0][1]
    assert state.feedback_for(0, "4;4x64") is kept and state.feedback_bytes == 32
    fresh = state.feedback_for(0, "64;64x16")
    assert fresh is not kept and (fresh.identity, fresh.residual, fresh.nbytes) == (None, None, 0)
    assert state.residuals[0] == ("64;64x16", fresh) and state.feedback_bytes == 0
    assert state.feedback_for(0, "64;64x16") is fresh
    assert state.feedback_for(5, "2") is state.residuals[5][1] and sorted(state.residuals) == [0, 5]


def _resync_each_step(rank: int, world_size: int, method: str) -> dict[str, Any]:
    fed = _state(True, resync_every=1)
    plain = _state(False)
    models = {"fed": _hooked(method, fed), "plain": _hooked(method, plain)}
    optimizers = {name: torch.optim.SGD(m.parameters(), lr=0.2) for name, m in models.items()}
    fed.attach(models["fed"], optimizers["fed"])
    record = []
    for step in range(4):
        for name, model in models.items():
            optimizers[name].zero_grad()
            _loss(model, _batch(rank, step)).backward()
        held = (len(fed.residuals), fed.feedback_bytes)
        # With the residuals dropped after each step, every step starts from none: the same as no feedback.
        same = torch.equal(_flat_grad(models["fed"]), _flat_grad(models["plain"]))
        for optimizer in optimizers.values():
            optimizer.step()  # the fed one's post-step hook re-syncs
        record.append({"held": held, "same": same, "after": (sorted(fed.residuals), fed.resyncs)})
    return {"record": record, "steps": fed.steps}


@pytest.mark.parametrize("method", FED)
def test_every_resync_drops_the_residuals(method: str) -> None:
    for out in check(run_ranks(_resync_each_step, WORLD, method, timeout=TIMEOUT)):
        for step, record in enumerate(out["record"]):
            assert record["held"][0] >= 1 and record["held"][1] > 0, record  # the step held residuals
            assert record["after"] == ([], step + 1), record  # and the re-sync dropped them
            assert record["same"], (step, record)  # so no step sent an earlier step's residual
        assert out["steps"] == 4


# ---------------------------------------------------------------------------------------------
# 5. Rows that take no feedback refuse it at the first bucket


def _refused(rank: int, world_size: int, name: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for policy, min_bucket_bytes in (("sent", 0), ("exact", None)):  # None: the default threshold
        kwargs = {} if min_bucket_bytes is None else {"min_bucket_bytes": min_bucket_bytes}
        state = CerarState(error_feedback=True, **kwargs)
        model = _ddp(_model())
        model.register_comm_hook(state, get_hook(name))
        try:
            _loss(model, _batch(rank)).backward()
            out[policy] = "no error"
        except Exception as exc:
            out[policy] = f"{type(exc).__name__}: {exc}"
        out[policy + "_counts"] = (state.stats.calls, state.exact_buckets, sorted(state.residuals))
    return out


@pytest.mark.parametrize("name", ["cerar", "ring"])
def test_rows_without_feedback_refuse_it_at_the_first_bucket(name: str) -> None:
    for out in check(run_ranks(_refused, WORLD, name, timeout=TIMEOUT)):
        for policy in ("sent", "exact"):  # refused even where the bucket policy would send it exact
            message = out[policy]
            assert message.startswith("ValueError: Argument 'error_feedback'"), message
            assert repr(name) in message
            assert out[policy + "_counts"] == (0, 0, [])  # nothing was sent


# ---------------------------------------------------------------------------------------------
# 6. A NaN under nonfinite="ignore": the residuals stay finite


def _nan_ignored(rank: int, world_size: int, method: str) -> dict[str, Any]:
    state = _state(True, nonfinite="ignore")
    model = _hooked(method, state)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    poison = {"on": False}

    def maybe_poison(grad: torch.Tensor) -> torch.Tensor:
        if poison["on"] and rank == 1:
            grad = grad.clone()
            grad[0, 0] = float("nan")
        return grad

    model.module[0].weight.register_hook(maybe_poison)
    record = []
    for step in range(5):
        poison["on"] = step == 2  # after DDP's rebuild
        optimizer.zero_grad()
        _loss(model, _batch(rank, step)).backward()
        grads = _flat_grad(model)
        finite = bool(torch.isfinite(grads).all())
        if finite:
            optimizer.step()  # skip the poisoned update, as a loss scaler would
        held = [s.residual for _, s in state.residuals.values() if s.residual is not None]
        record.append({
            "grads_finite": finite,
            "nonfinite_values": int((~torch.isfinite(grads)).sum()),
            "residuals_finite": _residuals_finite(state),
            "held": len(held),
            "nonzero": sum(int(r.count_nonzero()) for r in held),
        })  # fmt: skip
    return {
        "record": record,
        "events": state.stats.nonfinite_events,
        "fallbacks": state.stats.fallbacks,
        "params_finite": bool(torch.isfinite(_flat_params(model)).all()),
        "identical": _same_everywhere(_flat_params(model)),
    }


@pytest.mark.parametrize("method", FED)
def test_a_nan_under_ignore_leaves_the_residuals_finite(method: str) -> None:
    for out in check(run_ranks(_nan_ignored, WORLD, method, timeout=TIMEOUT)):
        record = out["record"]
        # The NaN's block is NaN on every rank (what "ignore" does), only in that step.
        assert [r["grads_finite"] for r in record] == [True, True, False, True, True], record
        assert 0 < record[2]["nonfinite_values"] < 1000
        assert all(r["residuals_finite"] for r in record), record
        assert all(r["held"] == 2 and r["nonzero"] > 0 for r in record[1:]), record  # still held, not wiped
        assert (out["events"], out["fallbacks"]) == (1, 0)
        assert out["params_finite"] and out["identical"]


# ---------------------------------------------------------------------------------------------
# 7. Ranks that disagree on feedback raise SettingsMismatchError on every rank


def _mixed(rank: int, world_size: int, method: str) -> str:
    state = _state(rank == 0)
    model = _hooked(method, state)
    try:
        _loss(model, _batch(rank)).backward()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


@pytest.mark.parametrize("method", FED)
def test_feedback_on_some_ranks_only_is_a_settings_mismatch_everywhere(method: str) -> None:
    results = check(run_ranks(_mixed, WORLD, method, timeout=60.0, pg_timeout=20.0))
    for message in results:
        # DDP's reducer reads the hook's future: the error comes as a RuntimeError naming it.
        assert "SettingsMismatchError" in message, message
        assert "error feedback" in message, message
