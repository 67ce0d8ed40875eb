"""The block wires' frontier study (cerar.experiments.study.frontier) and `cerar study --frontier --blocks`."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from cerar.cli import main
from cerar.coding.blocks import WIRES
from cerar.experiments.study import frontier


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CERAR_CACHE_DIR", str(tmp_path / "cache"))


def test_inputs() -> None:
    for kind in frontier.INPUTS:
        x = frontier.inputs(kind, 4, 20000, 0)
        assert x.shape == (4, 20000) and x.dtype == np.float32
    layers = frontier.inputs("layers", 2, 50000, 1)
    spread = np.abs(layers[0]).reshape(-1, 1000).max(axis=1)
    assert spread.max() / spread.min() > 100  # segments scaled over decades
    with pytest.raises(ValueError, match="'kind'"):
        frontier.inputs("uniform", 2, 10, 0)


def test_packet_deltas_order() -> None:
    deltas = {p: frontier.packet_delta(p, size=8192) for p in ("fp32", "fp16", "bf16", "int8", "fp8")}
    assert deltas["fp32"] == 0.0  # the inputs are float32 already
    assert 0 < deltas["fp16"] < deltas["bf16"] < deltas["int8"] < deltas["fp8"] < 0.05


def test_narrow_round_trip_is_int8_at_8_bits() -> None:
    from cerar.coding.blocks import BlockFormat, round_trip

    x = np.random.default_rng(0).standard_normal((2, 300)).astype(np.float32)
    assert np.array_equal(frontier.narrow_round_trip(x, 8), round_trip(x, BlockFormat("int8", 64, "bf16")))
    assert frontier.narrow_round_trip(np.zeros((1, 5), dtype=np.float32), 4).tolist() == [[0.0] * 5]
    # at 4 bits it is the real int4 wire, which replaced it in the frontier
    for block in frontier.INT4_BLOCKS:
        int4 = round_trip(x, BlockFormat("int4", block, "bf16"))
        assert np.array_equal(frontier.narrow_round_trip(x, 4, block), int4)
    assert 4 not in frontier.NARROW_BITS


def test_block_table_takes_the_wires() -> None:
    rows = frontier.block_table((4,), (8, 16), ("bf16",), size=2048, seeds=1, kinds=("gaussian",), wires=("int4",))
    assert [(r["wire"], r["block"]) for r in rows] == [("int4", 8), ("int4", 16)]
    assert rows[0]["errors"]["gaussian"] < rows[1]["errors"]["gaussian"] < rows[1]["bound"]
    assert rows[0]["bytes_per_value"] == 1.5 * (0.5 + 2 / 8)
    with pytest.raises(ValueError, match="'wires'"):
        frontier.block_table((4,), wires=("int1",))


def test_block_tables_measure_each_wire_at_its_blocks() -> None:
    rows = frontier.block_tables(("int4", "int8", "fp8", "int4"), size=256, seeds=1, quick=True)
    assert sorted({(r["wire"], r["block"]) for r in rows if r["wire"] == "int4"}) == [
        ("int4", b) for b in frontier.INT4_BLOCKS
    ]
    assert {r["block"] for r in rows if r["wire"] != "int4"} == set(frontier.BLOCKS)
    assert len(rows) == 3 * (len(frontier.INT4_BLOCKS) + 2 * len(frontier.BLOCKS))  # every scale, each once
    assert {r["world_size"] for r in rows} == {4}  # quick: N = 4 only
    with pytest.raises(ValueError, match="'wires'"):
        frontier.block_tables(("int1",))


def test_default_format_points_are_the_rows_rings() -> None:
    points = [
        {"kind": "ring4", "wire": "int4", "block": 32, "scale": "bf16"},
        {"kind": "ring4", "wire": "int4", "block": 64, "scale": "bf16"},
        {"kind": "ring8", "wire": "int8", "block": 64, "scale": "bf16"},
        {"kind": "ring8", "wire": "int8", "block": 64, "scale": "fp32"},
        {"kind": "ring", "wire": "fp16"},
        {"kind": "direct", "wire": "int4", "block": 32, "scale": "bf16"},
        {"kind": "direct", "wire": "int8", "block": 32, "scale": "bf16"},
    ]
    assert frontier.default_format_points(points) == [points[0], points[2], points[5]]


def test_direct_error_is_the_direct_shapes() -> None:
    from cerar.coding.blocks import BlockFormat, direct_round_trip, ring_error_bound

    x = frontier.inputs("gaussian", 4, 8192, 0)
    for wire in WIRES:
        fmt = BlockFormat(wire)
        error = frontier.direct_error(x, fmt)
        exact = x.astype(np.float64).sum(axis=0)
        assert error == np.linalg.norm(direct_round_trip(x, fmt) - exact) / np.linalg.norm(exact)
        assert 0 < error < ring_error_bound(4, fmt, shape="direct"), wire


def test_study_blocks_takes_the_wires(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "study"
    argv = ["study", "--blocks", "--quick", "--values", "256", "--out", str(out)]
    assert main([*argv, "--wires", "int8,int4"]) == 0
    blocks = json.loads((out / "blocks.json").read_text())
    assert blocks["wires"] == ["int8", "int4"]
    assert [r["wire"] for r in blocks["rows"]] == ["int8"] * 3 * len(frontier.BLOCKS) + ["int4"] * 3 * len(
        frontier.INT4_BLOCKS
    )
    assert "N= 4 int4 B=  32 bf16:" in capsys.readouterr().out
    assert main([*argv, "--wires", "int4", "fp8"]) == 0  # space separated too
    assert {r["wire"] for r in json.loads((out / "blocks.json").read_text())["rows"]} == {"int4", "fp8"}
    assert main([*argv]) == 0  # the 8-bit wires by default
    assert json.loads((out / "blocks.json").read_text())["wires"] == ["int8", "fp8"]
    assert main([*argv, "--wires", "int8,int1"]) == 2
    assert "Argument 'wires'" in capsys.readouterr().err


def test_pareto_marks() -> None:
    points = [
        {"kind": "ring", "world_size": 4, "bytes_per_value": 1.0, "error": 1.0},
        {"kind": "ring", "world_size": 4, "bytes_per_value": 2.0, "error": 0.5},
        {"kind": "ring", "world_size": 4, "bytes_per_value": 2.0, "error": 0.6},  # dominated
        {"kind": "cerar", "world_size": 8, "bytes_per_value": 3.0, "error": 2.0},  # another N
        {"kind": "narrow", "world_size": 4, "bytes_per_value": 0.5, "error": 0.1},  # reference only
    ]
    frontier.mark_pareto(points)
    assert [p["on_frontier"] for p in points] == [True, True, False, True, False]
    assert [p["dominated_by_narrow"] for p in points] == [True, True, True, False, False]


def test_k_table_model_matches_simulation() -> None:
    rows = frontier.k_table((4,), size=4096, packets=("bf16", "int8"))
    assert {r["components"] for r in rows} == {5, 8}
    for r in rows:
        assert math.isclose(r["K"], r["wrap"] * r["A"])
        for p in ("bf16", "int8"):
            # error = sqrt(wrap^2 + (A delta)^2), and never below the floor sqrt(2 K delta)
            assert 0.75 < r["measured"][p] / r["model"][p] < 1.33, (r["design"], p)
            assert r["model"][p] >= r["floor"][p] * (1 - 1e-12)


@pytest.mark.slow  # the whole command with its plots: make test runs it, make test-fast leaves it out
def test_study_quick_writes_json_and_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "study"
    assert main(["study", "--frontier", "--blocks", "--quick", "--out", str(out)]) == 0
    data = json.loads((out / "frontier.json").read_text())
    assert {"points", "size", "seeds", "k_table", "cerar_block_format"} <= set(data)
    assert (out / "frontier.png").stat().st_size > 0
    kinds = {p["kind"] for p in data["points"]}
    assert kinds == {"ring", "ring8", "ring4", "direct", "cerar", "cerar8", "narrow"}
    for p in data["points"]:
        assert {"label", "world_size", "bytes_per_value", "error", "on_frontier"} <= set(p)
        assert p["world_size"] == 4
    assert any(p["on_frontier"] for p in data["points"])
    ring8 = [p for p in data["points"] if p["kind"] == "ring8"]
    assert all(p["error"] <= p["bound"] for p in ring8)
    # the direct shape beside each block ring, at its format and bytes, with less error
    rings = [p for p in data["points"] if p["kind"] in ("ring8", "ring4")]
    direct = [p for p in data["points"] if p["kind"] == "direct"]
    assert [(p["wire"], p["block"], p["scale"], p["bytes_per_value"]) for p in direct] == [
        (p["wire"], p["block"], p["scale"], p["bytes_per_value"]) for p in rings
    ]
    assert {p["wire"] for p in direct} == set(WIRES)
    assert all(d["error"] < r["error"] and d["error"] <= d["bound"] for d, r in zip(direct, rings, strict=True))
    cerar8 = [p for p in data["points"] if p["kind"] == "cerar8"]
    assert {p["components"] for p in cerar8} == {5, 6, 8, 12}
    blocks = json.loads((out / "blocks.json").read_text())
    assert len(blocks["rows"]) == 2 * 3 * len(frontier.BLOCKS)
    assert set(blocks["rows"][0]["errors"]) == set(frontier.INPUTS)
    # the int4 ring's points beside int8's, each at the format its row runs, printed and plotted
    printed = capsys.readouterr().out
    assert "ring int4 B=32 bf16" in printed and "ring int8 B=64 bf16" in printed
    assert "direct int4 B=32 bf16" in printed and "direct int8 B=64 bf16" in printed
    assert printed.count("(the row's format)") == 2 * len(WIRES)  # each block wire's ring and direct rows


def test_study_frontier_refuses_bad_world_sizes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["study", "--frontier", "-N", "2", "--out", str(tmp_path)]) == 2
    assert "'world_sizes'" in capsys.readouterr().err
