"""Real-gradient study: capture on a tiny model with 2 ranks, the measurement, argument checks."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from cerar.experiments.study import capture as gradient_capture
from cerar.experiments.study import gradients as gradient_study
from cerar.experiments.study.capture import (
    Capture,
    capture_rank,
    check_capture_steps,
    default_capture_steps,
    parameter_layout,
)
from cerar.experiments.train.config import ModelConfig, TrainConfig
from cerar.experiments.train.data import load_split, train_batch
from cerar.experiments.train.model import build_model, local_gradient
from multirank import check, run_ranks

TINY = ModelConfig(layers=1, hidden=16, heads=2, seq_len=16)
CONFIG = TrainConfig(steps=4, batch_size=2, warmup_steps=1, model=TINY)


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CERAR_CACHE_DIR", str(tmp_path / "cache"))


def _capture(rank: int, world_size: int, config: TrainConfig) -> Capture | None:
    return capture_rank(config, (0, 2, 4))


@pytest.fixture(scope="module")
def captured() -> Capture:
    results = check(run_ranks(_capture, 2, CONFIG, timeout=90))
    assert results[1] is None  # only rank 0 holds the gathered gradients
    assert isinstance(results[0], Capture)
    return results[0]


def test_capture_shapes_and_steps(captured: Capture) -> None:
    n_params = sum(p.numel() for p in build_model(TINY, 0).parameters())
    assert captured.steps == (0, 2, 4)
    assert captured.gradients.shape == (3, 2, n_params)
    assert captured.gradients.dtype == np.float32
    assert captured.losses.shape == (3, 2)
    assert np.all(np.isfinite(captured.gradients))
    # Ranks train on different data: their gradients differ.
    assert not np.allclose(captured.gradients[0, 0], captured.gradients[0, 1])
    # Training moved the weights: later gradients are not those of the start.
    assert not np.allclose(captured.gradients[0], captured.gradients[2])


def test_capture_stores_the_parameter_layout(captured: Capture) -> None:
    model = build_model(TINY, 0)
    assert captured.parameters == parameter_layout(model)
    assert captured.parameters == gradient_capture.model_parameters(TINY)
    assert sum(size for _, size in captured.parameters) == captured.size
    names = [name for name, _ in captured.parameters]
    assert names == [name for name, p in model.named_parameters() if p.requires_grad]


def test_start_gradient_is_each_ranks_local_gradient(captured: Capture) -> None:
    # At step 0 the weights are the seed's: recompute each rank's gradient here, in one process.
    split = load_split()
    model = build_model(TINY, CONFIG.seed)
    for rank in range(2):
        tokens = train_batch(split, 0, rank, 2, CONFIG.batch_size, TINY.seq_len, CONFIG.seed)
        expected = local_gradient(model, tokens).numpy()
        np.testing.assert_allclose(captured.gradients[0, rank], expected, rtol=1e-4, atol=1e-7)


def test_save_load_round_trip(captured: Capture, tmp_path: Path) -> None:
    path = gradient_capture.save_capture(captured, tmp_path / "sub" / "cap.npz")
    loaded = gradient_capture.load_capture(path)
    assert loaded.steps == captured.steps
    assert loaded.config == captured.config
    np.testing.assert_array_equal(loaded.gradients, captured.gradients)
    np.testing.assert_array_equal(loaded.losses, captured.losses)
    assert loaded.parameters == captured.parameters


def test_study_on_captured_gradients(captured: Capture, tmp_path: Path) -> None:
    datasets = {f"step {s}": captured.gradients[p] for p, s in enumerate(captured.steps)}
    study = gradient_study.gradient_study(datasets, constructions=("perturbed",), info={"note": "tiny"})
    assert study["datasets"] == ["i.i.d.", "step 0", "step 2", "step 4"]
    labels = [m["label"] for m in study["methods"]]
    sixteen = [f"cerar optimized c={c} {p}" for c in (4, 6) for p in ("fp16", "bf16")]
    assert labels == ["cerar perturbed c=4", "cerar perturbed c=6", *sixteen, "ring fp32", "ring fp16", "ring bf16"]
    by_label = {m["label"]: m for m in study["methods"]}
    # 16-bit packets: half of float32 CERAR's bytes, and a coarser but bounded error.
    assert by_label["cerar optimized c=4 fp16"]["bytes_per_element"] == pytest.approx(2.0)
    assert by_label["cerar optimized c=4 fp16"]["wire"] == "fp16"
    for name in study["datasets"]:
        assert by_label["cerar optimized c=4 fp16"]["errors"][name]["worst"] < 5e-2
    # N = 2: CERAR sends 4 bytes per element (no (N-2)/c term), the rings 2 x 2(N-1)/N.
    assert by_label["cerar perturbed c=4"]["bytes_per_element"] == pytest.approx(4.0)
    assert by_label["ring fp16"]["bytes_per_element"] == pytest.approx(2.0)
    assert by_label["ring fp32"]["bytes_per_element"] == pytest.approx(4.0)
    for m in study["methods"]:
        for name in study["datasets"]:
            errors = m["errors"][name]
            assert errors["mean"] <= errors["worst"] == max(errors["per_rank"])
    # The float32 ring is exact up to float32 rounding, on every data set; bf16 is coarser.
    for name in study["datasets"]:
        assert by_label["ring fp32"]["errors"][name]["worst"] < 1e-6
        assert by_label["ring bf16"]["errors"][name]["worst"] > by_label["ring fp32"]["errors"][name]["worst"]
    stats = study["statistics"]
    assert stats["i.i.d."]["common_fraction"] == pytest.approx(0.5, abs=0.05)
    assert 0.5 < stats["step 0"]["common_fraction"] <= 1.0
    json.dumps(study)  # JSON-ready
    gradient_study.plot_gradient_study(study, tmp_path / "g.png")
    assert (tmp_path / "g.png").stat().st_size > 0
    table = gradient_study.method_table(study)
    assert "ring bf16" in table and "common-part fraction" in table


def test_data_statistics() -> None:
    same = np.ones((4, 10))
    assert gradient_study.data_statistics(same)["common_fraction"] == pytest.approx(1.0)
    orthogonal = np.eye(4)
    stats = gradient_study.data_statistics(orthogonal)
    assert stats["common_fraction"] == pytest.approx(0.25)
    assert stats["min_cosine"] == pytest.approx(0.0)


def test_default_capture_steps() -> None:
    assert default_capture_steps(160) == (0, 80, 160)
    assert default_capture_steps(1) == (0, 1)


@pytest.mark.parametrize(
    ("steps", "error", "match"),
    [
        ([0, 5], ValueError, "at most steps=4, not 5"),
        ([-1], ValueError, "at least 0, not -1"),
        ([1, 1], ValueError, "must not repeat"),
        ([], ValueError, "at least one step"),
        ([1.5], TypeError, "integer, not 1.5"),
        ("0", TypeError, "sequence of integers"),
    ],
)
def test_capture_steps_checks(steps: object, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        check_capture_steps(steps, 4)  # type: ignore[arg-type]


def test_capture_gradients_argument_checks(tmp_path: Path) -> None:
    out = tmp_path / "c.npz"
    with pytest.raises(ValueError, match="'world_size' must be at least 2, not 1"):
        gradient_capture.capture_gradients(1, 4, None, TINY, out)
    with pytest.raises(ValueError, match="at most steps=4, not 9"):
        gradient_capture.capture_gradients(2, 4, [9], TINY, out)
    with pytest.raises(TypeError, match="'model_config' must be a ModelConfig"):
        gradient_capture.capture_gradients(2, 4, None, {"layers": 1}, out)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="'path' must be a path, not 3"):
        gradient_capture.capture_gradients(2, 4, None, TINY, 3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="existing capture file"):
        gradient_capture.load_capture(tmp_path / "missing.npz")
    np.savez(tmp_path / "other.npz", x=np.zeros(3))
    with pytest.raises(ValueError, match="not a gradient capture"):
        gradient_capture.load_capture(tmp_path / "other.npz")
    with pytest.raises(TypeError, match="'config' must be a TrainConfig"):
        capture_rank({"steps": 1}, [0])  # type: ignore[arg-type]


def test_gradient_study_argument_checks() -> None:
    good = np.zeros((3, 8), dtype=np.float32) + 1.0
    with pytest.raises(TypeError, match="'datasets' must be a non-empty mapping"):
        gradient_study.gradient_study({})
    with pytest.raises(ValueError, match=r"shape \(8,\)"):
        gradient_study.gradient_study({"a": np.ones(8)})
    with pytest.raises(ValueError, match="one shape"):
        gradient_study.gradient_study({"a": good, "b": np.ones((3, 9))})
    with pytest.raises(TypeError, match="float arrays, not dtype int64"):
        gradient_study.gradient_study({"a": np.ones((3, 8), dtype=np.int64)})
    with pytest.raises(ValueError, match="finite values"):
        gradient_study.gradient_study({"a": np.full((3, 8), np.nan)})
    with pytest.raises(ValueError, match=r"names other than 'i\.i\.d\.'"):
        gradient_study.gradient_study({"i.i.d.": good})
    with pytest.raises(ValueError, match="'multiples' must be at least 1, not 0"):
        gradient_study.gradient_study({"a": good}, multiples=(0,))
    with pytest.raises(ValueError, match="'constructions' must hold names"):
        gradient_study.gradient_study({"a": good}, constructions=("magic",))
    with pytest.raises(ValueError, match="'ring_wires' must hold names"):
        gradient_study.gradient_study({"a": good}, ring_wires=("fp64",))
    with pytest.raises(ValueError, match="'construction' must be one of"):
        gradient_study.build_code("magic", 4, 8)
    with pytest.raises(ValueError, match="'statistic' must be 'worst' or 'mean', not 'max'"):
        gradient_study.method_table({"datasets": [], "methods": [], "statistics": {}}, "max")


def test_cli_gradients_reuses_a_capture(captured: Capture, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from cerar.cli import main

    # N = 2 captures are allowed through --capture (the wrap-free case), so this stays cheap.
    path = gradient_capture.save_capture(captured, tmp_path / "cap.npz")
    out = tmp_path / "out"
    assert main(["study", "--gradients", "--capture", str(path), "--out", str(out)]) == 0
    data = json.loads((out / "gradients.json").read_text())
    assert data["info"]["steps"] == [0, 2, 4]
    assert data["info"]["parameters_from"] == "capture"
    assert data["parameters"] == [list(entry) for entry in captured.parameters]
    assert all("per_parameter" in e for m in data["methods"] for e in m["errors"].values())
    assert (out / "gradients.png").stat().st_size > 0
    printed = capsys.readouterr().out
    assert "common-part fraction" in printed and "per-param" in printed and "zero-sum params" in printed
    # A capture saved before the layout was stored: rebuilt from its model config.
    old = Capture(captured.steps, captured.gradients, captured.losses, captured.config)
    old_path = gradient_capture.save_capture(old, tmp_path / "old.npz")
    assert gradient_capture.load_capture(old_path).parameters is None
    assert main(["study", "--gradients", "--capture", str(old_path), "--out", str(out)]) == 0
    data = json.loads((out / "gradients.json").read_text())
    assert data["info"]["parameters_from"] == "model config (rebuilt)"
    assert data["parameters"] == [list(entry) for entry in captured.parameters]
    assert main(["study", "--gradients", "--world-size", "2", "--out", str(out)]) == 2


# ---------------------------------------------------------------------------------------------
# Per-parameter error (issue 12, part 1)
LAYOUT = (("a", 5), ("empty", 0), ("b", 7), ("unused", 4), ("c", 10), ("d", 2))


def _numpy_parameter_errors(outputs: np.ndarray, exact: np.ndarray, layout) -> tuple:
    """The per-parameter figures by plain loops: the independent reference."""
    worst, where, zero_abs, zero_count = -1.0, None, -1.0, 0
    start = 0
    for name, size in layout:
        part = slice(start, start + size)
        start += size
        if size == 0:
            continue
        norm = float(np.sqrt(np.sum(exact[part] ** 2)))
        for rank in range(outputs.shape[0]):
            error = float(np.sqrt(np.sum((outputs[rank, part] - exact[part]) ** 2)))
            if norm > 0 and error / norm > worst:
                worst, where = error / norm, (name, rank)
            if norm == 0:
                zero_abs = max(zero_abs, error)
        zero_count += norm == 0
    return worst, where, zero_abs, zero_count


def _synthetic(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    d = sum(size for _, size in LAYOUT)
    exact = rng.standard_normal(d) * np.repeat([1.0, 1.0, 100.0, 1.0, 1e-3, 5.0], [s for _, s in LAYOUT])
    exact[12:16] = 0.0  # "unused": true sum exactly zero
    exact[20] = 0.0  # one zero value inside "c"
    outputs = exact + 1e-3 * rng.standard_normal((3, d))
    return outputs, exact


def test_parameter_errors_match_an_independent_numpy_computation() -> None:
    outputs, exact = _synthetic()
    figures = gradient_study.parameter_errors(outputs, exact, LAYOUT)
    worst, (name, rank), zero_abs, zero_count = _numpy_parameter_errors(outputs, exact, LAYOUT)
    assert figures["worst"] == pytest.approx(worst, rel=1e-12)
    assert (figures["worst_parameter"], figures["worst_rank"]) == (name, rank) == ("c", rank)
    assert figures["count"] == 4  # a, b, c, d: "empty" is no parameter, "unused" sums to zero
    assert len(figures["per_rank"]) == 3 and max(figures["per_rank"]) == pytest.approx(worst, rel=1e-12)
    zero = figures["zero_sum"]
    assert zero["count"] == zero_count == 1 and zero["size"] == 4 and zero["parameter"] == "unused"
    assert zero["worst_abs"] == pytest.approx(zero_abs, rel=1e-12)
    assert zero["worst_abs"] == pytest.approx(np.linalg.norm(outputs[:, 12:16], axis=1).max(), rel=1e-12)
    values = figures["zero_values"]
    assert values["count"] == 5  # the four of "unused" and one inside "c"
    mask = exact == 0
    assert values["worst_abs"] == pytest.approx(np.linalg.norm(outputs[:, mask], axis=1).max(), rel=1e-12)
    # The bucket figure hides the small parameter: 1e-3 noise on values of size 1e-3.
    bucket = np.linalg.norm(outputs - exact, axis=1).max() / np.linalg.norm(exact)
    assert figures["worst"] > 100 * bucket
    json.dumps(figures)


def test_parameter_errors_edge_cases() -> None:
    outputs, exact = np.ones((2, 3)), np.zeros(3)
    figures = gradient_study.parameter_errors(outputs, exact, [("x", 1), ("y", 2)])
    assert figures["worst"] is None and figures["count"] == 0 and figures["per_rank"] == [None, None]
    assert figures["zero_sum"]["count"] == 2 and figures["zero_sum"]["worst_abs"] == pytest.approx(np.sqrt(2))
    exact = np.array([1.0, 2.0, 2.0])
    figures = gradient_study.parameter_errors(exact + np.array([[0.5, 0, 0], [0, 0, 0]]), exact, [("x", 3)])
    assert figures["worst"] == pytest.approx(0.5 / 3) and figures["worst_rank"] == 0
    assert figures["zero_sum"] == {"count": 0, "size": 0, "worst_abs": None, "parameter": None}
    assert figures["zero_values"] == {"count": 0, "worst_abs": None}
    assert gradient_study.parameter_errors(np.zeros((2, 0)), np.zeros(0), [("e", 0)])["count"] == 0


@pytest.mark.parametrize(
    ("parameters", "error", "match"),
    [
        ([("a", 5)], ValueError, "summing to d = 28, not 5"),
        ([("a", 29), ("b", -1)], ValueError, "'parameters' must be at least 0, not -1"),
        ([("a", 28.0)], TypeError, "'parameters' must be an integer"),
        ([(3, 28)], TypeError, "with a string, not 3"),
        ([("a", 10, 20)], TypeError, "pairs"),
        ("a", TypeError, "sequence of"),
    ],
)
def test_parameter_layout_checks(parameters: object, error: type[Exception], match: str) -> None:
    outputs, exact = _synthetic()
    with pytest.raises(error, match=match):
        gradient_study.parameter_errors(outputs, exact, parameters)  # type: ignore[arg-type]
    with pytest.raises(error, match=match):
        gradient_study.gradient_study({"a": outputs.astype(np.float32)}, parameters=parameters)  # type: ignore[arg-type]


def test_gradient_study_reports_the_per_parameter_error_beside_the_bucket(tmp_path: Path) -> None:
    from cerar.protocol.simulate import simulate
    from cerar.protocol.simulate_ring import simulate_ring

    # Mixed scales, as one DDP bucket: blocks of 1000 values, every other one scaled by 100, and
    # one block every rank leaves at zero.
    n_ranks, block = 4, 1000
    rng = np.random.default_rng(5)
    scales = np.array([1.0, 100.0, 1.0, 100.0, 0.0, 1.0])
    x = (rng.standard_normal((n_ranks, scales.size * block)) * np.repeat(scales, block)).astype(np.float32)
    layout = [(f"p{k}", block) for k in range(scales.size)]
    study = gradient_study.gradient_study(
        {"mixed": x}, multiples=(2,), constructions=("perturbed",), ring_wires=("fp32", "bf16"), parameters=layout
    )
    assert study["parameters"] == [[name, size] for name, size in layout]
    by_label = {m["label"]: m for m in study["methods"]}
    runs = {
        "cerar perturbed c=8": simulate(gradient_study.build_code("perturbed", n_ranks, 8), x, "fp32"),
        "ring bf16": simulate_ring(x, "bf16"),
    }
    for label, result in runs.items():
        errors = by_label[label]["errors"]["mixed"]
        figures = errors["per_parameter"]
        worst, (name, rank), zero_abs, _ = _numpy_parameter_errors(result.outputs, result.exact, layout)
        assert figures["worst"] == pytest.approx(worst, rel=1e-9)
        assert (figures["worst_parameter"], figures["worst_rank"]) == (name, rank)
        assert figures["zero_sum"]["parameter"] == "p4" and figures["zero_sum"]["size"] == block
        assert figures["zero_sum"]["worst_abs"] == pytest.approx(zero_abs, rel=1e-9, abs=1e-300)
        # Without zero-sum error, a bucket's relative error never exceeds its worst parameter's.
        if zero_abs == 0:
            assert errors["worst"] <= figures["worst"] * (1 + 1e-12)
    # The i.i.d. set is cut at the same boundaries.
    assert by_label["ring fp32"]["errors"]["i.i.d."]["per_parameter"]["count"] == scales.size
    table = gradient_study.method_table(study)
    assert "| mixed | mixed per-param |" in table
    row = next(line for line in table.splitlines() if line.startswith("| cerar perturbed c=8 "))
    assert f"{by_label['cerar perturbed c=8']['errors']['mixed']['per_parameter']['worst']:.2e}" in row
    detail = gradient_study.parameter_table(study)
    assert "| cerar perturbed c=8 | mixed |" in detail and "zero-sum params" in detail
    json.dumps(study)
    gradient_study.plot_gradient_study(study, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 0


def test_study_without_a_layout_is_unchanged() -> None:
    x = np.random.default_rng(1).standard_normal((3, 64)).astype(np.float32)
    study = gradient_study.gradient_study({"a": x}, multiples=(2,), constructions=("perturbed",), ring_wires=("fp32",))
    assert study["parameters"] is None
    assert all("per_parameter" not in e for m in study["methods"] for e in m["errors"].values())
    assert "per-param" not in gradient_study.method_table(study)
    with pytest.raises(ValueError, match="no per-parameter figures"):
        gradient_study.parameter_table(study)


def test_capture_file_layout_round_trip_and_old_files(tmp_path: Path) -> None:
    grads = np.random.default_rng(0).standard_normal((1, 2, 30)).astype(np.float32)
    layout = (("w", 20), ("b", 10))
    capture = Capture((0,), grads, np.zeros((1, 2)), TrainConfig(), parameters=layout)
    path = gradient_capture.save_capture(capture, tmp_path / "new.npz")
    assert gradient_capture.load_capture(path).parameters == layout
    # A file of the old format (no layout) still loads.
    np.savez(tmp_path / "old.npz", gradients=grads, steps=np.array([0]), losses=np.zeros((1, 2)),
             config=np.array(TrainConfig().to_json()))  # fmt: skip
    assert gradient_capture.load_capture(tmp_path / "old.npz").parameters is None
    # A broken layout is an error naming the file, not a silent None.
    np.savez(tmp_path / "broken.npz", gradients=grads, steps=np.array([0]), losses=np.zeros((1, 2)),
             config=np.array(TrainConfig().to_json()), parameter_names=np.array(["w"]),
             parameter_sizes=np.array([29]))  # fmt: skip
    with pytest.raises(ValueError, match=r"broken parameter layout.*summing to d = 30, not 29"):
        gradient_capture.load_capture(tmp_path / "broken.npz")
    with pytest.raises(ValueError, match="summing to d = 30"):
        gradient_capture.save_capture(
            Capture((0,), grads, np.zeros((1, 2)), TrainConfig(), parameters=(("w", 3),)), tmp_path / "bad.npz"
        )
