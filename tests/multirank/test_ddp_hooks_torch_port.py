"""PyTorch's own DDP communication-hook tests, ported to :func:`cerar_hook` and :func:`ring_hook`.

Written anew after the cases of PyTorch's distributed tests (``test_ddp_comm_hook_*``, the hook
parity test, the PowerSGD pickling test, uneven inputs, sparse gradients), on Gloo CPU through
:func:`multirank.run_ranks`. Each case trains a hooked DDP model next to a no-hook DDP model
(torch's own all-reduce) on the same data and compares their gradients at every iteration: the
exact ring must agree to rounding (1e-6 relative), CERAR within a few times its code's error
bound. Related cases share one spawned run so that the file stays fast on CI's 2 cores.
"""

from __future__ import annotations

import copy
import io
import pickle
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch._dynamo  # DDP imports it when first built: once here, not in every forked rank
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP

from cerar.coding import codes
from cerar.coding.linear_code import Code
from cerar.comm.collective.api import default_code
from cerar.ddp import HOOKS, CerarState, cerar_hook, get_hook, ring_hook
from multirank import check, run_ranks

pytestmark = pytest.mark.multirank
WORLD = 3
TIMEOUT = 120.0
ITERS = 4
CAP_MB = 0.002  # 2 KB buckets: the model below spans several once DDP has rebuilt them
HOOK_NAMES = ("cerar", "ring")


# ---------------------------------------------------------------------------------------------
# Models, data, and the comparison with no-hook DDP


