"""`cerar design`, run in-process through :func:`cerar.cli.main`."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from cerar import Code, codes
from cerar.cli import main


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = main(["design", *argv])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def _strict_json(text: str) -> dict:
    def reject(constant: str) -> None:
        raise AssertionError(f"not strict JSON: {constant}")

    return json.loads(text, parse_constant=reject)


def test_table(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = _run(capsys, "-N", "4", "-c", "8", "--delta", "0.01", "--size", "800")
    assert status == 0 and err == ""
    lines = out.splitlines()
    assert lines[0] == repr(codes.perturbed(4, 8, 0.01))
    assert "rounds L = c + N - 2      10" in out
    assert "1.250" in out and "ring all-reduce 1.500" in out and "ratio 0.833" in out
    assert "storage rate 1 + N/c      1.500" in out
    assert "d = 800" in out
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["rank", "cond"])
    rows = [line.split() for line in lines[header + 1 :] if line.strip()]
    assert [int(r[0]) for r in rows] == [0, 1, 2, 3]
    code = codes.perturbed(4, 8, 0.01)
    for j, row in enumerate(rows):
        assert float(row[1]) == pytest.approx(code.cond[j], rel=1e-2)
        assert float(row[2]) == pytest.approx(code.error_bound[j], rel=1e-2, abs=1e-12)


def test_json_fields(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = _run(
        capsys, "-N", "5", "-c", "13", "--delta", "0.02", "--size", "650", "--seed", "3", "--json"
    )
    assert status == 0 and err == ""
    info = _strict_json(out)
    code = codes.perturbed(5, 13, 0.02)
    assert Code.from_dict(info["code"]) == code
    assert info["repr"] == repr(code)
    assert (info["world_size"], info["components"], info["construction"]) == (5, 13, "perturbed")
    assert info["params"] == {"delta": 0.02, "precision": "fp32"}
    assert (info["reference"], info["precision"]) == ("mixed", "fp32")
    assert info["rounds"] == 16
    assert info["comm_rate"] == pytest.approx(16 / 13)
    assert info["ring_comm_rate"] == pytest.approx(8 / 5)
    assert info["comm_ratio_to_ring"] == pytest.approx((16 / 13) / (8 / 5))
    assert info["storage_rate"] == pytest.approx(1 + 5 / 13)
    np.testing.assert_allclose(info["cond"], code.cond)
    np.testing.assert_allclose(info["error_bound"], code.error_bound)
    np.testing.assert_allclose(info["predicted_error"], code.predicted_error("fp32"))
    assert info["predicted_worst_error"] == pytest.approx(max(info["predicted_error"]))
    assert len(info["simulated_error"]) == 5
    assert info["simulated_worst_error"] == max(info["simulated_error"])
    assert 0 < info["simulated_worst_error"] < 0.05
    sim = info["simulation"]
    assert (sim["size"], sim["seed"]) == (650, 3)
    assert sim["packet_values"] == 50
    assert sim["values_sent_per_rank"] == 16 * 50
    assert 1 <= sim["peak_working_packets"] <= 5
    assert sim["seconds"] >= 0
    # The same seed gives the same simulation.
    again = _strict_json(
        _run(capsys, "-N", "5", "-c", "13", "--delta", "0.02", "--size", "650", "--seed", "3", "--json")[1]
    )
    assert again["simulated_error"] == info["simulated_error"]


@pytest.mark.parametrize(
    ("argv", "construction", "reference", "precision"),
    [
        (["-N", "3", "--construction", "exact"], "exact", "mixed", "fp32"),
        (["-N", "4", "--construction", "exact", "-c", "4", "--reference", "A"], "exact", "A", "fp32"),
        (
            ["-N", "4", "-c", "6", "--construction", "vandermonde", "--eps", "0.05"],
            "vandermonde",
            "mixed",
            "fp32",
        ),
        (["-N", "4", "-c", "10", "--precision", "fp64", "--reference", "A"], "perturbed", "A", "fp64"),
    ],
)
def test_constructions_and_options(
    capsys: pytest.CaptureFixture[str], argv: list[str], construction: str, reference: str, precision: str
) -> None:
    status, out, _ = _run(capsys, *argv, "--size", "120", "--json")
    assert status == 0
    info = _strict_json(out)
    assert (info["construction"], info["reference"], info["precision"]) == (
        construction,
        reference,
        precision,
    )
    if construction == "exact":
        assert info["components"] == info["world_size"]
        assert info["simulated_worst_error"] < 1e-6
    if precision == "fp64" and construction == "perturbed":
        assert info["params"]["precision"] == "fp64"


def test_codes_above_the_error_limit_are_shown_and_flagged(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = _run(capsys, "-N", "4", "-c", "8", "--construction", "vandermonde", "--size", "80", "--json")
    assert status == 0
    info = _strict_json(out)
    assert info["above_error_limit"] is True and info["predicted_worst_error"] > 0.1
    status, out, _ = _run(capsys, "-N", "4", "-c", "8", "--construction", "vandermonde", "--size", "80")
    assert status == 0 and "above the error limit 0.1" in out
    status, out, _ = _run(capsys, "-N", "4", "-c", "8", "--size", "80")
    assert status == 0 and "above the error limit" not in out


def test_default_components_is_2n(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = _run(capsys, "-N", "3", "--delta", "0.05", "--size", "60", "--json")
    assert status == 0 and _strict_json(out)["components"] == 6


@pytest.mark.parametrize(
    ("argv", "name", "value"),
    [
        (["-N", "1"], "world_size", "1"),
        (["-N", "4", "-c", "0"], "components", "0"),
        (["-N", "4", "-c", "8", "--delta", "nan"], "delta", "nan"),
        (["-N", "4", "-c", "8", "--delta", "-0.1"], "delta", "-0.1"),
        (["-N", "4", "-c", "6", "--construction", "vandermonde", "--eps", "0"], "eps", "0.0"),
        (["-N", "4", "-c", "5", "--construction", "exact"], "components", "5"),
        (["-N", "4", "-c", "8", "--delta", "0.01", "--size", "0"], "size", "0"),
    ],
)
def test_invalid_arguments_exit_2_with_message(
    capsys: pytest.CaptureFixture[str], argv: list[str], name: str, value: str
) -> None:
    status, out, err = _run(capsys, *argv)
    assert status == 2 and out == ""
    assert err.startswith("cerar design: error:")
    assert f"'{name}'" in err and value in err, err


@pytest.mark.parametrize(
    "argv",
    [
        ["--construction", "unknown"],
        ["--precision", "fp8"],
        ["--reference", "B"],
        ["-N", "four"],
        ["--delta", "x"],
    ],
)
def test_argparse_rejects(capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["design", *argv])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "invalid" in err and argv[-1] in err


def test_no_command_prints_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "design" in capsys.readouterr().out


def test_design_table_is_finite(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = _run(capsys, "-N", "3", "-c", "7", "--size", "70")
    assert status == 0
    numbers = [float(x) for line in out.splitlines()[7:] for x in line.split()[1:]]
    assert numbers and all(math.isfinite(x) for x in numbers)
