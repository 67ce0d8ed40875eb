"""The communication-avoiding schedules of ``cerar train`` (``accum``, ``localsgd``, ``diloco``):
every composition with a method underneath trains a tiny GPT-NeoX for a few steps on two Gloo
ranks (the training loop itself, in one pair of processes), and the averaging's edge cases
(a non-finite round, a rank that skipped its optimizer step) keep the replicas together."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch._dynamo  # DDP imports it when first built: once here, not in every forked rank
import torch.distributed as dist
from torch import nn

from cerar.experiments.train.config import ModelConfig, TrainConfig, parse_method
from cerar.experiments.train.report import summarize_run
from multirank import check, run_ranks

pytest.importorskip("transformers")  # the model; imported here once, before the ranks fork

pytestmark = pytest.mark.multirank

TINY = ModelConfig(layers=1, hidden=32, heads=2, seq_len=32)
#: Six steps, two of warm-up, an evaluation after every step (to see the replicas drift
#: between averages and meet at them).
SETTINGS: dict[str, Any] = {
    "model": TINY, "steps": 6, "batch_size": 4, "warmup_steps": 2, "eval_every": 1, "eval_sequences": 4,
}  # fmt: skip
COMPOSITIONS = (
    "allreduce",
    "accum:2", "accum:2:fp16", "accum:2:ring", "accum:4:cerar:4:fp16", "accum:2:powersgd:1",
    "localsgd:2", "localsgd:2:fp16", "localsgd:2:bf16", "localsgd:2:ring", "localsgd:2:cerar:4:fp16",
    "diloco:3", "diloco:3:fp16", "diloco:3:bf16", "diloco:3:ring", "diloco:3:cerar", "diloco:3:cerar:4:fp16",
)  # fmt: skip
#: Averaging methods whose ranks all end with the same values (all but CERAR).
IDENTICAL = ("allreduce", "fp16", "bf16", "ring")


def _config(spec: str, world_size: int, **settings: Any) -> TrainConfig:
    method, overrides = parse_method(spec, world_size)
    return TrainConfig(method=method, **{**SETTINGS, **settings}, **overrides)


def _train_each(rank: int, world_size: int, specs: tuple[str, ...]) -> list[dict[str, Any]]:
    from cerar.experiments.train.data import load_split
    from cerar.experiments.train.loop import train

    split = load_split()
    return [train(_config(spec, world_size), split=split) for spec in specs]


@pytest.fixture(scope="module")
def runs() -> dict[str, dict[str, Any]]:
    """Every composition's run, as the worker writes it (``config``, ``world_size``, ``ranks``)."""
    results = check(run_ranks(_train_each, 2, COMPOSITIONS, timeout=600.0, pg_timeout=60.0))
    out = {}
    for index, spec in enumerate(COMPOSITIONS):
        config = _config(spec, 2)
        ranks = [results[rank][index] for rank in range(2)]
        out[spec] = {"config": config.to_dict(), "label": config.label, "world_size": 2, "ranks": ranks}
    return out


def _syncs_expected(spec: str, steps: int = 6, warmup: int = 2) -> tuple[int, list[int]]:
    """(steps whose gradients DDP averaged, steps done at each average), from the schedule's
    definition: localsgd torch's (step t >= warm-up, (t - warm-up) % H == 0), diloco every H
    steps, both also after the last step."""
    name, _, rest = spec.partition(":")
    if name not in ("localsgd", "diloco"):
        return steps, []
    period = int(rest.partition(":")[0])
    if name == "localsgd":
        due = [t for t in range(warmup, steps) if (t - warmup) % period == 0]
        gradient = warmup
    else:
        due = [t for t in range(steps) if (t + 1) % period == 0]
        gradient = 0
    if due[-1] != steps - 1:
        due.append(steps - 1)
    return gradient, [t + 1 for t in due]


def test_every_composition_trains_and_counts_its_syncs(runs: dict[str, dict[str, Any]]) -> None:
    for spec, run in runs.items():
        first = run["ranks"][0]
        evals = first["evals"]
        assert evals[-1]["val_loss"] < evals[0]["val_loss"], spec  # it learns
        assert first["skipped_steps"] == 0, spec
        gradient_syncs, averages = _syncs_expected(spec)
        for record in run["ranks"]:
            assert record["counters"]["syncs"] == gradient_syncs + len(averages), spec
            assert [a["step"] for a in record["method_info"].get("syncs", [])] == averages, spec
            assert all(a["finite"] for a in record["method_info"].get("syncs", [])), spec
        summary = summarize_run(run, None)
        assert summary.syncs_per_step == pytest.approx((gradient_syncs + len(averages)) / 6), spec
        assert summary.bytes_per_step > 0 and summary.exposed_comm_s >= summary.sync_s >= 0, spec
        assert summary.tokens_per_step == 2 * 4 * TINY.seq_len and summary.tokens == 6 * summary.tokens_per_step