class _Net(nn.Module):
    """A small MLP with a second head that a step may leave unused (find_unused_parameters)."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh())
        self.head = nn.Linear(32, 2)
        self.branch = nn.Linear(32, 2)
        self.to(dtype)

    def forward(self, x: torch.Tensor, use_branch: bool = True) -> torch.Tensor:
        h = self.trunk(x)
        return self.head(h) + self.branch(h) if use_branch else self.head(h)


class _Bag(nn.Module):
    """An embedding with sparse gradients and a dense layer: DDP puts the sparse one alone in
    its bucket."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embedding = nn.EmbeddingBag(40, 8, mode="mean", sparse=True)
        self.linear = nn.Linear(8, 2)

    def forward(self, indices: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self.linear(self.embedding(indices, offsets))


def _batch(rank: int, step: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(16, 8, generator=g)
    y = torch.sin(x[:, :2]) + 0.1 * torch.randn(16, 2, generator=g)
    return x.to(dtype), y.to(dtype)


def _backward(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor], use_branch: bool = True) -> None:
    model.zero_grad()
    nn.functional.mse_loss(model(batch[0], use_branch), batch[1]).backward()


def _grads(model: nn.Module) -> torch.Tensor:
    """The gradients that exist (an unused branch has none), flat, in float64."""
    return torch.cat([p.grad.to_dense().reshape(-1).double() for p in model.parameters() if p.grad is not None])


def _gather(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> list[torch.Tensor]:
    out = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, tensor, group=group)
    return out


def _code(world_size: int) -> Code:
    return codes.perturbed(world_size, 2 * world_size)


def _state(which: str, world_size: int, **kwargs: Any) -> CerarState:
    kwargs.setdefault("min_bucket_bytes", 0)  # the test model's buckets: below the 2 MiB default
    return CerarState(code=_code(world_size) if which == "cerar" else None, **kwargs)


def _allowed(which: str, code: Code | None, rank: int, locals_: list[torch.Tensor], expected: torch.Tensor) -> float:
    """The error allowed in this rank's averaged gradient ``expected``, given every rank's local
    gradient: the ring 1e-6 relative; CERAR 4 times its worst error bound ``beta`` relative to
    ``max(||mean||, D_j / N)`` (``D_j``: the other ranks' spread, see Code.error_bound), plus
    float32 rounding."""
    scale = float(torch.linalg.vector_norm(expected))
    if which == "ring":
        return 1e-6 * scale
    assert code is not None
    others = torch.stack([g for i, g in enumerate(locals_) if i != rank])
    spread = float(torch.linalg.vector_norm(others - others.mean(0))) / len(locals_)
    return 4.0 * float(max(code.error_bound)) * max(scale, spread) + 1e-5 * scale


def _compare(
    rank: int,
    which: str,
    ddp_kwargs: dict[str, Any],
    *,
    dtype: torch.dtype = torch.float32,
    use_branch: Callable[[int], bool] = lambda step: True,
    group: dist.ProcessGroup | None = None,
    iters: int = ITERS,
) -> dict[str, Any]:
    """Train a hooked and a no-hook DDP model side by side; after each step the hooked one (and
    a plain copy giving this rank's local gradient) take the no-hook model's parameters, so that
    every iteration compares gradients at equal parameters."""
    base = _Net(dtype)
    ref = DDP(copy.deepcopy(base), bucket_cap_mb=CAP_MB, process_group=group, **ddp_kwargs)
    hooked = DDP(copy.deepcopy(base), bucket_cap_mb=CAP_MB, process_group=group, **ddp_kwargs)
    plain = copy.deepcopy(base)
    step_calls: list[int] = []
    size = dist.get_world_size(group)
    state = _state(which, size, process_group=group, on_step=lambda s, stats: step_calls.append(stats.calls))
    hooked.register_comm_hook(state, HOOKS[which])
    optimizer = torch.optim.SGD(ref.parameters(), lr=0.1)
    ratios, errors, same = [], [], []
    for step in range(iters):
        batch = _batch(rank, step, dtype)
        for model in (ref, hooked, plain):
            _backward(model, batch, use_branch(step))
        expected, got = _grads(ref), _grads(hooked)
        error = float(torch.linalg.vector_norm(got - expected))
        allowed = _allowed(which, state.code, dist.get_rank(group), _gather(_grads(plain), group), expected)
        ratios.append(error / allowed)
        errors.append(error)
        same.append(all(torch.equal(g, got) for g in _gather(got, group)))
        optimizer.step()
        for model in (hooked.module, plain):
            model.load_state_dict(ref.module.state_dict())
    dtypes = {p.grad.dtype for p in hooked.parameters() if p.grad is not None}
    return {
        "ratios": ratios,
        "errors": errors,
        "same_everywhere": all(same),
        "step_calls": step_calls,
        "iteration": state.iteration,
        "dtypes": dtypes,
    }


def _check_case(name: str, case: dict[str, Any], iters: int = ITERS) -> None:
    assert max(case["ratios"]) <= 1.0, (name, case["ratios"])
    assert case["iteration"] == iters, name
    assert len(case["step_calls"]) == iters and min(case["step_calls"]) >= 1, (name, case["step_calls"])
    if name != "find_unused_parameters":  # which starts with the small buckets
        # DDP's first iteration has one bucket; it then rebuilds them to bucket_cap_mb
        # (static_graph after its second iteration).
        assert case["step_calls"][0] == 1 and case["step_calls"][-1] >= 2, (name, case["step_calls"])


# ---------------------------------------------------------------------------------------------
# Parity with no-hook DDP: DDP's options, float64, and PyTorch's own parity test's shape

CONFIGS: dict[str, tuple[dict[str, Any], torch.dtype, Callable[[int], bool]]] = {
    "default": ({}, torch.float32, lambda step: True),
    "gradient_as_bucket_view": ({"gradient_as_bucket_view": True}, torch.float32, lambda step: True),
    "static_graph": ({"static_graph": True}, torch.float32, lambda step: True),
    "find_unused_parameters": ({"find_unused_parameters": True}, torch.float32, lambda step: step % 2 == 1),
    "float64": ({}, torch.float64, lambda step: True),
}


def _torch_shape_parity(rank: int, world_size: int, which: str) -> dict[str, Any]:
    """PyTorch's hook parity test: ``Linear(1, 5)`` fed ``[rank]``, so the weight's averaged
    gradient is ``mean(ranks)``; 20 iterations without an optimizer step."""
    torch.manual_seed(0)
    base = nn.Linear(1, 5)
    ref, hooked = DDP(copy.deepcopy(base)), DDP(copy.deepcopy(base))
    state = _state(which, world_size)
    hooked.register_comm_hook(state, HOOKS[which])
    worst, exact = 0.0, True
    for _ in range(20):
        for model in (ref, hooked):
            model.zero_grad()
            model(torch.tensor([float(rank)])).sum().backward()
        expected, got = ref.module.weight.grad, hooked.module.weight.grad
        exact = exact and torch.equal(got, expected)
        worst = max(worst, float((got - (world_size - 1) / 2).abs().max()))
    return {"worst": worst, "exact": exact, "bound": float(max(_code(world_size).error_bound))}


def _parity_run(rank: int, world_size: int, which: str) -> dict[str, Any]:
    out = {
        name: _compare(rank, which, kwargs, dtype=dtype, use_branch=branch)
        for name, (kwargs, dtype, branch) in CONFIGS.items()
    }
    out["torch_shape"] = _torch_shape_parity(rank, world_size, which)
    return out


@pytest.mark.parametrize("which", HOOK_NAMES)
def test_parity_with_no_hook_ddp_under_ddp_options(which: str) -> None:
    results = check(run_ranks(_parity_run, WORLD, which, timeout=TIMEOUT))
    for out in results:
        shape = out.pop("torch_shape")
        for name, case in out.items():
            _check_case(name, case)
            assert case["dtypes"] == {torch.float64 if name == "float64" else torch.float32}, name
            if which == "ring":
                assert case["same_everywhere"], name  # the exact ring: bitwise equal on every rank
        if which == "ring":
            assert shape["exact"] and shape["worst"] == 0.0  # mean of 0, 1, 2: exact in float32
        else:
            assert shape["worst"] <= 4 * shape["bound"] * (WORLD - 1) / 2 + 1e-6
    if which == "cerar":  # rank 1 of 3 decodes an approximation: really CERAR, not exact
        assert results[1]["default"]["errors"][0] > 0


# ---------------------------------------------------------------------------------------------
# no_sync, Join with uneven inputs, sparse gradients, a subgroup


def _no_sync(rank: int, which: str) -> dict[str, Any]:
    """Two micro-batches accumulated under ``no_sync``, then a synchronised third one."""
    base = _Net()
    ref, hooked, plain = DDP(copy.deepcopy(base)), DDP(copy.deepcopy(base)), copy.deepcopy(base)
    state = _state(which, WORLD)
    hooked.register_comm_hook(state, HOOKS[which])

    def loss(model: nn.Module, step: int) -> torch.Tensor:
        x, y = _batch(rank, step)
        return nn.functional.mse_loss(model(x), y)

    for model in (ref, hooked, plain):
        model.zero_grad()
        if isinstance(model, DDP):
            with model.no_sync():
                loss(model, 0).backward()
                loss(model, 1).backward()
        else:
            (loss(model, 0) + loss(model, 1)).backward()
        loss(model, 2).backward()
    expected = _grads(ref)
    error = float(torch.linalg.vector_norm(_grads(hooked) - expected))
    allowed = _allowed(which, state.code, rank, _gather(_grads(plain)), expected)
    assert state.last_step is not None
    return {"ratio": error / allowed, "iteration": state.iteration, "last_step_calls": state.last_step.calls}


def _join(rank: int, world_size: int, which: str) -> dict[str, Any]:
    """Uneven inputs under ``Join``: rank r runs 2 + r iterations; the joined ranks shadow the
    others' all-reduces with zeros (DDP divides by the initial world size)."""
    counts = [2 + r for r in range(world_size)]
    base = _Net()
    plain = copy.deepcopy(base)
    locals_ = []  # every step's local gradient, zero once this rank has joined
    for step in range(max(counts)):
        _backward(plain, _batch(rank, step))
        local = _grads(plain)
        locals_.append(_gather(local if step < counts[rank] else torch.zeros_like(local)))
    grads: dict[str, list[torch.Tensor]] = {}
    state = _state(which, world_size)
    for name in ("ref", "hooked"):
        model = DDP(copy.deepcopy(base), bucket_cap_mb=CAP_MB)
        if name == "hooked":
            model.register_comm_hook(state, HOOKS[which])
        grads[name] = []
        with Join([model]):
            for step in range(counts[rank]):
                _backward(model, _batch(rank, step))
                grads[name].append(_grads(model))
    ratios = []
    for step, (expected, got) in enumerate(zip(grads["ref"], grads["hooked"], strict=True)):
        exact_mean = sum(locals_[step]) / world_size
        assert float(torch.linalg.vector_norm(expected - exact_mean)) <= 1e-5 * float(
            torch.linalg.vector_norm(exact_mean)
        )
        error = float(torch.linalg.vector_norm(got - expected))
        ratios.append(error / _allowed(which, state.code, rank, locals_[step], expected))
    return {"ratios": ratios, "iteration": state.iteration}


def _sparse(rank: int, world_size: int, which: str) -> dict[str, Any]:
    """Sparse embedding gradients: exactly DDP's default; the dense layer as any bucket."""
    ref, hooked, plain = DDP(_Bag()), DDP(_Bag()), _Bag()
    state = _state(which, world_size)
    hooked.register_comm_hook(state, HOOKS[which])
    exact, layouts, ratios = [], set(), []
    for step in range(3):
        g = torch.Generator().manual_seed(10 * step + rank)
        indices, offsets = torch.randint(0, 40, (12,), generator=g), torch.tensor([0, 3, 7])
        for model in (ref, hooked, plain):
            model.zero_grad()
            model(indices, offsets).square().sum().backward()
        sparse_ref, sparse_got = ref.module.embedding.weight.grad, hooked.module.embedding.weight.grad
        layouts |= {sparse_ref.layout, sparse_got.layout}
        exact.append(torch.equal(sparse_got.to_dense(), sparse_ref.to_dense()))
        dense = [
            torch.cat([p.grad.reshape(-1).double() for p in m.linear.parameters()])
            for m in (ref.module, hooked.module, plain)
        ]
        allowed = _allowed(which, state.code, rank, _gather(dense[2]), dense[0])
        ratios.append(float(torch.linalg.vector_norm(dense[1] - dense[0])) / allowed)
    return {"exact": exact, "layouts": layouts, "ratios": ratios, "sparse_buckets": state.sparse_buckets}


def _modes_run(rank: int, world_size: int, which: str) -> dict[str, Any]:
    out = {"no_sync": _no_sync(rank, which), "join": _join(rank, world_size, which)}
    out["sparse"] = _sparse(rank, world_size, which)
    # A subgroup of the first and last ranks (the hook's own group is made by them alone).
    members = [0, world_size - 1]
    group = dist.new_group(members)
    if rank in members:
        out["subgroup"] = _compare(rank, which, {}, group=group, iters=3)
    return out


@pytest.mark.parametrize("which", HOOK_NAMES)
def test_no_sync_join_sparse_and_subgroup_match_no_hook_ddp(which: str) -> None:
    results = check(run_ranks(_modes_run, WORLD, which, timeout=TIMEOUT))
    for rank, out in enumerate(results):
        no_sync = out["no_sync"]
        assert no_sync["ratio"] <= 1.0 and no_sync["iteration"] == 1 and no_sync["last_step_calls"] == 1
        assert max(out["join"]["ratios"]) <= 1.0, out["join"]
        assert out["join"]["iteration"] == WORLD + 1  # joined ranks ran the hook too, with zeros
        sparse = out["sparse"]
        assert all(sparse["exact"]) and sparse["layouts"] == {torch.sparse_coo}
        assert max(sparse["ratios"]) <= 1.0 and sparse["sparse_buckets"] == 3
        if rank in (0, WORLD - 1):
            _check_case("subgroup", out["subgroup"], iters=3)
        else:
            assert "subgroup" not in out


# ---------------------------------------------------------------------------------------------
# Registration, the state's type and size, on_step, checkpoints


def _api_run(rank: int, world_size: int, built_before_init: CerarState) -> dict[str, Any]:
    out: dict[str, Any] = {"before": (built_before_init.world_size, built_before_init.code)}
    state = built_before_init
    model = DDP(_Net(), bucket_cap_mb=CAP_MB)
    model.register_comm_hook(state, get_hook("cerar"))
    out["logged_hook"] = model._get_ddp_logging_data().get("comm_hook")
    calls: list[int] = []
    state.on_step = lambda s, stats: calls.append(stats.calls)
    for step in range(3):
        _backward(model, _batch(rank, step))
    out["after"] = (state.world_size, state.code == default_code(world_size))
    out["step_calls"], out["last_step_calls"] = calls, state.last_step.calls if state.last_step else None
    try:
        model.register_comm_hook(CerarState(), ring_hook)
    except RuntimeError as exc:
        out["second"] = str(exc)
    for key, (hook_state, hook) in {
        "wrong_state": (object(), cerar_hook),
        "wrong_size": (CerarState(code=_code(world_size + 1)), cerar_hook),
    }.items():
        bad = DDP(_Net())
        bad.register_comm_hook(hook_state, hook)
        try:
            _backward(bad, _batch(rank, 0))
        except (TypeError, ValueError) as exc:
            out[key] = f"{type(exc).__name__}: {exc}"
    out.update(_checkpoints(rank, world_size, state))
    return out


def _checkpoints(rank: int, world_size: int, state: CerarState) -> dict[str, Any]:
    """state_dict through torch.save / torch.load(weights_only=True), per rank; pickling."""
    state.on_step = None
    saved = state.state_dict()
    buffer = io.BytesIO()
    torch.save(saved, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    fresh = CerarState()  # no code yet: adopts the saved one
    fresh.load_state_dict(loaded)
    out: dict[str, Any] = {"roundtrip": fresh.state_dict() == saved, "saved_rank": loaded["rank"]}
    out["own_stats"] = (fresh.stats, fresh.last_step, fresh.iteration) == (state.stats, state.last_step, 3)
    everyone: list[Any] = [None] * world_size
    dist.all_gather_object(everyone, saved["stats"]["wall_s"])
    out["stats_differ"] = len(set(everyone)) == world_size  # each rank's own timings
    other: list[Any] = [None] * world_size
    dist.all_gather_object(other, saved)
    for key, (target, state_dict) in {
        "other_rank": (CerarState(), other[(rank + 1) % world_size]),
        "other_code": (CerarState(code=_code(world_size)), loaded),
        "missing_key": (CerarState(), {k: v for k, v in loaded.items() if k != "stats"}),
    }.items():
        try:
            target.load_state_dict(state_dict)
        except (KeyError, ValueError) as exc:
            out[key] = str(exc)
    # Training carries on with the loaded state on a new model: its statistics go on growing.
    model = DDP(_Net(), bucket_cap_mb=CAP_MB)
    model.register_comm_hook(fresh, cerar_hook)
    _backward(model, _batch(rank, 5))
    out["continued"] = (fresh.iteration, fresh.stats.calls > state.stats.calls)
    restored = pickle.loads(pickle.dumps(state))
    out["pickled"] = (restored.process_group, restored._comm_group, restored.world_size, restored.stats == state.stats)
    model = DDP(_Net(), bucket_cap_mb=CAP_MB)
    model.register_comm_hook(restored, ring_hook)
    _backward(model, _batch(rank, 6))
    out["pickled_after"] = (restored.iteration, restored.world_size, restored._comm_group is not None)
    return out


def test_registration_state_checks_on_step_and_checkpoints() -> None:
    built_before_init = CerarState(resync_every=7, min_bucket_bytes=0)  # no process group in this (parent) process
    assert built_before_init.world_size is None and built_before_init.code is None
    results = check(run_ranks(_api_run, 2, built_before_init, timeout=TIMEOUT))
    for rank, out in enumerate(results):
        assert out["before"] == (None, None)
        assert out["after"] == (2, True)  # resolved at the first bucket: the default code for 2
        assert out["logged_hook"] == "cerar_hook"
        assert out["step_calls"][0] == 1 and len(out["step_calls"]) == 3 and out["step_calls"][-1] >= 2
        assert out["last_step_calls"] == out["step_calls"][-1]
        assert out["second"] == "register_comm_hook or register_builtin_comm_hook can only be called once."
        assert out["wrong_state"].startswith("TypeError: Argument 'state'") and "object" in out["wrong_state"]
        for key in ("wrong_size",):  # a ring hook takes no code: the state's is CERAR's alone
            assert out[key].startswith("ValueError: Argument 'code'"), out[key]
            assert "2 ranks" in out[key] and "world_size=3" in out[key]
        assert out["roundtrip"] and out["own_stats"] and out["saved_rank"] == rank
        assert out["stats_differ"]
        assert "'rank'" in out["other_rank"] and "each rank saves and loads its own" in out["other_rank"]
        assert "'code'" in out["other_code"]
        assert "missing keys ['stats']" in out["missing_key"]
        assert out["continued"] == (4, True)
        assert out["pickled"] == (None, None, None, True)
        assert out["pickled_after"] == (4, 2, True)
