"""Every ``cerar`` command refuses nonsense before it starts work or ranks: exit status 2 and one
stderr line naming the argument (or file), the value and what was expected; never a traceback.

Each row runs :func:`cerar.cli.main` in-process. No row may start ranks: the launcher, the rank
processes and ``cerar plan``'s probe are replaced by a stand-in that fails the test. The machine is
pinned to 2 cores and 16 GiB, so that the limits (8 local ranks, the memory estimates) read the
same on every machine.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cerar.cli import main
from cerar.harness import resources

CORES = 2
MEMORY = 16 << 30
RANKS = resources.RANKS_PER_CORE * CORES
OVER = r"; --allow-oversubscribe (starts more|tries anyway)\), not "

# (command line, a regex the one stderr line, "cerar <command>: error: Argument '...", must hold).
# "{tmp}" is the test's folder, holding the files of _files().
ROWS: list[tuple[str, str]] = [
    # design
    ("design --size 100000000000", rf"Argument 'size' must fit this machine's memory \(.*TiB.*16 GiB{OVER}1000000"),
    ("design -N 3000 --construction exact", rf"Argument 'world_size' must fit this machine's memory .*{OVER}3000\."),
    ("design -N 200", r"Argument 'world_size' must be at most 128 for construction 'perturbed' .*, not 200\."),
    ("design -N 40 --construction optimized", r"Argument 'world_size' must be at most 32 .*, not 40\."),
    ("design -N 0", r"Argument 'world_size' must be at least 2, not 0\."),
    ("design -N 4 -c -1", r"Argument 'components' must be at least 1, not -1\."),
    ("design --size 0", r"Argument 'size' must be at least 1, not 0\."),
    ("design --seed -1", r"Argument 'seed' must be at least 0, not -1\."),
    ("design --delta nan", r"Argument 'delta' must be finite, not nan\."),
    # plan
    ("plan --from {tmp}/missing.json", r"Argument 'from' must be a cerar bench JSON file .*, not '.*missing\.json' "
     r"\(No such file or directory\)\."),
    ("plan --from {tmp}/folder", r"Argument 'from' must be a cerar bench JSON file .*, not the folder '.*folder'\."),
    ("plan --from {tmp}/afile/bench.json", r"Argument 'from' .*, not '.*afile/bench\.json' \('.*afile' is a file\)\."),
    ("plan --from {tmp}/empty.json", r"Argument 'from' must hold a cerar bench JSON with 'results' and 'world_size', "
     r"not one lacking 'results' and 'world_size' in '.*empty\.json'\."),
    ("plan --from {tmp}/no_results.json", r"not one lacking 'results' in '.*no_results\.json'\."),
    ("plan --from {tmp}/no_world_size.json", r"not one lacking 'world_size' in '.*no_world_size\.json'\."),
    ("plan --from {tmp}/list.json", r"Argument 'from' must hold a JSON object .*, not an array in '.*list\.json'\."),
    ("plan --from {tmp}/text.json", r"Argument 'from' must be a cerar bench JSON file .*, not '.*text\.json' "
     r"\(not JSON: Expecting value: .*\)\."),
    ("plan --from {tmp}/garbage.npz", r"Argument 'from' .*, not '.*garbage\.npz' \(not text\)\."),
    ("plan --from {tmp}/one_rank.json", r"Argument 'from' must hold a 'world_size' from 2 to 32 .*, not 1 in "),
    ("plan --from {tmp}/no_time.json", r"Argument 'from' must hold records with .*, not record 0 with bad or missing "
     r"time_median_s in '.*no_time\.json'\."),
    ("plan --from {tmp}/bench.json -N 5000", r"Argument 'world_size' must be at most 128 .*, not 5000\."),
    ("plan --from {tmp}/bench.json --rate 0bit", r"Argument 'rate' must be a tc rate .*, not '0bit'\."),
    ("plan --from {tmp}/bench.json --latency nan", r"Argument 'latency' must be a time per round .*, not 'nan'\."),
    (f"plan --probe-ranks {RANKS + 1}", rf"Argument 'probe_ranks' must be at most {RANKS} local ranks \(4 per core "
     rf"on this machine's {CORES} cores{OVER}{RANKS + 1}\."),
    ("plan --probe-ranks 1", r"Argument 'probe_ranks' must be at least 2, not 1\."),
    ("plan --probe-rate abc", r"Argument 'probe_rate' must be a tc rate .*, not 'abc'\."),
    ("plan --max-error inf", r"Argument 'max_error' must be finite, not inf\."),
    ("plan --margin 1", r"Argument 'margin' must be in \[0, 1\), not 1\.0\."),
    # bench
    ("bench --sizes 100G", rf"Argument 'sizes' must fit this machine's memory \(4 ranks at 100G .*{OVER}100G\."),
    ("bench --sizes abc", r"Argument 'sizes' must be sizes such as 64K, 1M, 16M or 1048576, not 'abc'\."),
    ("bench --sizes 0", r"Argument 'sizes' must be at least 4, not 0\."),
    ("bench -N 200", rf"Argument 'world_size' must be at most {RANKS} local ranks .*{OVER}200\."),
    ("bench --nodes 100 --ranks-per-node 100", rf"Argument 'world_size' must be at most {RANKS} .*{OVER}10000\."),
    ("bench -N 1", r"Argument 'world_size' must be at least 2, not 1\."),
    ("bench -c 0", r"Argument 'components' must be at least 1, not 0\."),
    ("bench --iters 0", r"Argument 'iters' must be at least 1, not 0\."),
    ("bench --timeout=-1", r"Argument 'timeout_s' must be positive, not -1\.0\."),
    ("bench --rate abc", r"Argument 'rate' must be a tc rate such as '400mbit' or '1gbit', not 'abc'\."),
    ("bench --rate 0mbit", r"Argument 'rate' must be a tc rate .*, not '0mbit'\."),
    ("bench --methods nope", r"Argument 'methods' must name methods among .*, not 'nope'\."),
    ("bench --methods exact,ring-int8,nope", r"Argument 'methods' must name methods among exact \(= builtin\), "
     r".*ring-int8, .*, not 'nope'\."),
    ("bench --out {tmp}/afile/x", r"Argument 'out' must be a folder this process can write, not '.*afile/x' "
     r"\('.*afile' is a file\)\."),
    ("bench --out {tmp}/out --json {tmp}/afile/x.json", r"Argument 'json' must be a file this process can write, "
     r"not '.*afile/x\.json' \('.*afile' is a file\)\."),
    ("bench --out {tmp}/out --json {tmp}/folder", r"Argument 'json' .*, not the folder '.*folder'\."),
    # train
    ("train -N 5000", rf"Argument 'world_size' must be at most {RANKS} local ranks .*{OVER}5000\."),
    ("train --nodes 5 --ranks-per-node 2", rf"Argument 'world_size' must be at most {RANKS} .*{OVER}10\."),
    ("train -N 1", r"Argument 'world_size' must be at least 2, not 1\."),
    ("train --timeout-s=-1", r"Argument 'timeout_s' must be positive, not -1\.0\."),
    ("train --timeout-s nan", r"Argument 'timeout_s' must be finite, not nan\."),
    ("train --regime slow --rate abc", r"Argument 'rate' must be a tc rate .*, not 'abc'\."),
    ("train --delay abc", r"Argument 'delay' must be a time such as '0ms' or '500us', not 'abc'\."),
    ("train --target-loss nan", r"Argument 'target_loss' must be finite, not nan\."),
    ("train --hidden 100000", rf"Argument 'hidden' must fit this machine's memory .*{OVER}100000\."),
    ("train --seq-len 100000000", rf"Argument 'seq_len' must fit this machine's memory .*{OVER}100000000\."),
    ("train --batch-size 100000", rf"Argument 'batch_size' must fit this machine's memory .*{OVER}100000\."),
    ("train --out {tmp}/afile/x", r"Argument 'out' must be a folder this process can write, not '.*afile/x' "
     r"\('.*afile' is a file\)\."),
    ("train --steps 0", r"Argument 'steps' must be at least 1, not 0\."),
    ("train --noise-seeds 0", r"Argument 'noise_seeds' must be at least 1, not 0\."),
    ("train --methods bogus", r"Argument 'method' must be one of .*, not 'bogus'\."),
    ("train --methods exact cerar:8 nccl", r"Argument 'method' must be one of exact \(= allreduce\), .*ring-int8 "
     r"\(= int8\), .*powersgd, or a schedule or process group around one, 'accum', .*'hsdp', not 'nccl'\."),
    ("train --methods ring-fp16", r"Argument 'method' must be one of .*, not 'ring-fp16' \(under group:/hsdp: only\)"),
    ("train --methods group:torch-fp16", r"Argument 'method' of group and hsdp must be one of exact \(= allreduce\), "
     r"ring, ring-fp16 \(= fp16\), .*, not 'torch-fp16' \(not under group:/hsdp:\)\."),
    ("train --methods cerar-fp16:8:bf16", r"Argument 'method' must look like 'cerar-fp16:8' or 'cerar-fp16:3N' .*, "
     r"not 'cerar-fp16:8:bf16'\."),
    ("train --methods exact allreduce", r"Argument 'methods' must not repeat a run, not \['allreduce-s0', "),
    ("train --bucket-cap-mb abc", r"Argument 'bucket_cap_mb' must be a size in MB .*, not 'abc'\."),
    # train: schedules whose averaging would never happen within --steps
    ("train --methods localsgd:4 --steps 10", r"Argument 'steps' must exceed warmup_steps=20 for localsgd .*, not 10"),
    ("train --methods localsgd:4 --steps 5 --warmup-steps 5", r"must exceed warmup_steps=5 for localsgd .*, not 5\."),
    ("train --methods allreduce diloco:50 --steps 10", r"Argument 'steps' must be at least diloco's H=50 .*, not 10\."),
    # study
    ("study -N 100000", r"Argument 'world_sizes' must hold integers of at most 16 .*, not 100000\."),
    ("study -N 4 17", r"Argument 'world_sizes' must hold integers of at most 16 .*, not 17\."),
    ("study -N 2", r"Argument 'world_sizes' must hold integers of at least 3, not 2\."),
    ("study --size 0", r"Argument 'size' must be at least 1, not 0\."),
    ("study --size 100000000", rf"Argument 'size' must fit this machine's memory .*{OVER}100000000\."),
    ("study --seed -1", r"Argument 'seed' must be at least 0, not -1\."),
    ("study --out {tmp}/afile/x", r"Argument 'out' must be a folder this process can write, not '.*afile/x' "
     r"\('.*afile' is a file\)\."),
    ("study --gradients --capture {tmp}/empty.npz", r"Argument 'capture' is not a gradient capture: '.*empty\.npz' "
     r"is not an \.npz archive"),
    ("study --gradients --capture {tmp}/garbage.npz", r"Argument 'capture' is not a gradient capture: "
     r"'.*garbage\.npz' is not an \.npz archive"),
    ("study --gradients --capture {tmp}/missing.npz", r"Argument 'capture' must name an existing capture file, "
     r"not '.*missing\.npz'\."),
    ("study --gradients --capture {tmp}/folder", r"Argument 'capture' .*, not the folder '.*folder'\."),
    ("study --gradients --capture {tmp}/other.npz", r"Argument 'capture' is not a gradient capture \('.*other\.npz' "
     r"lacks \['config', 'gradients', 'losses', 'steps'\]\)\."),
    ("study --gradients --capture {tmp}/flat.npz", r"Argument 'capture' holds gradients of shape \(3,\) and 1 steps, "
     r"not \(P, N >= 2, d\) with P steps \('.*flat\.npz'\)\."),
    ("study --gradients --world-size 5000", rf"Argument 'world_size' must be at most {RANKS} .*{OVER}5000\."),
    ("study --gradients --world-size 2", r"Argument 'world_size' must be at least 3, not 2\."),
    ("study --gradients --batch-size 1000000", rf"Argument 'batch_size' must fit this machine's memory .*{OVER}10"),
    ("study --gradients --steps 0", r"Argument 'steps' must be at least 1, not 0\."),
    ("study --gradients --steps 10 --capture-steps 500", r"Argument 'capture_steps' must hold steps of at most "
     r"steps=10, not 500\."),
    ("study --gradients --out {tmp}/afile/x", r"Argument 'out' must be a folder this process can write"),
]  # fmt: skip

#: Rows argparse itself refuses (exit 2, its usage, then this last line).
ARGPARSE_ROWS: list[tuple[str, str]] = [
    ("design --size 1e11", r"argument --size: invalid int value: '1e11'"),
    ("design -N abc", r"argument --world-size/-N: invalid int value: 'abc'"),
    ("bench -N nan", r"argument --world-size/-N: invalid int value: 'nan'"),
    ("train --steps 1.5", r"argument --steps: invalid int value: '1\.5'"),
    ("study -N four", r"argument --world-sizes/-N: invalid int value: 'four'"),
    ("plan --margin abc", r"argument --margin: invalid float value: 'abc'"),
]


class Started(BaseException):
    """Raised by the stand-ins for whatever would start ranks (not an Exception: no command
    may catch it)."""


def _start(*args: Any, **kwargs: Any) -> None:
    raise Started("a row started ranks")


@pytest.fixture(autouse=True)
def machine(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The pinned machine, no ranks, and the test's folder as the working directory (outputs
    that a row's command line does not place land there)."""
    import cerar.experiments.bench.run as bench_run
    import cerar.experiments.plan as planning
    import cerar.harness.forked as forked
    import cerar.harness.launch as launching
    import cerar.harness.processes as processes

    monkeypatch.setattr(resources, "cores", lambda: CORES)
    monkeypatch.setattr(resources, "memory_bytes", lambda: MEMORY)
    monkeypatch.setattr(launching, "launch", _start)
    monkeypatch.setattr(bench_run, "launch", _start)
    monkeypatch.setattr(processes.RankProcesses, "start", _start)
    monkeypatch.setattr(forked.Zygote, "__init__", _start)  # the process that forks training ranks
    monkeypatch.setattr(planning, "probe", _start)
    monkeypatch.chdir(tmp_path)