def test_the_bytes_of_each_average(runs: dict[str, dict[str, Any]]) -> None:
    """At N = 2 the ring formula sends every value once: an exact average of the P float32
    parameters is 4P bytes, a 16-bit one 2P, plus 4 bytes per finiteness vote of the own averager."""
    parameters = runs["allreduce"]["ranks"][0]["parameters"]
    bytes_of = {spec: run["ranks"][0]["counters"]["bytes_sent"] for spec, run in runs.items()}
    assert bytes_of["allreduce"] == 6 * 4 * parameters  # a gradient all-reduce per step
    assert bytes_of["accum:2"] == bytes_of["allreduce"]  # one per optimizer step, not per micro-batch
    assert bytes_of["localsgd:2"] == (2 + 3) * 4 * parameters  # 2 warm-up steps, 3 averages (torch's)
    assert bytes_of["localsgd:2:fp16"] == 2 * 4 * parameters + 3 * (2 * parameters + 4)
    assert bytes_of["diloco:3"] == 2 * (4 * parameters + 4)
    assert bytes_of["diloco:3:bf16"] == 2 * (2 * parameters + 4)
    # CERAR's measured bytes at N = 2: the ring's count, with float16 packets half of it (a call
    # redone at a new packet scale sends again).
    for spec, size in (("diloco:3:cerar", 4), ("diloco:3:cerar:4:fp16", 2)):
        calls = 2 + runs[spec]["ranks"][0]["counters"]["rescales"]
        assert bytes_of[spec] == pytest.approx(calls * size * parameters, rel=0.01), spec
    assert runs["diloco:3:cerar:4:fp16"]["ranks"][0]["bytes_measured"]


def test_exact_averaging_leaves_the_replicas_bitwise_equal(runs: dict[str, dict[str, Any]]) -> None:
    """The replicas drift between averages (local steps) and are bitwise equal right after each
    exact one: the sketch is 0 after every average, and the last step is an average, after which
    every parameter is gathered and compared (``final_divergence['exact']``)."""
    for schedule in ("localsgd:2", "diloco:3"):
        for method in IDENTICAL:
            spec = schedule if method == "allreduce" else f"{schedule}:{method}"
            first = runs[spec]["ranks"][0]
            averages = first["method_info"]["syncs"]
            assert [a["divergence"] for a in averages] == [0.0] * len(averages), spec
            assert first["final_divergence"]["exact"] == 0.0, spec
            after = {a["step"] for a in averages}
            local = [e["divergence"] for e in first["evals"] if e["step"] > 2 and e["step"] not in after]
            assert local and min(local) > 0, spec  # between averages the ranks train apart
    # localsgd's warm-up is DDP's all-reduce: equal replicas through it.
    assert [e["divergence"] for e in runs["localsgd:2"]["ranks"][0]["evals"][:3]] == [0.0] * 3


def test_diloco_through_cerar_reports_a_small_post_sync_divergence(runs: dict[str, dict[str, Any]]) -> None:
    exact = runs["diloco:3"]["ranks"][0]["evals"][-1]["val_loss"]
    for spec in ("diloco:3:cerar", "diloco:3:cerar:4:fp16", "localsgd:2:cerar:4:fp16"):
        averages = runs[spec]["ranks"][0]["method_info"]["syncs"]
        divergences = [a["divergence"] for a in averages]
        assert all(0 < d < 1e-2 for d in divergences), (spec, divergences)  # measured, and small
        summary = summarize_run(runs[spec], None)
        assert summary.post_sync_divergence == max(divergences) and summary.averages == len(averages)
        if spec.startswith("diloco"):
            assert runs[spec]["ranks"][0]["evals"][-1]["val_loss"] == pytest.approx(exact, abs=0.02)


