"""cerar bench: statistics, bandwidths, the alpha-beta model, the schema, argument checks, and
smoke runs of the command (fast on loopback; slow where root, ip and tc exist). No timing
thresholds: the runs check structure and cleanup, never speed."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from processes import alive

from cerar.cli import build_parser
from cerar.cli.bench import config_from_args
from cerar.coding.linear_code import Code
from cerar.experiments.bench.config import BenchConfig, format_size, parse_size
from cerar.experiments.bench.methods import ALL_REDUCE_METHODS, AllReduceMethod, get_method
from cerar.experiments.bench.run import analyse, build_cases, make_code, run_bench
from cerar.experiments.bench.schema import RECORD_KEYS, add_ratios, make_record, validate_document
from cerar.experiments.bench.stats import (
    AlphaBeta,
    algbw,
    bus_factor,
    busbw,
    byte_theory_ratio,
    crossover,
    fit_alpha_beta,
    measured_crossover,
    slowest_rank,
    summarize,
)
from cerar.harness import netem

NETNS_REASON = netem.unavailable_reason()
needs_netns = pytest.mark.skipif(NETNS_REASON is not None, reason=str(NETNS_REASON))
MiB = 1 << 20


# --------------------------------------------------------------------------------------------
# statistics and bandwidths


def test_summarize_median_min_max() -> None:
    t = summarize([0.3, 0.1, 0.2, 0.5])
    assert (t.median_s, t.min_s, t.max_s) == (pytest.approx(0.25), 0.1, 0.5)
    assert summarize([2.0]).median_s == 2.0


@pytest.mark.parametrize("bad", [[], [math.nan], [-1.0], [math.inf]])
def test_summarize_rejects(bad: list[float]) -> None:
    with pytest.raises(ValueError, match="Argument 'times_s'"):
        summarize(bad)


def test_slowest_rank_per_iteration() -> None:
    assert slowest_rank([[1.0, 5.0, 2.0], [3.0, 1.0, 2.5]]) == [3.0, 5.0, 2.5]
    with pytest.raises(ValueError, match="equal lengths"):
        slowest_rank([[1.0], [1.0, 2.0]])


def test_bandwidths() -> None:
    assert bus_factor(4) == 1.5 and bus_factor(2) == 1.0 and bus_factor(1) == 0.0
    assert algbw(16e6, 0.5) == 32e6
    assert busbw(16e6, 0.5, 4) == 48e6
    with pytest.raises(ValueError, match="Argument 'time_s' must be positive, not 0"):
        algbw(1.0, 0.0)


@pytest.mark.parametrize(("n", "c", "ratio"), [(4, 8, 0.8333), (4, 4, 1.0), (4, 12, 0.7778), (8, 16, 0.7857)])
def test_byte_theory_ratio_matches_design(n: int, c: int, ratio: float) -> None:
    assert byte_theory_ratio(n, c) == pytest.approx(ratio, abs=1e-4)


def test_byte_theory_ratio_checks() -> None:
    with pytest.raises(ValueError, match="Argument 'components' must be at least 1, not 0"):
        byte_theory_ratio(4, 0)


def test_methods_theory_bytes() -> None:
    n, size = 4, 16 * MiB
    assert get_method("builtin").theory_bytes_per_rank(size, n, None) == 1.5 * size
    assert get_method("ring").theory_bytes_per_rank(size, n, None) == 1.5 * size
    assert get_method("cerar").theory_bytes_per_rank(size, n, 8) == pytest.approx(1.25 * size)
    assert get_method("cerar").rounds(n, 8) == 10 and get_method("ring").rounds(n, None) == 6
    with pytest.raises(ValueError, match=r"Argument 'methods'.*'nccl'"):
        get_method("nccl")


def test_a_method_is_one_entry() -> None:
    # A 16-bit ring as issue 7 will add it: one AllReduceMethod, and the theory follows.
    fp16 = AllReduceMethod("ring-fp16", "16-bit wire", lambda t, code, stats: None, wire_bytes_per_value=2.0)
    assert fp16.theory_bytes_per_rank(4 * MiB, 4, None) == 3 * MiB
    assert not fp16.coded and fp16.rounds(4, None) == 6
    assert set(ALL_REDUCE_METHODS) >= {"builtin", "ring", "cerar"}


# --------------------------------------------------------------------------------------------
# alpha-beta model


def test_fit_recovers_alpha_beta() -> None:
    alpha, beta, rounds = 2e-4, 1 / 48e6, 6
    sizes = [MiB, 4 * MiB, 16 * MiB, 64 * MiB]
    sent = [1.5 * s for s in sizes]
    times = [rounds * alpha + beta * b for b in sent]
    fit = fit_alpha_beta(sizes, sent, times, rounds)
    assert fit is not None
    assert fit.alpha_s == pytest.approx(alpha, rel=1e-6)
    assert fit.beta_s_per_byte == pytest.approx(beta, rel=1e-9)
    assert fit.bandwidth_bytes_per_s == pytest.approx(48e6)
    assert fit.bytes_per_size == pytest.approx(1.5) and fit.max_rel_residual < 1e-9
    assert fit.predict(8 * MiB) == pytest.approx(rounds * alpha + beta * 12 * MiB)


def test_fit_clamps_negative_latency() -> None:
    sizes = [MiB, 4 * MiB, 16 * MiB]
    sent = [1.5 * s for s in sizes]
    times = [b / 48e6 - 1e-3 for b in sent]  # a negative intercept, as a bandwidth-bound sweep gives
    fit = fit_alpha_beta(sizes, sent, times, 6)
    assert fit is not None and fit.alpha_clamped and fit.alpha_s == 0.0
    assert fit.beta_s_per_byte == pytest.approx(1 / 48e6, rel=0.05)


def test_fit_needs_two_sizes() -> None:
    assert fit_alpha_beta([MiB], [1.5 * MiB], [0.1], 6) is None
    with pytest.raises(ValueError, match="equal lengths"):
        fit_alpha_beta([MiB, 2 * MiB], [1.0], [0.1, 0.2], 6)


def _line(alpha: float, rounds: int, beta: float, k: float) -> AlphaBeta:
    return AlphaBeta(alpha, beta, rounds, k, 3, 0.0)


def test_crossover_cases() -> None:
    base = _line(1e-4, 6, 1 / 50e6, 1.5)
    slower_start_less_bytes = _line(5e-4, 10, 1 / 50e6, 1.25)
    x = crossover(slower_start_less_bytes, base)
    assert x.wins == "above"
    # at the crossover both predictions agree
    assert slower_start_less_bytes.predict(x.size_bytes) == pytest.approx(base.predict(x.size_bytes))
    assert x.predicts_faster(2 * x.size_bytes) and not x.predicts_faster(x.size_bytes / 2)
    assert crossover(_line(1e-5, 10, 1 / 50e6, 1.25), base).wins == "always"
    assert crossover(_line(5e-4, 6, 1 / 40e6, 1.5), base).wins == "never"
    below = crossover(_line(1e-5, 6, 1 / 10e6, 1.5), base)
    assert below.wins == "below" and below.predicts_faster(1.0)


def test_measured_crossover() -> None:
    assert measured_crossover([1, 4, 16], [False, True, True]) == 4
    assert measured_crossover([16, 1, 4], [True, True, False]) == 16
    assert measured_crossover([1, 4], [False, False]) is None
    assert measured_crossover([1, 4], [True, True]) == 1


# --------------------------------------------------------------------------------------------
# records and the document


def _raw(method: str, size: int, times: list[float], c: int | None = None, **extra: Any) -> dict[str, Any]:
    case = {"method": method, "size_bytes": size, "components": c, "construction": "perturbed" if c else None}
    return {
        "case": case,
        "times_s": times,
        "encode_s": extra.get("encode_s", []),
        "decode_s": extra.get("decode_s", []),
        "bytes_sent": extra.get("bytes_sent", []),
        "wire_bytes": extra.get("wire_bytes", []),
        "rel_errors": extra.get("rel_errors", [1e-8, 2e-8]),
    }


def _doc(records: list[dict[str, Any]], link_rate: float | None) -> dict[str, Any]:
    return {
        "machine": {},
        "versions": {},
        "world_size": 4,
        "link_rate_bytes_per_s": link_rate,
        "results": records,
    }


def test_record_schema_and_ratios() -> None:
    size, rate = 16 * MiB, 48e6
    records = [
        make_record(_raw("builtin", size, [0.5, 0.6, 0.55], wire_bytes=[25.2e6]), "slow", 4, rate),
        make_record(
            _raw(
                "cerar",
                size,
                [0.44, 0.46, 0.45],
                8,
                bytes_sent=[20971520] * 3,
                encode_s=[0.01] * 3,
                decode_s=[0.02] * 3,
                rel_errors=[0.0, 2e-4, 1e-4, 0.0],
            ),
            "slow",
            4,
            rate,
        ),
    ]
    add_ratios(records)
    doc = _doc(records, rate)
    validate_document(doc)
    json.loads(json.dumps(doc))  # JSON-ready
    builtin, cerar = records
    assert set(RECORD_KEYS) <= set(cerar)
    assert builtin["time_median_s"] == 0.55 and builtin["time_min_s"] == 0.5 and builtin["time_max_s"] == 0.6
    assert builtin["bytes_source"] == "theory" and builtin["bytes_sent_per_rank"] == 1.5 * size
    assert builtin["busbw_bytes_per_s"] == pytest.approx(builtin["algbw_bytes_per_s"] * 1.5)
    assert builtin["components"] is None and builtin["encode_s"] is None and builtin["wire_bytes_per_rank"] == 25.2e6
    assert cerar["bytes_source"] == "transport" and cerar["bytes_sent_per_rank"] == 20971520
    assert cerar["ratio_to_builtin"] == pytest.approx(0.45 / 0.55)
    assert cerar["theory_ratio_to_builtin"] == pytest.approx(byte_theory_ratio(4, 8))
    assert cerar["wire_limit_s"] == pytest.approx(20971520 / rate)
    assert cerar["worst_rel_error"] == 2e-4 and cerar["components"] == 8
    assert (
        builtin["busbw_bytes_per_s"] / builtin["algbw_bytes_per_s"]
        == cerar["busbw_bytes_per_s"] / cerar["algbw_bytes_per_s"]
    )


def test_fast_record_has_no_wire_figures() -> None:
    record = make_record(_raw("ring", MiB, [0.01], bytes_sent=[1.5 * MiB]), "fast", 4, None)
    assert record["wire_limit_s"] is None and record["wire_bytes_per_rank"] is None


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d.pop("machine"), "key 'machine'"),
        (lambda d: d.update(link_rate_bytes_per_s=-1.0), "link rate"),
        (lambda d: d["results"][0].pop("busbw_bytes_per_s"), "key 'busbw_bytes_per_s'"),
        (lambda d: d["results"][0].update(regime="medium"), "'regime'"),
        (lambda d: d["results"][0].update(time_median_s="fast"), "'time_median_s' must be float"),
        (lambda d: d["results"][0].update(components=4), "'components' must be set exactly"),
    ],
)
def test_validate_document_rejects(mutate: Any, message: str) -> None:
    doc = _doc([make_record(_raw("builtin", MiB, [0.1]), "fast", 4, None)], None)
    validate_document(doc)
    mutate(doc)
    with pytest.raises(ValueError, match=message):
        validate_document(doc)


def test_analyse_fits_and_checks_the_prediction() -> None:
    rate, records = 50e6, []
    for size in (MiB, 4 * MiB, 16 * MiB):
        records.append(make_record(_raw("builtin", size, [6e-4 + 1.5 * size / rate]), "slow", 4, rate))
        t = 10 * 3e-4 + 1.25 * size / rate
        records.append(make_record(_raw("cerar", size, [t], 8, bytes_sent=[1.25 * size]), "slow", 4, rate))
    add_ratios(records)
    fits, crossovers = analyse(records, 4)
    assert {(f["method"], f["components"]) for f in fits} == {("builtin", None), ("cerar", 8)}
    cerar_fit = next(f for f in fits if f["method"] == "cerar")
    assert cerar_fit["alpha_s"] == pytest.approx(3e-4) and cerar_fit["rounds"] == 10
    assert cerar_fit["bandwidth_bytes_per_s"] == pytest.approx(rate)
    (x,) = crossovers
    # 10*3e-4 - 6e-4 = 0.25 size / rate  ->  size = 2.4e-3 * 50e6 / 0.25 = 480 kB
    assert x["predicted_wins"] == "above" and x["predicted_crossover_bytes"] == pytest.approx(480e3)
    assert x["measured_crossover_bytes"] == MiB and x["sizes_agreeing"] == x["sizes_compared"] == 3


# --------------------------------------------------------------------------------------------
# configuration and arguments


@pytest.mark.parametrize(
    ("text", "size"),
    [("1M", MiB), ("64K", 65536), ("1MiB", MiB), ("1048576", MiB), ("0.5M", MiB // 2), ("1G", 1 << 30)],
)
def test_parse_size(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "M", "1T", "big", "1.5B"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="Argument 'sizes'"):
        parse_size(text)


def test_format_size() -> None:
    assert [format_size(s) for s in (MiB, 65536, 64 * MiB, 100, 3 * MiB // 2)] == [
        "1M",
        "64K",
        "64M",
        "100B",
        "1.5M",
    ]


@pytest.mark.parametrize(
    ("changes", "error", "message"),
    [
        ({"world_size": 1}, ValueError, "Argument 'world_size' must be at least 2, not 1"),
        ({"sizes_bytes": (6,)}, ValueError, "multiples of 4"),
        ({"sizes_bytes": ()}, ValueError, "Argument 'sizes'"),
        ({"components": (0,)}, ValueError, "Argument 'components' must be at least 1, not 0"),
        ({"constructions": ("magic",)}, ValueError, "Argument 'construction' must be one of"),
        ({"constructions": ("exact",), "components": (8,)}, ValueError, "must equal world_size"),
        ({"methods": ("ring",)}, ValueError, "baseline 'builtin'"),
        ({"methods": ("builtin", "nccl")}, ValueError, "'nccl'"),
        ({"regimes": ("medium",)}, ValueError, "Argument 'regime'"),
        ({"rate": "fast"}, ValueError, "Argument 'rate'"),
        ({"iters": 0}, ValueError, "Argument 'iters' must be at least 1, not 0"),
        ({"warmup": -1}, ValueError, "Argument 'warmup' must be at least 0, not -1"),
        ({"iters": 2.5}, TypeError, "Argument 'iters' must be an integer, not 2.5"),
        ({"timeout_s": -5.0}, ValueError, "Argument 'timeout_s' must be positive"),
    ],
)
def test_config_checks(changes: dict[str, Any], error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        BenchConfig(**changes)


def test_config_defaults_and_cases() -> None:
    config = BenchConfig(world_size=4, sizes_bytes=(4 * MiB, MiB, MiB))
    assert config.components == (8,) and config.sizes_bytes == (MiB, 4 * MiB)
    cases = build_cases(config)
    assert [c["size_bytes"] for c in cases] == [MiB] * 10 + [4 * MiB] * 10  # sorted by size
    assert [(c["method"], c["components"]) for c in cases[:10]] == [
        ("builtin", None),
        ("ring-fp16", None),
        ("ring-bf16", None),
        ("ring-int8", None),
        ("direct-int8", None),
        ("ring-int4", None),
        ("direct-int4", None),
        ("cerar", 8),
        ("cerar-fp16", 8),
        ("auto", None),
    ]
    assert cases[7]["code"]["world_size"] == 4 and cases[7]["code_params"]["delta"] > 0
    assert cases[9]["max_error"] == config.auto_max_error  # auto's budget travels with its case
    assert all("max_error" not in c for c in cases[:9])  # the others are measured, with no budget
    # the code travels to the ranks as JSON and must come back identical
    assert Code.from_dict(json.loads(json.dumps(cases[7]["code"]))) == make_code(4, 8, "perturbed")


def _args(*argv: str) -> Any:
    return build_parser(only="bench").parse_args(["bench", *argv])


def test_command_line_defaults() -> None:
    config = config_from_args(_args())
    assert config.world_size == 4 and config.regimes == ("fast", "slow") and config.iters == 5
    assert config.sizes_bytes == (MiB, 4 * MiB, 16 * MiB, 64 * MiB) and config.components == (8,)
    quick = config_from_args(_args("--quick", "-N", "3", "--regime", "fast", "-c", "3,6,9"))
    assert quick.iters == 2 and quick.sizes_bytes[-1] <= MiB and quick.regimes == ("fast",)
    assert quick.components == (3, 6, 9)
    # a flag given on the command line wins over --quick's preset
    quick = config_from_args(_args("--quick", "--iters", "3", "--sizes", "4M,64K", "--methods", "builtin,cerar"))
    assert quick.iters == 3 and quick.sizes_bytes == (64 << 10, 4 * MiB) and quick.methods == ("builtin", "cerar")
    # the route table's row names too: exact is the bench's builtin, the name its results keep
    assert config_from_args(_args("--methods", "exact,ring-int8,cerar")).methods == ("builtin", "ring-int8", "cerar")
    # iters from 16 MB up; below, proportionally more, at most 12x
    assert [config.iterations_for(size) for size in (64 * MiB, 16 * MiB, 4 * MiB, 3 * MiB, MiB)] == [5, 5, 20, 27, 60]
    assert [quick.iterations_for(size) for size in (16 * MiB, 4 * MiB, 2 * MiB, 64 << 10)] == [3, 12, 24, 36]
    assert config_from_args(_args("--timeout", "9", "--construction", "vandermonde")).timeout_s == 9.0
    with pytest.raises(ValueError, match="Argument 'components' must be a comma list of integers"):
        config_from_args(_args("-c", "four"))


def test_config_is_frozen_once_checked() -> None:
    config = BenchConfig(world_size=3, components=(6, 3, 6))
    assert config.components == (6, 3)  # repeats dropped, order kept
    with pytest.raises(AttributeError):
        config.iters = 0  # type: ignore[misc]


def test_cli_bad_argument_exits_2() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "cerar", "bench", "--sizes", "1X", "--no-progress"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2 and "Argument 'sizes'" in done.stderr


# --------------------------------------------------------------------------------------------
# smoke runs of the command


def _bench(tmp_path: Path, *argv: str, timeout: float = 300) -> tuple[str, dict[str, Any], int]:
    """Run ``cerar bench`` with ``argv``; return its stdout, its JSON and its pid (which names
    its namespaces)."""
    path = tmp_path / "out.json"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "cerar",
            "bench",
            "--no-progress",
            "--out",
            str(tmp_path / "out"),
            "--json",
            str(path),
            *argv,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err[-3000:]
    return out, json.loads(path.read_text()), proc.pid


@pytest.mark.slow
@pytest.mark.multirank
def test_quick_fast_smoke(tmp_path: Path) -> None:
    out, doc, _ = _bench(tmp_path, "--quick", "-N", "2", "--regime", "fast")
    validate_document(doc)
    assert doc["world_size"] == 2 and doc["link_rate_bytes_per_s"] is None
    assert "fast regime, N = 2" in out and "builtin" in out
    methods = {(r["method"], r["components"]) for r in doc["results"]}
    assert ("builtin", None) in methods
    if ALL_REDUCE_METHODS["cerar"].available():
        assert methods == {
            ("builtin", None),
            ("ring-fp16", None),
            ("ring-bf16", None),
            ("ring-int8", None),
            ("direct-int8", None),
            ("ring-int4", None),
            ("direct-int4", None),
            ("cerar", 4),
            ("cerar-fp16", 4),
            ("auto", None),
        }
    for r in doc["results"]:
        # --quick's 2 iterations, 12x at these small sizes (BenchConfig.iterations_for)
        assert r["regime"] == "fast" and len(r["times_s"]) == r["iters"] == 24 and len(r["rel_errors"]) == 2
        assert r["time_min_s"] <= r["time_median_s"] <= r["time_max_s"]
        # Two ranks decode exactly whatever c is: float32 rounding only, or a 16-bit wire's.
        wire = {"ring-fp16": 2.0**-11, "ring-bf16": 2.0**-8, "ring-int8": 2.0**-7, "ring-int4": 2.0**-3,
                "direct-int8": 2.0**-7, "direct-int4": 2.0**-3, "cerar-fp16": 2.0**-11}  # fmt: skip
        wire = wire.get(r["method"], 2.0**-24)
        assert r["predicted_s"] is not None  # the cost model's, beside the measured time
        if r["method"] == "auto":  # at N = 2: no CERAR candidate (every c decodes exactly, as the ring)
            assert r["auto"]["method"] in ("exact", "fp16", "int8") and r["auto"]["calibration_calls"] > 0
            wire = 2.0**-7 if r["auto"]["method"] == "int8" else 2.0**-11
        assert r["worst_rel_error"] < 4 * wire, (r["method"], r["components"], r["worst_rel_error"])
        lossy = ("ring-fp16", "ring-bf16", "ring-int8", "ring-int4", "direct-int8", "direct-int4")
        if r["method"] in lossy:  # the codec against its limit
            assert r["encode_s"] > 0 and r["decode_s"] > 0 and r["coding_limit_ratio"] > 0, r["method"]
    assert (tmp_path / "out" / "bench.json").exists()
    assert (tmp_path / "out" / "time_vs_size.png").stat().st_size > 0
    assert (tmp_path / "out" / "ratio_vs_theory.png").stat().st_size > 0


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.netns
@needs_netns
def test_quick_slow_smoke_leaves_nothing(tmp_path: Path) -> None:
    out, doc, pid = _bench(
        tmp_path,
        "--quick",
        "-N",
        "3",
        "--regime",
        "slow",
        "--sizes",
        "64K",
        "-c",
        "6",
        "--no-plots",
        "--rate",
        "1gbit",
    )
    validate_document(doc)
    assert doc["link_rate_bytes_per_s"] > 0 and doc["regimes"]["slow"]["rate"] == "1gbit"
    assert all(r["regime"] == "slow" and r["wire_limit_s"] > 0 for r in doc["results"])
    assert all(r["wire_bytes_per_rank"] > 0 for r in doc["results"])
    assert "link 1gbit" in out
    assert netem.leftovers(str(pid)) == {"namespaces": [], "links": [], "processes": []}


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.netns
@needs_netns
def test_slow_bench_with_a_killed_rank_leaves_nothing(tmp_path: Path) -> None:
    bench = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "cerar",
            "bench",
            "--no-progress",
            "--no-plots",
            "-N",
            "3",
            "--regime",
            "slow",
            "--sizes",
            "1M",
            "--iters",
            "500",
            "--methods",
            "builtin",
            "--rate",
            "1gbit",
            "--out",
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        prefix = f"cerar-{bench.pid}-"
        victim, pids = None, []
        end = time.monotonic() + 120
        while victim is None and time.monotonic() < end:
            namespaces = [n for n in netem.leftovers(str(bench.pid))["namespaces"] if n.startswith(prefix)]
            ranks = sorted(n for n in namespaces if not n.endswith("-hub"))
            pids = [p for n in ranks for p in netem.namespace_pids(n)]
            rank1 = [n for n in ranks if n.endswith("-r1")]
            # wait until every rank runs python (past the TCP probe) before killing one
            if len(ranks) == 3 and rank1 and len(pids) >= 3 and all(_is_python(p) for p in pids):
                victim = netem.namespace_pids(rank1[0])[0]
            else:
                time.sleep(0.1)
        assert victim is not None, "bench ranks did not start"
        time.sleep(1.0)  # let the ranks get into the collective
        os.kill(victim, signal.SIGKILL)
        out, err = bench.communicate(timeout=120)
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
    assert bench.returncode == 1, err[-3000:]
    assert "slow regime failed" in err and "rank 1 exited with -9 (SIGKILL)" in err
    assert "FAILED" in out
    assert netem.leftovers(str(bench.pid)) == {"namespaces": [], "links": [], "processes": []}
    end = time.monotonic() + 10
    while time.monotonic() < end and any(alive(p) for p in pids):
        time.sleep(0.05)
    assert not [p for p in pids if alive(p)]


def _is_python(pid: int) -> bool:
    try:
        return "cerar.experiments.bench.worker" in Path(f"/proc/{pid}/cmdline").read_text()
    except OSError:
        return False


@pytest.mark.multirank
def test_slow_unavailable_falls_back_to_fast(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(netem, "unavailable_reason", lambda: "network namespaces need root (test)")
    messages: list[str] = []
    config = BenchConfig(world_size=2, sizes_bytes=(4096,), methods=("builtin",), iters=1, warmup=0)
    doc = run_bench(config, progress=False, log=messages.append)
    assert list(doc["regimes"]) == ["fast"] and doc["link_rate_bytes_per_s"] is None
    assert any("slow regime unavailable: network namespaces need root (test)" in m for m in messages)
    assert doc["notes"] and "running fast only" in doc["notes"][0]
    validate_document(doc)


def test_coding_limit_counts_the_bytes_the_coding_must_move() -> None:
    from cerar.experiments.bench.limit import coding_bytes_per_value, copy_bandwidth
    from cerar.experiments.bench.methods import get_method

    # float32, N = 4, c = 8 (L = 10): encode 4 (1 + 10/8) = 9, decode 4 + 2 x 4 = 12.
    assert coding_bytes_per_value(get_method("cerar"), 4, 8) == 21.0
    assert coding_bytes_per_value(get_method("cerar-fp16"), 4, 8) == 19.0  # 2-byte observations
    # Hierarchical: the ring is over M = 2 nodes (L = c).
    assert coding_bytes_per_value(get_method("hier-cerar"), 4, 8, ranks_per_node=2) == 4 * 2 + 4 + 8
    assert coding_bytes_per_value(get_method("builtin"), 4, None) is None
    assert copy_bandwidth(1 << 20, repeats=2) > 0


def test_coding_limit_script_times_the_compiled_kernels() -> None:
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "coding_limit.py"
    result = subprocess.run(
        [sys.executable, str(script), "--sizes", "0.25", "--repeats", "1"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    from cerar.comm.algorithms import native

    if native.status().startswith("on"):
        kernels = [line for line in result.stdout.splitlines() if line.strip().startswith("0.25 MB:")]
        assert len(kernels) == 1 and all(name in kernels[0] for name in ("encode", "decode fp32", "decode fp16"))
    else:  # no compiler: the script says so instead of timing
        assert "no compiled coding" in result.stdout + result.stderr


def test_bench_records_the_coding_limit_for_coded_cases() -> None:
    from cerar.experiments.bench.schema import make_record

    raw = {
        "case": {"method": "cerar", "size_bytes": 1 << 20, "components": 8, "construction": "perturbed"},
        "times_s": [0.1, 0.1], "encode_s": [0.002, 0.002], "decode_s": [0.003, 0.003],
        "coding_cpu_s": [0.004, 0.002], "handshake_s": [0.001], "bytes_sent": [1.0], "wire_bytes": [],
        "rel_errors": [1e-4] * 4,
        "copy_bandwidth": 1e9,
    }  # fmt: skip
    record = make_record(raw, "fast", 4, None)
    limit = 21 * (1 << 18) / 1e9
    assert record["coding_limit_s"] == pytest.approx(limit)
    assert record["coding_limit_ratio"] == pytest.approx(0.005 / limit)
    assert record["coding_cpu_limit_ratio"] == pytest.approx(0.003 / limit)  # the median of the CPU times
    builtin = make_record({**raw, "case": {"method": "builtin", "size_bytes": 1 << 20}}, "fast", 4, None)
    assert builtin["coding_limit_s"] is None and builtin["coding_limit_ratio"] is None
    assert builtin["coding_cpu_limit_ratio"] is None
