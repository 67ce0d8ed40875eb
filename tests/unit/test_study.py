"""The accuracy study: fitted slopes against the theory, and `cerar study` end to end."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from cerar.cli import main
from cerar.experiments.study import synthetic as study


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CERAR_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def slopes() -> dict:
    return study.slope_study(4, size=256, seed=0)


def test_error_slope_is_one_in_float64(slopes: dict) -> None:
    for label, s in slopes["series"].items():
        assert abs(s["error_slope"] - 1.0) <= 0.15, label


def test_cond_slope_is_minus_r(slopes: dict) -> None:
    for label, s in slopes["series"].items():
        assert abs(s["cond_slope"] - s["predicted_cond_slope"]) <= 0.3, label
    assert slopes["series"]["perturbed c=8"]["predicted_cond_slope"] == -1.0
    assert slopes["series"]["perturbed c=12"]["predicted_cond_slope"] == -2.0


def test_fit_slope() -> None:
    x = np.geomspace(1e-3, 1, 5)
    assert study.fit_slope(x, 3 * x**-2) == pytest.approx(-2.0)


def test_ring_references_match_design_figures() -> None:
    x = study.iid_inputs(4, 65536, 0)
    assert study.ring_error(x, "fp64") < 1e-15
    assert 2e-4 < study.ring_error(x, "fp16") < 8e-4  # docs/protocol.md, "Reference figures": 4.0e-4 at N = 4
    assert 1.5e-3 < study.ring_error(x, "bf16") < 6e-3  # docs/protocol.md, "Reference figures": 3.2e-3


def test_gradient_like_inputs_share_a_part() -> None:
    x = study.gradient_like_inputs(4, 10000, 0)
    assert x.shape == (4, 10000)
    assert np.corrcoef(x[0], x[1])[0, 1] > 0.8


def test_tradeoff_points() -> None:
    data = study.tradeoff_study((4,), (2, 3), ("fp32",), 32, 0)
    assert {p["design"] for p in data["points"]} == set(study.DESIGNS) == {"perturbed", "perturbed-spread", "optimized"}
    for p in data["points"]:
        c = p["components"]
        assert p["bytes_per_element"] == pytest.approx(4 * (1 + 2 / c))
        assert 0 < p["error"] < (1e-3 if c == 8 else 1e-2)
    assert data["references"]["4"]["fp16"]["bytes"] == pytest.approx(2 * 1.5)
    # the spread/optimized curve lies below the plain one at c = 3N
    error = {p["design"]: p["error"] for p in data["points"] if p["components"] == 12}
    assert error["optimized"] < error["perturbed-spread"] < 0.7 * error["perturbed"]


def test_tradeoff_rejects_unknown_design() -> None:
    with pytest.raises(ValueError, match=r"Argument 'designs' must hold names from .*, not 'rotated'"):
        study.tradeoff_study((4,), (2,), ("fp32",), 8, 0, designs=("rotated",))


@pytest.mark.slow  # the whole command with its plots: make test runs it, make test-fast leaves it out
def test_study_command_writes_figures_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "study"
    assert main(["study", "--quick", "--out", str(out)]) == 0
    for name in ("slopes", "tradeoff"):
        assert (out / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        json.loads((out / f"{name}.json").read_text())
    assert "error slope" in capsys.readouterr().out


def test_study_command_rejects_bad_size(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["study", "--size", "0", "--out", str(tmp_path)]) == 2
    assert "size" in capsys.readouterr().err