def test_accum_trains_on_the_baseline_tokens(runs: dict[str, dict[str, Any]]) -> None:
    """accum:2 splits each step's batch into two micro-batches: the same tokens per step, and
    (the gradient of the same batch) the same losses as allreduce's, step by step."""
    base, accum = summarize_run(runs["allreduce"], None), summarize_run(runs["accum:2"], None)
    assert accum.tokens_per_step == base.tokens_per_step and accum.tokens == base.tokens
    assert accum.bytes_per_token == base.bytes_per_token
    base_losses = [s["loss"] for s in runs["allreduce"]["ranks"][0]["steps"]]
    accum_losses = [s["loss"] for s in runs["accum:2"]["ranks"][0]["steps"]]
    assert accum_losses == pytest.approx(base_losses, abs=1e-4)
    assert runs["accum:2"]["ranks"][0]["method_info"]["micro_batch"] == 2


# ---------------------------------------------------------------------------------------------
# The averaging's edge cases, on a small linear model


def _average_next(sync: Any, module: nn.Module) -> None:
    """Run the schedule's steps (no local training) up to and including its next average."""
    done = len(sync.log)
    while len(sync.log) == done:
        sync.after_step(module)


def _sync_after_a_bad_round(rank: int, world_size: int, spec: str) -> dict[str, Any]:
    """Rank 1's local step leaves a NaN; the average that follows must put both ranks back at
    the anchor (the last average) without an outer step, and the next round go on as usual."""
    from cerar.experiments.train.periodic import PeriodicSync

    config = _config(spec, world_size, steps=10, warmup_steps=0)
    torch.manual_seed(0)
    module = nn.Linear(8, 4)
    sync = PeriodicSync(config, world_size)
    sync.wrap(module, torch.optim.SGD(module.parameters(), lr=0.1))
    start = [p.detach().clone() for p in module.parameters()]
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.01 * (rank + 1))
        if rank == 1:
            module.weight[0, 0] = float("nan")
    _average_next(sync, module)
    back = all(torch.equal(p, s) for p, s in zip(module.parameters(), start, strict=True))
    outer_state = None if sync.outer is None else len(sync.outer.state)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.01 * (rank + 1))
    _average_next(sync, module)  # finite this time
    flat = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(gathered, flat)
    return {
        "log": sync.log,
        "back": back,
        "outer_state": (outer_state, None if sync.outer is None else len(sync.outer.state)),
        "moved": not torch.equal(flat, torch.cat([s.reshape(-1) for s in start])),
        "finite": bool(torch.isfinite(flat).all()),
        "spread": float((gathered[0] - gathered[1]).abs().max()),
    }


@pytest.mark.parametrize("spec", ["diloco:2", "diloco:2:cerar:4:fp16", "localsgd:2:fp16"])
def test_a_non_finite_average_returns_every_rank_to_the_anchor(spec: str) -> None:
    results = check(run_ranks(_sync_after_a_bad_round, 2, spec, timeout=120.0))
    for result in results:
        assert [a["finite"] for a in result["log"]] == [False, True]
        assert result["back"] and result["finite"] and result["moved"]
        # No outer step on the bad round (SGD keeps no state before its first), one after.
        assert result["outer_state"] == ((None, None) if spec.startswith("localsgd") else (0, 1))
    assert results[0]["spread"] < (1e-3 if "cerar" in spec else 1e-12)


def _skip_a_step_on_one_rank(rank: int, world_size: int) -> list[float]:
    """localsgd with torch's averager: rank 1 skips its optimizer step at an averaging step (a
    non-finite gradient, as the loop would); the schedule still averages there on both ranks."""
    from cerar.experiments.train.periodic import PeriodicSync

    config = _config("localsgd:2", world_size, steps=5, warmup_steps=0)
    torch.manual_seed(0)
    module = nn.Linear(8, 4)
    sync = PeriodicSync(config, world_size)
    optimizer = sync.wrap(module, torch.optim.SGD(module.parameters(), lr=0.1))
    spreads = []
    for step in range(5):
        loss = module(torch.full((2, 8), float(rank + step))).square().mean()
        loss.backward()
        if not (rank == 1 and step == 2):
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync.after_step(module)
        flat = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
        gathered = [torch.empty_like(flat) for _ in range(world_size)]
        dist.all_gather(gathered, flat)
        spreads.append(float((gathered[0] - gathered[1]).abs().max()))
    return spreads


def test_localsgd_keeps_averaging_in_step_when_a_rank_skips_its_step() -> None:
    spreads = check(run_ranks(_skip_a_step_on_one_rank, 2, timeout=120.0))[0]
    # Averages at steps 0, 2, 4 (H = 2, no warm-up): equal there, apart after the local steps.
    assert [s == 0.0 for s in spreads] == [True, False, True, False, True]
