"""FSDP2's HSDP with CERAR between nodes, both routes, on 6 Gloo ranks (3 nodes x 2): (a) the 2-D
mesh whose replicate dimension is cerar's group, (b) each node's FSDP plus the all-reduce hook.
Against torch's own HSDP: the gradients within the code's bound, the loss curve the same within it,
gradient accumulation by each route's own switch."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch._dynamo  # FSDP imports it when first built: once here, not in every forked rank
from torch import nn

from multirank import check, run_ranks, wait_for_peers

pytestmark = pytest.mark.multirank
TIMEOUT = 180.0
NODES, PER_NODE = 3, 2


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 48), nn.Tanh(), nn.Linear(48, 48), nn.Tanh(), nn.Linear(48, 4))


def _loss(model: nn.Module, rank: int, step: int, part: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(10_000 * step + 100 * part + rank)
    x = torch.randn(16, 16, generator=g)
    return nn.functional.mse_loss(model(x), (x[:, :4] * 2.0).tanh())


def _shard(model: nn.Module, mesh: Any) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in (model[0], model[2], model[4]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _full_grad(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.full_tensor().reshape(-1) for p in model.parameters()]).double()


def _train(model: nn.Module, rank: int, steps: int, accumulate: str | None) -> tuple[list[float], torch.Tensor]:
    """SGD steps; ``accumulate``: two micro-batches, the first without the all-reduce
    (``"all_reduce"``: ``set_requires_all_reduce(False)``) or without any sync (``"sync"``)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    losses, grad = [], torch.empty(0)
    for step in range(steps):
        optimizer.zero_grad()
        if accumulate is not None:
            switch = model.set_requires_all_reduce if accumulate == "all_reduce" else model.set_requires_gradient_sync
            switch(False)
            (_loss(model, rank, step, 1) / 2).backward()
            switch(True)
            loss = _loss(model, rank, step) / 2
        else:
            loss = _loss(model, rank, step)
        loss.backward()
        grad = _full_grad(model)
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses, grad


def _hsdp(rank: int, world_size: int, route: str, accumulate: str | None) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    import cerar.group
    from cerar.coding import codes

    reference_mesh = init_device_mesh("cpu", (NODES, PER_NODE), mesh_dim_names=("replicate", "shard"))
    expected_losses, expected = _train(_shard(_model(), reference_mesh), rank, 3, accumulate)
    code = codes.perturbed(NODES, 2 * NODES)
    groups = cerar.group.hsdp_groups(PER_NODE, code=code, min_bytes=0)
    if route == "mesh":
        model = _shard(_model(), groups.mesh)
    else:
        model = _shard(_model(), groups.shard_mesh)
        assert cerar.group.set_all_reduce_hook(model, groups.replicate) >= 3
    losses, got = _train(model, rank, 3, accumulate)
    routes = groups.replicate.stats.as_dict()
    return {
        "error": float((got - expected).norm() / expected.norm()),
        "losses": (losses, expected_losses),
        "coded_calls": routes.get("cerar", {}).get("avg", {}).get("calls", 0),
        "predicted": float(code.predicted_worst_error("fp32")),
    }


CASES = [("mesh", None), ("hook", None), ("mesh", "all_reduce"), ("hook", "sync")]


@pytest.mark.parametrize(("route", "accumulate"), CASES)
def test_hsdp_with_cerar_between_nodes_matches_torchs_within_the_bound(route: str, accumulate: str | None) -> None:
    results = check(run_ranks(_hsdp, NODES * PER_NODE, route, accumulate, timeout=TIMEOUT))
    for out in results:
        # The last step's gradient: every rank's shard went through CERAR across the nodes.
        assert 0 < out["error"] <= 10 * out["predicted"], out
        losses, expected = out["losses"]
        assert losses == pytest.approx(expected, rel=10 * out["predicted"])
        # Three SGD steps of three parameter groups (the root holds none): one all-reduce each,
        # the first micro-batch's skipped by each route's switch.
        assert out["coded_calls"] == 3 * 3


# -- failures under HSDP: the error's type on every rank, a stopped rank ---------------------


def _hsdp_failure(rank: int, world_size: int, case: str) -> dict[str, Any] | None:
    import datetime
    import time

    import cerar.group

    timeout = datetime.timedelta(seconds=5)
    groups = cerar.group.hsdp_groups(PER_NODE, min_bytes=0, nonfinite="raise", timeout=timeout)
    model = _shard(_model(), groups.mesh)
    if case == "stopped" and rank == world_size - 1:
        wait_for_peers(at_most=15)  # never calls: its node-mate and the other nodes must raise on their own
        return None
    started = time.monotonic()
    try:
        loss = _loss(model, rank, 0)  # forward: the shard group's all-gathers
        if case == "nan" and rank == 1:
            loss = loss * float("nan")
        loss.backward()
        out: dict[str, Any] = {"type": None, "message": ""}
    except Exception as exc:  # what FSDP2's caller sees, with its type
        out = {"type": type(exc).__name__, "message": str(exc)[:400]}
    out["seconds"] = time.monotonic() - started
    return out


def test_hsdp_a_nonfinite_gradient_raises_its_own_type_on_every_rank() -> None:
    """nonfinite="raise" on the replicate groups: FSDP2's all-reduce across nodes raises
    cerar.NonFiniteError on every rank of the mesh (the shard a NaN reaches is every rank's)."""
    for out in check(run_ranks(_hsdp_failure, NODES * PER_NODE, "nan", timeout=TIMEOUT, pg_timeout=20)):
        assert out["type"] == "NonFiniteError", out


def test_hsdp_a_stopped_rank_makes_every_other_rank_raise_within_the_timeout() -> None:
    """One rank stops before its forward pass: every other rank, its node-mate included (waiting in
    the shard group's all-gather), raises within the groups' 5 s timeout plus a margin."""
    results = run_ranks(_hsdp_failure, NODES * PER_NODE, "stopped", timeout=TIMEOUT, pg_timeout=20, allow_missing=True)
    for rank, out in enumerate(results[:-1]):
        assert out is not None and out["type"] is not None, (rank, out)
        assert out["seconds"] < 12.0, (rank, out)
