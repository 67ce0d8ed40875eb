"""``cerar plan`` from a bench JSON (here and for a described cluster), its argument checks, and
the parsers of ``auto`` in ``cerar train`` and ``cerar bench``; no ranks are started."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cerar.cli import main
from cerar.experiments.bench.config import BenchConfig
from cerar.experiments.bench.model import add_predictions
from cerar.experiments.plan import parse_coding_rate, parse_latency
from cerar.experiments.train.config import TrainConfig, parse_method

MiB = 1 << 20
#: A slow link's figures at N = 4: latency per round, seconds per byte, coding seconds per value.
ALPHA = {"builtin": 2e-4, "cerar": 8e-4}
BETA = 1 / 48e6
GAMMA = {"ring-fp16": 2e-9, "cerar": 6e-9, "cerar-fp16": 4e-9}
BYTES = {"builtin": 6.0, "ring-fp16": 3.0, "cerar": 5.0, "cerar-fp16": 2.5}  # per value at N = 4, c = 8
ROUNDS = {"builtin": 6, "ring-fp16": 8, "cerar": 12, "cerar-fp16": 12}  # cerar's transport: + 2 handshake hops


def _doc(tmp_path: Path) -> Path:
    results = []
    for method in BYTES:
        for size in (MiB, 4 * MiB, 16 * MiB, 64 * MiB):
            values = size / 4
            alpha = ALPHA["builtin" if method == "builtin" else "cerar"]
            time = ROUNDS[method] * alpha + BYTES[method] * values * BETA + GAMMA.get(method, 0.0) * values
            components = 8 if method.startswith("cerar") else None
            results.append({"method": method, "components": components, "size_bytes": size, "regime": "slow",
                            "time_median_s": time, "ranks_per_node": 1})  # fmt: skip
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"world_size": 4, "results": results}))
    return path


def test_plan_from_a_bench_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _doc(tmp_path)
    assert main(["plan", "--from", str(path)]) == 0
    out = capsys.readouterr().out
    assert "fitted from" in out and "slow regime model, N = 4" in out and "1/beta = 48.0 MB/s" in out
    # Latency-bound small sizes go by the float16 ring, large ones by 16-bit CERAR (fewest bytes).
    choices = out.split("choice by size")[1]
    assert choices.index(": fp16") < choices.index(": cerar-fp16 c=8")
    assert main(["plan", "--from", str(path), "--max-error", "1e-3", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [c["name"] for c in doc["fitted"]["candidates"]] == ["exact", "fp16", "cerar"]
    assert doc["fitted"]["model"]["beta_s_per_byte"] == pytest.approx(BETA, rel=1e-3)
    assert {row["choice"] for row in doc["fitted"]["table"]["rows"]} <= {"exact", "fp16", "cerar c=8"}


def test_plan_for_a_described_cluster(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _doc(tmp_path)
    argv = ["plan", "--from", str(path), "-N", "16", "--rate", "10gbit", "--coding-rate", "2000GB/s", "--json"]
    assert main(argv) == 0
    predicted = json.loads(capsys.readouterr().out)["predicted"]
    assert predicted["predicted"] and predicted["world_size"] == 16 and "coding rate" in predicted["formula"]
    assert predicted["model"]["beta_s_per_byte"] == pytest.approx(8 / 10e9)
    # the coding's memory traffic at 2 TB/s: 12 bytes per value for a 16-bit ring's casts
    assert predicted["model"]["gamma_s_per_value"]["fp16"] == pytest.approx(12 / 2e12)
    assert main(["plan", "--from", str(path), "-N", "16", "--latency", "20us"]) == 0
    assert "PREDICTED (not measured)" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--coding-rate", "fast"], "Argument 'coding_rate' must be a rate"),
        (["--latency=-1us"], "Argument 'latency'"),
        (["--rate", "10"], "rate"),
        (["--regime", "fast"], "Argument 'regime' must be one the bench ran (slow)"),
        (["--max-error", "0"], "Argument 'max_error' must be positive"),
        (["-N", "1"], "Argument 'world_size' must be at least 2"),
    ],
)
def test_plan_rejects(tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    assert main(["plan", "--from", str(_doc(tmp_path)), *argv]) == 2
    assert message in capsys.readouterr().err


def test_rate_parsers() -> None:
    assert parse_coding_rate("500GB/s") == 5e11 and parse_coding_rate("8.9e9") == 8.9e9
    assert parse_latency("20us") == pytest.approx(2e-5) and parse_latency("0.5ms") == pytest.approx(5e-4)


def test_bench_predictions_beside_measurements(tmp_path: Path) -> None:
    records = json.loads(_doc(tmp_path).read_text())["results"]
    records.append({**records[-1], "method": "auto", "components": None, "auto": {"method": "cerar-fp16 c=8"}})
    fits = add_predictions(records, 4)
    assert [f["regime"] for f in fits] == ["slow"]
    for r in records:  # the model is exact on these figures; auto's is the method it chose
        assert r["predicted_s"] == pytest.approx(r["time_median_s"], rel=1e-3)
    with pytest.raises(ValueError, match="Argument 'auto_max_error' must be positive"):
        BenchConfig(auto_max_error=0.0)


def test_train_auto_spec() -> None:
    assert parse_method("auto", 4) == ("auto", {}) and parse_method("auto:2e-2", 4) == ("auto", {"max_error": 0.02})
    assert TrainConfig(method="auto", max_error=1e-3).label == "auto-0.001-s0"
    for bad in ("auto:x", "auto:0", "auto:2N"):
        with pytest.raises(ValueError, match="'auto:1e-3'"):
            parse_method(bad, 4)
    with pytest.raises(ValueError, match="Argument 'max_error' applies to method 'auto' only"):
        TrainConfig(method="cerar", max_error=1e-3)