def _files(tmp: Path) -> None:
    """The input files the rows name."""
    (tmp / "folder").mkdir()
    (tmp / "afile").write_text("a file, not a folder")
    (tmp / "empty.json").write_text("{}")
    (tmp / "no_results.json").write_text(json.dumps({"world_size": 4}))
    (tmp / "no_world_size.json").write_text(json.dumps({"results": []}))
    (tmp / "list.json").write_text("[1, 2]")
    (tmp / "text.json").write_text("not json")
    (tmp / "garbage.npz").write_bytes(b"\x93NUMPY\xff\xfe garbage")
    (tmp / "empty.npz").write_bytes(b"")
    record = {"method": "builtin", "components": None, "size_bytes": 1 << 20, "regime": "fast", "time_median_s": 0.01}
    (tmp / "one_rank.json").write_text(json.dumps({"world_size": 1, "results": [record]}))
    (tmp / "no_time.json").write_text(json.dumps({"world_size": 4, "results": [{**record, "time_median_s": None}]}))
    records = [
        {**record, "method": method, "components": components, "size_bytes": size, "time_median_s": size * rate}
        for method, components, rate in (("builtin", None, 1e-8), ("ring-fp16", None, 6e-9), ("cerar", 8, 9e-9))
        for size in (1 << 20, 4 << 20, 16 << 20)
    ]
    (tmp / "bench.json").write_text(json.dumps({"world_size": 4, "results": records}))
    np.savez(tmp / "other.npz", x=np.zeros(3))
    np.savez(tmp / "flat.npz", gradients=np.zeros(3), steps=np.array([0]), losses=np.zeros((1, 2)),
             config=np.array("{}"))  # fmt: skip


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int | str, str, str, float]:
    started = time.perf_counter()
    try:
        status: int | str = main(argv)
    except SystemExit as exc:
        status = f"SystemExit({exc.code})"
    captured = capsys.readouterr()
    return status, captured.out, captured.err, time.perf_counter() - started


