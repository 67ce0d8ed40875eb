"""The target loss of `cerar train` and the rule the report states for it, whatever the exact
baseline's runs are called (``allreduce`` for DDP, ``hsdp-allreduce`` under HSDP)."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest

from cerar.experiments.train import report
from cerar.experiments.train.campaign import target_rule as _target_rule


def _run(name: str, method: str, cap: float, step_s: float, loss: float) -> SimpleNamespace:
    return SimpleNamespace(name=name, method=method, bucket_cap_mb=cap, step_s=step_s, final_val_loss=loss)


@pytest.mark.parametrize("prefix", ["", "hsdp-", "group-"])
def test_the_exact_baseline_sets_the_target_and_its_rule_under_any_name(prefix: str) -> None:
    runs = [
        _run(f"{prefix}allreduce", "allreduce", 1.0, 0.50, 2.20),
        _run(f"{prefix}allreduce", "allreduce", 4.0, 0.40, 2.30),  # the faster bucket: the tuned one
        _run(f"{prefix}int8", "int8", 1.0, 0.30, 2.10),
    ]
    assert report.default_target(runs) == pytest.approx(2.31)  # type: ignore[arg-type]
    assert report.baseline_bucket(runs) == 4.0  # type: ignore[arg-type]
    rule = _target_rule(argparse.Namespace(target_loss=None), report.baseline_bucket(runs), sweep=True)  # type: ignore[arg-type]
    assert rule.startswith("allreduce's mean final loss") and "4 MB" in rule


def test_without_an_exact_run_the_rule_asks_for_a_target() -> None:
    runs = [_run("hsdp-int8", "int8", 1.0, 0.30, 2.10)]
    assert report.default_target(runs) is None  # type: ignore[arg-type]
    assert report.baseline_bucket(runs) is None  # type: ignore[arg-type]
    assert _target_rule(argparse.Namespace(target_loss=None), None, sweep=False).startswith("none")
    assert _target_rule(argparse.Namespace(target_loss=2.0), None, sweep=False) == "given by --target-loss"
