"""Error feedback's numpy reference and study (cerar.experiments.study.feedback) and
`cerar study --feedback`; the reference is held bitwise to the collective in
tests/multirank/test_feedback_reference.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from cerar.cli import main
from cerar.coding.blocks import WIRES, BlockFormat, direct_round_trip
from cerar.experiments.study import feedback
from cerar.protocol.simulate_ring import simulate_ring


def _inputs(n: int, d: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, d)).astype(np.float32)


@pytest.mark.parametrize("wire", WIRES)
@pytest.mark.parametrize(("n", "d"), [(2, 64), (3, 100), (4, 1001), (5, 3)])
def test_zero_residuals_give_the_plain_shapes(wire: str, n: int, d: int) -> None:
    """A stream's first call is the plain call: the simulator's ring, direct_round_trip's direct."""
    x, fmt = _inputs(n, d), BlockFormat(wire)
    ring, ring_res = feedback.ring_feedback(x, fmt, feedback.zero_residuals(n, d))
    direct, direct_res = feedback.direct_feedback(x, fmt, feedback.zero_residuals(n, d))
    assert ring.dtype == direct.dtype == np.float32 and ring.shape == direct.shape == (d,)
    assert np.array_equal(ring, simulate_ring(x, wire, block_format=fmt).outputs[0].astype(np.float32))
    assert np.array_equal(direct, direct_round_trip(x, fmt))
    assert np.array_equal(direct, feedback.plain_call("direct", x, fmt))
    assert np.array_equal(ring, feedback.plain_call("ring", x, fmt))
    padded = n * -(-d // n)
    for res in (ring_res, direct_res):
        assert res.shape == (n, padded) and res.dtype == np.float32
        assert np.all(res[:, d:] == 0)  # the pad quantizes exactly


@pytest.mark.parametrize("shape", feedback.SHAPES)
def test_residuals_keep_what_was_rounded_away(shape: str) -> None:
    """The sum over calls telescopes: ``sum_k out_k = k S - (sum of the residuals' change)``, up
    to float32's rounding of the sums, whatever the wire."""
    n, d, calls = 4, 512, 6
    x, fmt = _inputs(n, d, 1), BlockFormat("int4")
    residuals = feedback.zero_residuals(n, d)
    given = residuals.copy()
    total = np.zeros(d)
    for _ in range(calls):
        out, residuals = feedback.feedback_call(shape, x, fmt, residuals)
        total += out
    assert np.array_equal(given, feedback.zero_residuals(n, d))  # the argument is not changed
    exact = x.astype(np.float64).sum(axis=0)
    predicted = calls * exact - residuals.astype(np.float64).sum(axis=0)[:d]
    assert np.max(np.abs(total - predicted)) < 1e-4 * np.max(np.abs(exact)) * calls
    assert np.max(np.abs(total - calls * exact)) > 1e-2  # the residual is not nothing


def test_scale_exponent_is_exact_for_ordinary_values() -> None:
    x, fmt = _inputs(3, 300, 2), BlockFormat("int8")
    res = feedback.zero_residuals(3, 300)
    out, res1 = feedback.ring_feedback(x, fmt, res)
    for exponent in (-20, 7, 60):
        scaled, res2 = feedback.ring_feedback(x, fmt, res, scale_exponent=exponent)
        assert np.array_equal(out, scaled) and np.array_equal(res1, res2)


def test_arguments_are_checked() -> None:
    x, fmt = _inputs(4, 10), BlockFormat("int8")
    with pytest.raises(ValueError, match="'residuals'"):
        feedback.ring_feedback(x, fmt, np.zeros((4, 10), dtype=np.float32))  # not padded to 12
    with pytest.raises(ValueError, match="'residuals'"):
        feedback.direct_feedback(x, fmt, np.zeros((4, 12)))  # float64
    with pytest.raises(ValueError, match="'inputs'"):
        feedback.direct_feedback(x[:1], fmt, np.zeros((1, 10), dtype=np.float32))
    with pytest.raises(TypeError, match="'fmt'"):
        feedback.ring_feedback(x, "int8", feedback.zero_residuals(4, 10))
    with pytest.raises(ValueError, match="'shape'"):
        feedback.feedback_call("tree", x, fmt, feedback.zero_residuals(4, 10))
    with pytest.raises(ValueError, match="'wires'"):
        feedback.feedback_study(wires=("int1",))


def test_running_errors() -> None:
    exact = np.array([1.0, 2.0])
    errors = feedback.running_errors([np.array([1.5, 2.0]), np.array([0.5, 2.0])], exact)
    assert errors == pytest.approx([0.5 / np.sqrt(5), 0.0])


def test_sum_over_calls_converges_with_feedback_only() -> None:
    """err(100) with error feedback below a tenth of err(1); without it, the one call's error."""
    study = feedback.feedback_study(4, 2048, 100, kinds=("gaussian", "student-t3"), wires=("int8", "int4"))
    assert len(study["series"]) == 2 * 2 * 2
    for s in study["series"]:
        plain, fed = s["plain"], s["fed"]
        assert len(plain) == len(fed) == 100 and fed[0] == plain[0], s["wire"]
        assert plain[-1] > 0.5 * plain[0]
        assert fed[-1] < 0.1 * fed[0], (s["input"], s["wire"], s["shape"], fed[0], fed[-1])
        assert -1.2 < s["slope"] < -0.8  # like 1/k
        assert s["residual_rms"] < s["input_rms"]  # bounded
    table = feedback.feedback_table(study)
    assert table.splitlines()[0].split()[:4] == ["input", "wire", "shape", "err(1)"]
    assert len(table.splitlines()) == 1 + len(study["series"])


def test_study_feedback_writes_json_png_and_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "study"
    argv = ["study", "--feedback", "--values", "256", "--calls", "12", "--out", str(out)]
    assert main([*argv, "--wires", "int8,int4"]) == 0
    data = json.loads((out / "feedback.json").read_text())
    assert (data["world_size"], data["values"], data["calls"]) == (4, 256, 12)
    assert [(s["input"], s["wire"], s["shape"]) for s in data["series"]] == [
        (kind, wire, shape) for kind in feedback.INPUTS for wire in ("int8", "int4") for shape in feedback.SHAPES
    ]
    assert (out / "feedback.png").stat().st_size > 0
    printed = capsys.readouterr().out
    assert "err(12) no EF" in printed and "student-t3  int4  direct" in printed
    assert main([*argv, "--world-size", "3", "--wires", "fp8"]) == 0
    data = json.loads((out / "feedback.json").read_text())
    assert data["world_size"] == 3 and {s["wire"] for s in data["series"]} == {"fp8"}
    assert main([*argv, "--wires", "int1"]) == 2
    assert "Argument 'wires'" in capsys.readouterr().err
    assert main(["study", "--feedback", "--values", "0", "--out", str(out)]) == 2  # refused, not the default
    assert "Argument 'values' must be at least 1" in capsys.readouterr().err
    assert main([*argv, "--calls", "1"]) == 2
    assert "Argument 'calls'" in capsys.readouterr().err