@pytest.mark.parametrize(("line", "expected"), ROWS, ids=[row[0] for row in ROWS])
def test_a_bad_input_is_one_line_and_status_2(
    line: str, expected: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    if line.startswith("study"):  # its extra comes first: without it, that is the one line
        pytest.importorskip("matplotlib")
    if line.startswith("study --gradients") and "--capture" not in line:
        pytest.importorskip("transformers")
    _files(tmp_path)
    argv = line.format(tmp=tmp_path).split()
    status, out, err, seconds = _run(argv, capsys)
    assert (status, out) == (2, ""), err
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert err.startswith(f"cerar {argv[0]}: error: Argument '") and re.search(expected, err), err
    assert seconds < 10, f"a refusal took {seconds:.1f} s"


@pytest.mark.parametrize(("line", "expected"), ARGPARSE_ROWS, ids=[row[0] for row in ARGPARSE_ROWS])
def test_argparse_refusals_exit_2(line: str, expected: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = line.split()
    status, out, err, _ = _run(argv, capsys)
    assert (status, out) == ("SystemExit(2)", "")
    assert "Traceback" not in err and re.fullmatch(rf"cerar {argv[0]}: error: {expected}", err.splitlines()[-1]), err


def test_every_command_has_rows() -> None:
    from cerar.cli import COMMANDS

    assert {row[0].split()[0] for row in ROWS} == set(COMMANDS)


def test_the_override_flag_lifts_the_memory_limit(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(resources, "memory_bytes", lambda: 64 << 10)  # 64 KiB: 4 ranks x 800 values do not fit
    argv = ["design", "-N", "4", "-c", "8", "--delta", "0.01", "--size", "800"]
    status, _, err, _ = _run(argv, capsys)
    assert status == 2 and "Argument 'size' must fit this machine's memory" in err and "64 KiB" in err
    status, out, err, _ = _run([*argv, "--allow-oversubscribe"], capsys)
    assert (status, err) == (0, "") and "worst-rank error" in out


def test_the_override_flag_lifts_the_rank_limit(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--probe-ranks", str(RANKS + 1)]
    status, _, err, _ = _run(argv, capsys)
    assert status == 2 and "--allow-oversubscribe" in err
    with pytest.raises(Started):  # past the checks, up to the probe (stubbed)
        main([*argv, "--allow-oversubscribe"])


def test_the_limits_come_from_the_machine(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.undo()  # the real machine
    assert resources.cores() >= 1 and resources.max_ranks() == resources.RANKS_PER_CORE * resources.cores()
    memory = resources.memory_bytes()
    assert memory is None or memory > 1 << 28
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24731408 kB\nMemFree:        1 kB\n")
    monkeypatch.setattr(resources, "_MEMINFO", str(meminfo))
    assert resources.memory_bytes() == 24731408 * 1024
    assert resources.format_bytes(24731408 * 1024) == "23.6 GiB" and resources.format_bytes(512) == "512 B"


def test_schedules_that_average_within_the_steps_are_accepted() -> None:
    from cerar.experiments.train.config import TrainConfig, parse_method

    for spec, steps in (("localsgd:4", 21), ("diloco:50", 50)):
        method, overrides = parse_method(spec, 4)
        assert TrainConfig(method=method, steps=steps, warmup_steps=20, **overrides).steps == steps


# ---------------------------------------------------------------------------------------------
# One method vocabulary: the route table's rows, the commands' own names as their aliases


def _train_runs(*argv: str) -> list[Any]:
    from cerar.cli import build_parser
    from cerar.cli.train import plan_runs

    return plan_runs(build_parser(only="train").parse_args(["train", "-N", "4", *argv]))


@pytest.mark.parametrize(
    ("row", "alias"),
    [
        ("exact", "allreduce"), ("torch-fp16", "fp16"), ("torch-bf16", "bf16"), ("ring-int8", "int8"),
        ("ring-fp8", "fp8"), ("ring", "ring"), ("cerar-fp16", "cerar:2N:fp16"), ("cerar-fp16:8", "cerar:8:fp16"),
        ("cerar-bf16:3N", "cerar:3N:bf16"), ("auto:1e-3", "auto:1e-3"), ("group:ring-fp16", "group:fp16"),
        ("group:ring-int8", "group:int8"), ("hsdp:ring-int8", "hsdp:int8"), ("hsdp:exact", "hsdp:allreduce"),
        ("group:cerar-fp16:8", "group:cerar:8:fp16"), ("diloco:10:ring-int8", "diloco:10:int8"),
        ("localsgd:10:torch-fp16", "localsgd:10:fp16"), ("accum:2:exact", "accum:2"),
        ("diloco:10:lr0.5:cerar-fp16:8", "diloco:10:lr0.5:cerar:8:fp16"),
    ],
)  # fmt: skip
def test_train_takes_the_rows_and_their_aliases_alike(row: str, alias: str) -> None:
    by_row, by_alias = _train_runs("--methods", row), _train_runs("--methods", alias)
    assert by_row == by_alias  # the same runs: configs, labels and seeds (exact's noise seeds too)
    assert [c.label for c in by_row] == [c.label for c in by_alias]


def test_train_alias_table_names_rows_of_the_route_table() -> None:
    from cerar.comm.collective.routes import ROUTES
    from cerar.experiments.train.installed import ROWS
    from cerar.experiments.train.methods import HOOKS, ROW_NAMES

    assert set(ROW_NAMES) <= set(ROUTES), sorted(set(ROW_NAMES) - set(ROUTES))
    for row, (hooked, grouped) in ROW_NAMES.items():
        for meaning in (hooked, grouped):
            if meaning is not None:
                assert meaning.partition(":")[0] in HOOKS, (row, meaning)
        if hooked is not None and hooked in ROWS:  # the row a hook or a schedule's average runs
            assert ROWS[hooked] == row, (row, hooked)


def test_train_defaults_include_the_int8_ring_and_the_4_bit_direct_shape() -> None:
    from cerar.experiments.train.campaign import DEFAULT_METHODS

    assert "ring-int8" in DEFAULT_METHODS and "direct-int4" in DEFAULT_METHODS
    labels = [c.label for c in _train_runs()]
    assert labels == ["allreduce-s0", "allreduce-s1", "cerar-c8-s0", "cerar-c12-s0", "fp16-s0", "int8-s0",
                      "direct-int4-s0", "powersgd-r4-s0"]  # fmt: skip
    assert labels == [c.label for c in _train_runs("--methods", "allreduce", "cerar:2N", "cerar:3N", "fp16", "int8",
                                                   "direct-int4", "powersgd")]  # fmt: skip


def test_bench_takes_the_rows_and_their_aliases_alike() -> None:
    from cerar.experiments.bench.config import DEFAULT_METHODS, BenchConfig

    assert "ring-int8" in DEFAULT_METHODS
    by_row = BenchConfig(methods=("exact", "ring-int8", "cerar-fp16"))
    assert by_row == BenchConfig(methods=("builtin", "ring-int8", "cerar-fp16"))
    assert by_row.methods == ("builtin", "ring-int8", "cerar-fp16")  # the results keep the bench's names
    assert BenchConfig(methods=("exact", "builtin", "ring")).methods == ("builtin", "ring")
    assert BenchConfig(methods=("exact", *DEFAULT_METHODS[1:])).methods == DEFAULT_METHODS


@pytest.mark.parametrize(
    ("command", "listed"),
    [
        ("train", ["exact (= allreduce)", "torch-fp16 (= fp16)", "ring-int8 (= int8)", "ring-fp8 (= fp8)",
                   "cerar-fp16 (= cerar:2N:fp16)", "ring-fp16 (= fp16)", "powersgd", "'ring-int8'"]),
        ("bench", ["exact (= builtin)", "ring-int8", "cerar-fp16", "auto"]),
    ],
)  # fmt: skip
def test_help_lists_the_names_and_their_aliases(
    command: str, listed: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("COLUMNS", "100000")  # one line per option: the names unbroken
    status, out, _, _ = _run([command, "--help"], capsys)
    assert status == "SystemExit(0)"
    lines = out.splitlines()
    first = next(i for i, line in enumerate(lines) if line.lstrip().startswith("--methods"))
    end = next(i for i in range(first + 1, len(lines)) if lines[i].startswith("  -"))  # the next option
    methods = " ".join(lines[first:end])
    for name in listed:
        assert name in methods, (name, methods)
