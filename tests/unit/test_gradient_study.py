"""Real-gradient study: capture on a tiny model with 2 ranks, the measurement, argument checks."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from cerar.experiments.study import capture as gradient_capture
from cerar.experiments.study import gradients as gradient_study
from cerar.experiments.study.capture import Capture, capture_rank, check_capture_steps, default_capture_steps
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


def test_study_on_captured_gradients(captured: Capture, tmp_path: Path) -> None:
    datasets = {f"step {s}": captured.gradients[p] for p, s in enumerate(captured.steps)}
    study = gradient_study.gradient_study(datasets, constructions=("perturbed",), info={"note": "tiny"})
    assert study["datasets"] == ["i.i.d.", "step 0", "step 2", "step 4"]
    labels = [m["label"] for m in study["methods"]]
    assert labels == ["cerar perturbed c=4", "cerar perturbed c=6", "ring fp32", "ring fp16", "ring bf16"]
    by_label = {m["label"]: m for m in study["methods"]}
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
    assert (out / "gradients.png").stat().st_size > 0
    assert "common-part fraction" in capsys.readouterr().out
    assert main(["study", "--gradients", "--world-size", "2", "--out", str(out)]) == 2

