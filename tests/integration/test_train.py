"""The training experiment: config checks, data order, the model, and `cerar train` end to end
(tiny model, two ranks on loopback; the launcher's timeout bounds every run)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from cerar.experiments.train.config import ModelConfig, TrainConfig, parse_bucket_caps, parse_method
from cerar.experiments.train.data import load_split, train_batch, validation_batch
from cerar.experiments.train.loop import lr_factor
from cerar.experiments.train.methods import HOOKS
from cerar.experiments.train.model import build_model, lm_loss, local_gradient

TINY = ModelConfig(layers=1, hidden=32, heads=2, seq_len=32)

# ---------------------------------------------------------------------------------------------
# Config


def test_config_round_trips_through_json() -> None:
    config = TrainConfig(method="cerar", components=8, model=TINY, steps=7, resync_every=3)
    assert TrainConfig.from_json(config.to_json()) == config
    assert config.label == "cerar-c8-s0"
    assert TrainConfig(method="powersgd", powersgd_rank=2, seed=1).label == "powersgd-r2-s1"


@pytest.mark.parametrize(
    ("kwargs", "kind", "message"),
    [
        ({"method": "sgd"}, ValueError, "Argument 'method' must be one of"),
        ({"steps": 0}, ValueError, "Argument 'steps' must be at least 1, not 0."),
        ({"lr": -1.0}, ValueError, "Argument 'lr' must be positive, not -1.0."),
        ({"batch_size": 2.0}, TypeError, "Argument 'batch_size' must be an integer, not 2.0."),
        ({"divergence_tol": 0.0}, ValueError, "Argument 'divergence_tol' must be positive, not 0.0."),
        ({"model": {"layers": 2}}, TypeError, "Argument 'model' must be a ModelConfig, not dict."),
    ],
)
def test_config_rejects_bad_values(kwargs: dict, kind: type[Exception], message: str) -> None:
    with pytest.raises(kind, match=message.replace("(", r"\(").replace(")", r"\)")):
        TrainConfig(**kwargs)


def test_config_takes_a_list_of_bucket_sizes() -> None:
    sweep = TrainConfig(bucket_cap_mb=[1, 4, 16])
    assert sweep.bucket_cap_mb == (1.0, 4.0, 16.0) and sweep.bucket_caps == (1.0, 4.0, 16.0)
    assert TrainConfig.from_json(sweep.to_json()) == sweep
    runs = [sweep.at_bucket(cap) for cap in sweep.bucket_caps]
    assert [r.bucket_cap_mb for r in runs] == [1.0, 4.0, 16.0]
    assert [r.bucket_label for r in runs] == ["allreduce-b1-s0", "allreduce-b4-s0", "allreduce-b16-s0"]
    assert TrainConfig(method="cerar", components=8, bucket_cap_mb=0.5).bucket_label == "cerar-c8-b0.5-s0"
    # One size, given as a list of one or as a number, is today's single run.
    assert TrainConfig(bucket_cap_mb=[4]).bucket_cap_mb == 4.0 == TrainConfig(bucket_cap_mb=4).bucket_cap_mb
    assert TrainConfig(bucket_cap_mb=(4,)).label == TrainConfig().label == "allreduce-s0"
    assert parse_bucket_caps("1,4,16") == (1.0, 4.0, 16.0) and parse_bucket_caps("2.5") == (2.5,)
    assert TrainConfig(min_bucket_mb=2).min_bucket_mb == 2.0


@pytest.mark.parametrize(
    ("value", "kind", "message"),
    [
        ([1, 0], ValueError, "Argument 'bucket_cap_mb' must be positive, not 0.0 (entry 1 of [1, 0])."),
        ([1, -4.0], ValueError, "Argument 'bucket_cap_mb' must be positive, not -4.0 (entry 1 of [1, -4.0])."),
        ((1, "x"), TypeError, "Argument 'bucket_cap_mb' must be a real number, not 'x' (entry 1 of [1, 'x'])."),
        ([2, float("inf")], ValueError, "Argument 'bucket_cap_mb' must be finite, not inf (entry 1 of [2, inf])."),
        ([4, 1, 4.0], ValueError, "Argument 'bucket_cap_mb' must not repeat a size, not [4, 1, 4.0] (repeats [4.0])."),
        ([], ValueError, "Argument 'bucket_cap_mb' must list at least one size, not ()."),
        (0.0, ValueError, "Argument 'bucket_cap_mb' must be positive, not 0.0."),
        (True, TypeError, "Argument 'bucket_cap_mb' must be a real number, not True."),
    ],
)
def test_config_rejects_bad_bucket_sizes(value: object, kind: type[Exception], message: str) -> None:
    with pytest.raises(kind) as info:
        TrainConfig(bucket_cap_mb=value)  # type: ignore[arg-type]
    assert str(info.value) == message


def test_bucket_flag_parses_a_comma_list_and_names_a_bad_one() -> None:
    from cerar.cli import build_parser
    from cerar.cli.train import plan_runs

    def plan(*flags: str) -> list[TrainConfig]:
        return plan_runs(build_parser(only="train").parse_args(["train", "-N", "4", *flags]))

    configs = plan("--methods", "allreduce", "cerar:8", "--noise-seeds", "2", "--bucket-cap-mb", "1,4")
    assert [(c.label, c.bucket_cap_mb) for c in configs] == [
        ("allreduce-s0", 1.0), ("allreduce-s0", 4.0), ("allreduce-s1", 1.0), ("allreduce-s1", 4.0),
        ("cerar-c8-s0", 1.0), ("cerar-c8-s0", 4.0),
    ]  # fmt: skip
    assert [c.bucket_cap_mb for c in plan("--methods", "cerar", "--bucket-cap-mb", "4")] == [4.0]
    for bad, message in (("1,x", "a size in MB or a comma list"), ("1,,4", "a size in MB"), ("2,2", "repeat")):
        with pytest.raises(ValueError, match=f"Argument 'bucket_cap_mb' must (be|not) .*{message}"):
            plan("--bucket-cap-mb", bad)


def test_one_run_takes_one_bucket_size() -> None:
    from cerar.experiments.train.loop import train

    with pytest.raises(ValueError, match=r"Argument 'bucket_cap_mb' of one run must be one size, not \(1.0, 4.0\)"):
        train(TrainConfig(bucket_cap_mb=(1, 4)))


def test_model_config_checks_heads() -> None:
    with pytest.raises(ValueError, match=r"Argument 'hidden' must be a multiple of heads=3, not 32."):
        ModelConfig(hidden=32, heads=3)


def test_parse_method() -> None:
    assert parse_method("cerar", 4) == ("cerar", {"components": 8})
    assert parse_method("cerar:3N", 4) == ("cerar", {"components": 12})
    assert parse_method("cerar:10", 4) == ("cerar", {"components": 10})
    assert parse_method("powersgd:2", 4) == ("powersgd", {"powersgd_rank": 2})
    assert parse_method("powersgd:2:start50", 4) == ("powersgd", {"powersgd_rank": 2, "powersgd_start": 50})
    assert TrainConfig(method="powersgd", powersgd_rank=2, powersgd_start=50).name == "powersgd-r2-start50"
    assert parse_method("bf16", 4) == ("bf16", {})
    assert parse_method("cerar:8:fp16", 4) == ("cerar", {"components": 8, "packet": "fp16"})
    assert parse_method("cerar:2N:bf16", 4) == ("cerar", {"components": 8, "packet": "bf16"})
    assert TrainConfig(method="cerar", components=8, packet="fp16").label == "cerar-c8-fp16-s0"
    assert set(HOOKS) == {
        "allreduce", "ring", "int8", "fp8", "int4", "int3", "int2", "cerar", "auto", "hier-ring", "hier-cerar",
        "fp16", "bf16", "powersgd", "direct-int8", "direct-int4", "direct-int3", "direct-int2",
    }  # fmt: skip
    assert parse_method("int8", 4) == ("int8", {})
    assert parse_method("hier-cerar:2N", 2) == ("hier-cerar", {"components": 4})  # N: the nodes (the caller passes M)
    for bad in ("fp16:2", "cerar:x", "powersgd:2N", "cerar:0", "nccl", "cerar:8:fp8", "ring:2:fp16",
                "powersgd:2:s50", "powersgd::start5", "cerar:8:start5"):
        with pytest.raises(ValueError, match="Argument 'method'"):
            parse_method(bad, 4)
    # Through cerar's process group: DDP without a hook, or HSDP (its kN: N the nodes, as passed).
    assert parse_method("group:cerar:8:fp16", 4) == ("cerar", {"components": 8, "packet": "fp16", "parallel": "group"})
    assert parse_method("hsdp:cerar", 3) == ("cerar", {"components": 6, "parallel": "hsdp"})
    assert parse_method("hsdp:auto:2e-2", 4) == ("auto", {"max_error": 2e-2, "parallel": "hsdp"})
    assert TrainConfig(method="fp16", parallel="hsdp").label == "hsdp-fp16-s0"
    with pytest.raises(ValueError, match="Argument 'method' of hsdp must be one of"):
        TrainConfig(method="powersgd", parallel="hsdp")
    with pytest.raises(ValueError, match="Argument 'parallel'"):
        TrainConfig(parallel="zero")


def test_learning_rate_schedule() -> None:
    config = TrainConfig(steps=100, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_factor(0, config) == pytest.approx(0.1)
    assert lr_factor(9, config) == pytest.approx(1.0)
    assert lr_factor(10, config) == pytest.approx(1.0)
    assert lr_factor(100, config) == pytest.approx(0.1)
    assert all(lr_factor(s, config) >= lr_factor(s + 1, config) for s in range(10, 100))


# ---------------------------------------------------------------------------------------------
# Data


def test_split_is_fixed_and_disjoint() -> None:
    split = load_split()
    assert len(split.train) + len(split.val) == 5_058_224
    assert len(split.val) == pytest.approx(0.1 * 5_058_224, abs=1)
    assert bytes(split.train[:3].tolist()) != b""


def test_batches_depend_only_on_seed_step_and_rank() -> None:
    split = load_split()
    a = train_batch(split, 5, 1, 4, 3, 16, seed=0)
    assert a.shape == (3, 16) and a.dtype == torch.int64 and int(a.max()) < 256
    assert torch.equal(a, train_batch(split, 5, 1, 4, 3, 16, seed=0))
    assert not torch.equal(a, train_batch(split, 5, 2, 4, 3, 16, seed=0))
    assert not torch.equal(a, train_batch(split, 6, 1, 4, 3, 16, seed=0))
    assert not torch.equal(a, train_batch(split, 5, 1, 4, 3, 16, seed=1))
    val = validation_batch(split, 10, 16)
    assert torch.equal(val, validation_batch(split, 10, 16))
    with pytest.raises(ValueError, match=r"Argument 'rank' must be less than world_size=4, not 4."):
        train_batch(split, 0, 4, 4, 3, 16, seed=0)


# ---------------------------------------------------------------------------------------------
# Model


def test_model_is_pythia_like_and_local_gradient_is_clean() -> None:
    model = build_model(TINY, seed=0)
    config = model.config
    assert type(model).__name__ == "GPTNeoXForCausalLM"
    rope = getattr(config, "rope_parameters", None) or {}  # transformers 5 moved rotary_pct here
    assert rope.get("partial_rotary_factor", getattr(config, "rotary_pct", None)) == 0.25
    assert config.use_parallel_residual and config.vocab_size == 256
    assert not config.tie_word_embeddings
    tokens = validation_batch(load_split(), 2, TINY.seq_len)
    before = [p.detach().clone() for p in model.parameters()]
    grad = local_gradient(model, tokens)
    assert grad.shape == (sum(p.numel() for p in model.parameters()),)
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    # It is the gradient of the loss: a small step along it lowers the loss.
    loss = float(lm_loss(model, tokens).detach())
    with torch.no_grad():
        offset = 0
        for p in model.parameters():
            p -= 0.05 * grad[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
    assert float(lm_loss(model, tokens).detach()) < loss
    # Same seed, same weights.
    again = build_model(TINY, seed=0)
    assert all(torch.equal(a, b) for a, b in zip(again.parameters(), before, strict=True))


# ---------------------------------------------------------------------------------------------
# `cerar train` end to end


@pytest.mark.slow
@pytest.mark.multirank
def test_cerar_train_end_to_end(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from cerar.cli import main

    out = tmp_path / "train"
    argv = [
        "train", "-N", "2", "--regime", "fast", "--methods", "exact", "cerar", "powersgd:1:start4",
        "--noise-seeds", "2", "--steps", "12", "--eval-every", "6", "--batch-size", "2",
        "--layers", "1", "--hidden", "32", "--heads", "2", "--seq-len", "32", "--warmup-steps", "2",
        "--eval-sequences", "8", "--resync-every", "5", "--timeout-s", "120", "--out", str(out),
    ]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    for label in ("allreduce-s0", "allreduce-s1", "cerar-c4-s0", "powersgd-r1-start4-s0"):  # exact: allreduce's
        assert label in printed
        assert (out / "runs" / f"{label}.json").is_file()
    assert (out / "loss.png").stat().st_size > 0 and (out / "breakdown.png").stat().st_size > 0
    summary = json.loads((out / "summary.json").read_text())
    runs = {r["label"]: r for r in summary["runs"]}
    assert summary["noise_spread"] is not None and summary["noise_spread"] >= 0
    for run in runs.values():
        first_loss = json.loads((out / "runs" / f"{run['label']}.json").read_text())["ranks"][0]["evals"][0]
        assert run["final_val_loss"] < first_loss["val_loss"]  # every method learns
        assert run["bytes_per_step"] > 0 and run["step_s"] > 0 and run["exposed_comm_s"] >= 0
        assert run["cpu_s_per_step"] is not None and run["cpu_s_per_step"] > 0  # the process's threads
    assert "CPU/step (ms)" in printed
    assert runs["cerar-c4-s0"]["bytes_measured"] and not runs["allreduce-s0"]["bytes_measured"]
    assert runs["cerar-c4-s0"]["resyncs"] == 2  # steps 5 and 10
    assert runs["allreduce-s0"]["max_divergence"] == 0.0  # an exact all-reduce keeps replicas equal
    # At N = 2 CERAR sends the ring's byte count (1 + (N-2)/c = 2(N-1)/N = 1).
    assert runs["cerar-c4-s0"]["bytes_per_step"] == pytest.approx(runs["allreduce-s0"]["bytes_per_step"], rel=0.01)
    assert runs["powersgd-r1-start4-s0"]["bytes_per_step"] < runs["allreduce-s0"]["bytes_per_step"]

    # --reuse summarises the stored runs again without launching anything.
    import cerar.harness.launch

    def no_launch(*args: object, **kwargs: object) -> None:
        raise AssertionError("--reuse launched a run")

    monkeypatch.setattr(cerar.harness.launch, "launch", no_launch)
    assert main([*argv, "--reuse", "--no-plots"]) == 0
    again = json.loads((out / "summary.json").read_text())
    assert [r["final_val_loss"] for r in again["runs"]] == [r["final_val_loss"] for r in summary["runs"]]


@pytest.mark.slow
@pytest.mark.multirank
def test_cerar_train_bucket_sweep(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Two bucket sizes, two methods, a few steps on loopback: the grid and the best-per-method
    table, in the JSON and in the printed report."""
    from cerar.cli import main

    out = tmp_path / "sweep"
    argv = [
        "train", "-N", "2", "--regime", "fast", "--methods", "allreduce", "cerar", "--noise-seeds", "1",
        "--bucket-cap-mb", "0.02,1", "--steps", "4", "--eval-every", "2", "--batch-size", "2",
        "--layers", "1", "--hidden", "32", "--heads", "2", "--seq-len", "32", "--warmup-steps", "1",
        "--eval-sequences", "4", "--timeout-s", "120", "--no-plots", "--out", str(out),
    ]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    labels = ["allreduce-b0.02-s0", "allreduce-b1-s0", "cerar-c4-b0.02-s0", "cerar-c4-b1-s0"]
    summary = json.loads((out / "summary.json").read_text())
    assert [r["label"] for r in summary["runs"]] == labels
    assert all((out / "runs" / f"{label}.json").is_file() for label in labels)
    sweep = summary["sweep"]
    assert summary["bucket_caps_mb"] == sweep["bucket_caps_mb"] == [0.02, 1.0]
    grid = {(row["name"], row["bucket_cap_mb"]): row for row in sweep["grid"]}
    assert set(grid) == {(name, cap) for name in ("allreduce", "cerar-c4") for cap in (0.02, 1.0)}
    for row in grid.values():
        assert row["step_s"] > 0 and row["bytes_per_step"] > 0 and row["final_val_loss"] > 0
    best = sweep["best_bucket_mb"]
    assert set(best) == {"allreduce", "cerar-c4"}
    for name, cap in best.items():  # the best size is the one with the lower step time
        other = next(c for c in (0.02, 1.0) if c != cap)
        assert grid[(name, cap)]["best"] and not grid[(name, other)]["best"]
        assert grid[(name, cap)]["step_s"] <= grid[(name, other)]["step_s"]
    rows = {row["name"]: row for row in sweep["best"]}
    assert set(rows) == {"allreduce", "cerar-c4"}
    assert rows["allreduce"]["step_vs_tuned_allreduce"] == 1.0
    assert rows["cerar-c4"]["baseline"] == f"allreduce-b{best['allreduce']:g}-s0"
    # The target is the tuned allreduce's final loss (+ 0.01, one seed): it reaches it.
    tuned = grid[("allreduce", best["allreduce"])]
    assert summary["target_val_loss"] == pytest.approx(tuned["final_val_loss"] + 0.01)
    assert rows["allreduce"]["time_to_target_s"] is not None
    assert "best bucket size" in summary["target_rule"]
    assert any(c["label"].startswith("cerar-c4") and c["baseline"] == tuned["label"] for c in sweep["comparisons"])
    # The printed report: the per-run table, the grid (a column per size) and the best table.
    assert "| run | 0.02 MB buckets | 1 MB buckets |" in printed
    assert "each method at its best bucket size" in printed
    for label in labels:
        assert f"| {label} |" in printed
    assert f"| {rows['cerar-c4']['label']} | {best['cerar-c4']:g} |" in printed


