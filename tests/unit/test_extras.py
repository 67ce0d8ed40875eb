"""The experiments' optional dependencies: a missing one gives one line naming its extra, and
the commands check before they work; ``cerar bench`` without plots needs no matplotlib."""

from __future__ import annotations

import subprocess
import sys

import pytest

from cerar.cli import main
from cerar.experiments._extras import MissingExtraError, pyplot, require


def test_require_returns_the_module() -> None:
    assert require("json", "bench") is sys.modules["json"]


def test_require_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if not installed
    with pytest.raises(MissingExtraError, match=r"^cerar train needs transformers: pip install 'cerar\[train\]'$"):
        require("transformers", "train")
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"^cerar study needs matplotlib: pip install 'cerar\[bench\]'$"):
        pyplot("bench", needed_by="cerar study")


def test_bench_checks_its_extras_before_measuring(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import cerar.cli.bench

    def no_run(*args: object, **kwargs: object) -> None:
        raise AssertionError("cerar bench measured without its extras")

    monkeypatch.setattr(cerar.cli.bench, "run_bench", no_run)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["bench", "--quick", "--regime", "fast", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "cerar bench: error: cerar bench's plots (or --no-plots) needs matplotlib" in err
    assert "pip install 'cerar[bench]'" in err


def test_train_checks_its_extras_before_launching(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import cerar.experiments.train.campaign

    def no_run(*args: object, **kwargs: object) -> None:
        raise AssertionError("cerar train launched without its extras")

    monkeypatch.setattr(cerar.experiments.train.campaign, "run_all", no_run)
    monkeypatch.setitem(sys.modules, "transformers", None)
    assert main(["train", "-N", "2", "--regime", "fast"]) == 2
    assert "cerar train needs transformers: pip install 'cerar[train]'" in capsys.readouterr().err


def test_bench_without_plots_imports_no_matplotlib() -> None:
    code = (
        "import sys; sys.modules['matplotlib'] = None; sys.modules['tqdm'] = None\n"
        "import cerar.cli.bench, cerar.experiments.bench.report as report\n"
        "print(report.format_table({'world_size': 2, 'results': [], 'regimes': {'fast': {}}}))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert "fast regime, N = 2" in done.stdout