def test_plan_rejects_repeated_runs() -> None:
    from cerar.cli import build_parser
    from cerar.cli.train import plan_runs

    args = build_parser(only="train").parse_args(["train", "--methods", "cerar", "cerar:2N", "-N", "4"])
    with pytest.raises(ValueError, match="Argument 'methods' must not repeat a run"):
        plan_runs(args)
    args = build_parser(only="train").parse_args(["train", "-N", "4"])
    labels = [c.label for c in plan_runs(args)]
    assert labels == [
        "allreduce-s0", "allreduce-s1", "cerar-c8-s0", "cerar-c12-s0", "fp16-s0", "int8-s0", "direct-int4-s0",
        "powersgd-r4-s0",
    ]  # fmt: skip
    args = build_parser(only="train").parse_args(["train", "--methods", "exact", "allreduce", "-N", "4"])
    with pytest.raises(ValueError, match=r"Argument 'methods' must not repeat a run, not \['allreduce-s0', "):
        plan_runs(args)  # a row and its alias are the same run


@pytest.mark.slow
@pytest.mark.multirank
def test_train_on_nodes_with_the_hierarchical_and_16_bit_methods(tmp_path: Path) -> None:
    """2 nodes x 2 ranks on loopback: hier-ring (exact between nodes), hier-cerar (its code for
    the 2 nodes: exact at M = 2) and CERAR with float16 packets train the same model; the first
    two keep the replicas within float rounding, the third within its error."""
    from cerar.cli import main

    out = tmp_path / "nodes"
    argv = [
        "train", "--nodes", "2", "--ranks-per-node", "2", "--regime", "fast",
        "--methods", "allreduce", "hier-ring", "hier-cerar", "cerar:8:fp16", "--noise-seeds", "1",
        "--steps", "4", "--eval-every", "2", "--batch-size", "2", "--layers", "1", "--hidden", "32",
        "--heads", "2", "--seq-len", "32", "--warmup-steps", "1", "--eval-sequences", "4",
        "--timeout-s", "120", "--no-plots", "--out", str(out),
    ]  # fmt: skip
    assert main(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    runs = {r["label"]: r for r in summary["runs"]}
    assert set(runs) == {"allreduce-s0", "hier-ring-s0", "hier-cerar-c4-s0", "cerar-c8-fp16-s0"}
    base = runs["allreduce-s0"]["final_val_loss"]
    for label in ("hier-ring-s0", "hier-cerar-c4-s0"):
        assert runs[label]["final_val_loss"] == pytest.approx(base, abs=1e-3)
        assert runs[label]["max_divergence"] < 1e-5
        assert runs[label]["bytes_measured"] and runs[label]["bytes_per_step"] > 0
    assert runs["cerar-c8-fp16-s0"]["final_val_loss"] == pytest.approx(base, abs=0.05)
    # float16 packets: 2 (1 + (N-2)/c) = 2.5 bytes per value against the fp32 ring's 6.
    assert runs["cerar-c8-fp16-s0"]["bytes_per_step"] < 0.5 * runs["allreduce-s0"]["bytes_per_step"]


@pytest.mark.slow
@pytest.mark.multirank
def test_train_through_cerars_group_ddp_and_hsdp(tmp_path: Path) -> None:
    """3 nodes x 2 ranks on loopback: HSDP exact (every all-reduce handed to the exact group),
    through cerar between the nodes, and DDP over cerar's group without a hook, the same model."""
    from cerar.cli import main

    out = tmp_path / "groups"
    argv = [
        "train", "--nodes", "3", "--ranks-per-node", "2", "--regime", "fast",
        "--methods", "hsdp:allreduce", "hsdp:cerar", "hsdp:auto", "group:cerar:8", "--noise-seeds", "1",
        "--steps", "3", "--eval-every", "3", "--batch-size", "2", "--layers", "1", "--hidden", "32",
        "--heads", "2", "--seq-len", "32", "--warmup-steps", "1", "--eval-sequences", "6",
        "--timeout-s", "120", "--no-plots", "--out", str(out),
    ]  # fmt: skip
    assert main(argv) == 0
    runs = {r["label"]: r for r in json.loads((out / "summary.json").read_text())["runs"]}
    assert set(runs) == {"hsdp-allreduce-s0", "hsdp-cerar-c6-s0", "hsdp-auto-s0", "group-cerar-c8-s0"}
    base = runs["hsdp-allreduce-s0"]["final_val_loss"]
    assert runs["hsdp-cerar-c6-s0"]["final_val_loss"] == pytest.approx(base, abs=1e-2)
    for run in runs.values():
        assert run["bytes_measured"] and run["bytes_per_step"] > 0


@pytest.mark.slow
@pytest.mark.multirank
def test_cerar_train_compares_the_schedules_at_their_best_setting(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two settings of diloco beside allreduce through the command: the same tokens, the family
    table with the tuning budget, the per-sync divergence in the JSON, every run in the plot."""
    import cerar.experiments.train.plots as plots
    from cerar.cli import main

    plotted: list[str] = []
    plot_loss = plots.plot_loss

    def recording_plot_loss(runs: list[dict], path: Path, **kwargs: object) -> Path:
        plotted.extend(run["label"] for run in runs)
        return plot_loss(runs, path, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(plots, "plot_loss", recording_plot_loss)
    out = tmp_path / "schedules"
    argv = [
        "train", "-N", "2", "--regime", "fast", "--methods", "allreduce", "diloco:2", "diloco:4:lr0.5",
        "--noise-seeds", "1", "--steps", "8", "--eval-every", "2", "--batch-size", "2", "--layers", "1",
        "--hidden", "32", "--heads", "2", "--seq-len", "32", "--warmup-steps", "2", "--eval-sequences", "8",
        "--timeout-s", "120", "--out", str(out),
    ]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    labels = ["allreduce-s0", "diloco-h2-s0", "diloco-h4-lr0.5-s0"]
    assert plotted == labels and (out / "loss.png").stat().st_size > 0
    summary = json.loads((out / "summary.json").read_text())
    runs = {r["label"]: r for r in summary["runs"]}
    assert list(runs) == labels
    assert {r["tokens"] for r in runs.values()} == {8 * 2 * 2 * 32}  # steps x N x batch x seq_len
    assert runs["allreduce-s0"]["syncs_per_step"] == 1.0
    assert runs["diloco-h2-s0"]["syncs_per_step"] == 0.5 and runs["diloco-h4-lr0.5-s0"]["syncs_per_step"] == 0.25
    assert runs["diloco-h2-s0"]["bytes_per_token"] < runs["allreduce-s0"]["bytes_per_token"]
    assert runs["diloco-h2-s0"]["post_sync_divergence"] == 0.0 and runs["diloco-h2-s0"]["averages"] == 4
    record = json.loads((out / "runs" / "diloco-h2-s0.json").read_text())
    assert [s["step"] for s in record["ranks"][0]["method_info"]["syncs"]] == [2, 4, 6, 8]
    families = {row["family"]: row for row in summary["families"]}
    assert set(families) == {"allreduce", "diloco"} and families["diloco"]["tried"] == 2
    best = families["diloco"]["best"]
    assert best in ("diloco-h2", "diloco-h4-lr0.5") and families["diloco"]["best_labels"] == [f"{best}-s0"]
    assert "each method family at its best tried setting" in printed
    assert "settings tried (each a full run): diloco: diloco-h2, diloco-h4-lr0.5" in printed
    assert "tokens: 128 per optimizer step, 1,024 per run, the same for every run" in printed
