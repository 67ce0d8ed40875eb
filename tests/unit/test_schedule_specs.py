"""The schedules' specs (``accum:K``, ``localsgd:H``, ``diloco:H`` around a method): every
composition parses into a valid config with its label and family, bad ones raise naming the
argument and the value, and the tuning table picks each family's best tried setting."""

from __future__ import annotations

import dataclasses
import re

import pytest

from cerar.experiments.train.config import TrainConfig, parse_method
from cerar.experiments.train.methods import HOOKS
from cerar.experiments.train.report import RunSummary
from cerar.experiments.train.schedules import AVERAGING_METHODS, SCHEDULES, inner_spec
from cerar.experiments.train.tuning import family_rows, format_families

#: A spec of every method (with its parameter where it takes one).
METHOD_SPECS = {
    "allreduce": "allreduce", "ring": "ring", "cerar": "cerar:8:fp16", "hier-ring": "hier-ring",
    "hier-cerar": "hier-cerar:2N", "fp16": "fp16", "bf16": "bf16", "powersgd": "powersgd:2", "auto": "auto:1e-3",
    "int8": "int8", "fp8": "fp8", "int4": "int4", "int3": "int3", "int2": "int2",
    **{f"direct-{w}": f"direct-{w}" for w in ("int8", "int4", "int3", "int2")},
}  # fmt: skip


def _config(spec: str, world_size: int = 4, **settings: object) -> TrainConfig:
    method, overrides = parse_method(spec, world_size)
    return TrainConfig(method=method, **settings, **overrides)  # type: ignore[arg-type]


def test_every_composition_parses() -> None:
    assert set(METHOD_SPECS) == set(HOOKS)
    for name in HOOKS:
        config = _config(f"accum:4:{METHOD_SPECS[name]}")
        assert (config.method, config.schedule, config.period) == (name, "accum", 4)
        plain = _config(METHOD_SPECS[name])
        assert config.name == f"accum-k4-{plain.name}" if name != "allreduce" else config.name == "accum-k4"
        assert config.family == (f"accum-{plain.name}" if name != "allreduce" else "accum")
    for schedule in ("localsgd", "diloco"):
        for name in AVERAGING_METHODS:
            config = _config(f"{schedule}:10:{METHOD_SPECS[name]}")
            assert (config.method, config.schedule, config.period) == (name, schedule, 10)
            assert TrainConfig.from_json(config.to_json()) == config
    # The defaults: allreduce underneath, DiLoCo's outer SGD.
    assert parse_method("accum:4", 4) == ("allreduce", {"schedule": "accum", "period": 4})
    assert parse_method("diloco:10:cerar:8:fp16", 4) == (
        "cerar", {"components": 8, "packet": "fp16", "schedule": "diloco", "period": 10},
    )  # fmt: skip
    assert parse_method("diloco:25:lr0.5:cerar:2N", 4)[1] == {
        "components": 8, "schedule": "diloco", "period": 25, "outer_lr": 0.5,
    }  # fmt: skip
    diloco = _config("diloco:10")
    assert (diloco.outer_lr, diloco.outer_momentum) == (0.7, 0.9)
    assert diloco.setting == "H=10, outer lr 0.7, momentum 0.9" and _config("accum:2").setting == "K=2"
    # Labels say the setting; families leave it out.
    assert _config("diloco:10:cerar:8:fp16").label == "diloco-h10-cerar-c8-fp16-s0"
    assert _config("diloco:25:lr0.5:cerar:8:fp16").name == "diloco-h25-lr0.5-cerar-c8-fp16"
    assert _config("diloco:10", outer_momentum=0.8).name == "diloco-h10-m0.8"
    assert _config("diloco:25:lr0.5:cerar:8:fp16").family == _config("diloco:10:cerar:8:fp16").family
    assert _config("localsgd:10:fp16").family == "localsgd-fp16" != _config("localsgd:10").family
    assert _config("cerar:8").family == "cerar-c8" and _config("cerar:8").setting == "-"
    assert inner_spec("diloco:10:lr0.5:cerar:8") == "cerar:8" and inner_spec("accum:4") == "allreduce"
    assert inner_spec("cerar:8") == "cerar:8"


def test_a_hierarchical_method_under_accum_counts_its_nodes() -> None:
    from cerar.cli import build_parser
    from cerar.cli.train import plan_runs

    args = build_parser(only="train").parse_args(
        ["train", "--nodes", "2", "--ranks-per-node", "2", "--methods", "accum:2:hier-cerar:2N", "--noise-seeds", "1"]
    )
    (config,) = plan_runs(args)
    assert (config.method, config.components, config.schedule) == ("hier-cerar", 4, "accum")  # 2M, M = 2 nodes


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("accum", "Argument 'method' must give accum's K as a whole number of at least 1, like 'accum:4'"),
        ("accum:0", "must give accum's K as a whole number of at least 1"),
        ("localsgd:1.5", "must give localsgd's H as a whole number of at least 1, like 'localsgd:4'"),
        ("diloco:x", "must give diloco's H as a whole number"),
        ("diloco:10:lrx", "must give diloco's outer learning rate as a positive number, like 'diloco:10:lr0.5', "
         "not 'diloco:10:lrx'."),
        ("diloco:10:lr-1", "must give diloco's outer learning rate as a positive number"),
        ("diloco:10:lrnan", "must give diloco's outer learning rate as a positive number"),
        ("diloco:10:powersgd", "Argument 'method' of diloco must average through one of allreduce, fp16, bf16, ring, "
         "cerar, int8, fp8, int4, int3, int2, direct-int8, direct-int4, direct-int3, direct-int2, not 'powersgd' "
         "(in 'diloco:10:powersgd')."),
        ("localsgd:5:hier-ring", "Argument 'method' of localsgd must average through one of"),
        ("accum:4:accum:2", "Argument 'method' must not nest schedules, not 'accum:4:accum:2'."),
        ("accum:4:cerar:x", "Argument 'method' must look like 'cerar:8', 'cerar:3N' or 'powersgd:2', not 'cerar:x' "
         "(in 'accum:4:cerar:x')."),
        ("diloco:3:cerar:8:fp8", "takes a packet precision only as 'cerar:8:fp16' or 'cerar:2N:bf16'"),
        ("diloco:3:nccl", "Argument 'method' must be one of"),
        ("sgd:3", "'accum', 'localsgd', 'diloco', 'group', 'hsdp', not 'sgd'."),
    ],
)  # fmt: skip
def test_bad_specs_name_the_spec(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_method(spec, 4)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"method": "allreduce", "schedule": "accum", "period": 3, "batch_size": 8},
         "Argument 'batch_size' must be divisible by accum's K=3 (micro-batches of batch_size / K sequences), not 8."),
        ({"method": "allreduce", "period": 3}, "Argument 'period' applies to a schedule (accum, localsgd, diloco) "
         "only, not 3."),
        ({"method": "allreduce", "schedule": "diloco", "period": 0}, "Argument 'period' must be at least 1, not 0."),
        ({"method": "powersgd", "schedule": "diloco", "period": 2}, "Argument 'method' of diloco must average "
         "through one of allreduce, fp16, bf16, ring, cerar, int8, fp8, int4, int3, int2, direct-int8, direct-int4, "
         "direct-int3, direct-int2, not 'powersgd'."),
        ({"method": "cerar", "schedule": "localsgd", "period": 2, "resync_every": 5}, "Argument 'resync_every' "
         "applies to the DDP hooks, not to localsgd's averaging (give divergence_tol instead), not 5."),
        ({"method": "allreduce", "schedule": "swap", "period": 2}, "Argument 'schedule' must be one of 'accum', "
         "'localsgd', 'diloco', not 'swap'."),
        ({"outer_lr": 0.0}, "Argument 'outer_lr' must be positive, not 0.0."),
        ({"outer_momentum": 1.0}, "Argument 'outer_momentum' must be less than 1, not 1.0."),
        ({"outer_momentum": -0.1}, "Argument 'outer_momentum' must be non-negative, not -0.1."),
    ],
)  # fmt: skip
def test_bad_schedule_settings_name_the_argument(settings: dict, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        TrainConfig(**settings)


def test_the_batch_must_divide_into_micro_batches_from_the_command_line() -> None:
    from cerar.cli import build_parser
    from cerar.cli.train import plan_runs

    args = build_parser(only="train").parse_args(["train", "-N", "4", "--methods", "accum:3", "--batch-size", "8"])
    with pytest.raises(ValueError, match=re.escape("Argument 'batch_size' must be divisible by accum's K=3")):
        plan_runs(args)
    args = build_parser(only="train").parse_args(["train", "-N", "4", "--methods", "diloco:10", "diloco:25",
                                                  "diloco:25:lr0.5", "--outer-lr", "0.6"])  # fmt: skip
    assert [c.label for c in plan_runs(args)] == ["diloco-h10-lr0.6-s0", "diloco-h25-lr0.6-s0", "diloco-h25-lr0.5-s0"]
    assert SCHEDULES == ("accum", "localsgd", "diloco")


# ---------------------------------------------------------------------------------------------
# The tuning table


def _summary(config: TrainConfig, final: float, time_to_target: float | None, **figures: object) -> RunSummary:
    values: dict[str, object] = {f.name: 0 for f in dataclasses.fields(RunSummary)}
    values.update(
        label=config.label, method=config.schedule or config.method, name=config.name, bucket_cap_mb=1.0,
        seed=config.seed, description="", final_val_loss=final, time_to_target_s=time_to_target,
        divergence_where="", load_average=None, exact_final_divergence=None, post_sync_divergence=None,
        family=config.family, setting=config.setting, tokens=1000, step_s=0.5, bytes_per_step=1e6,
    )  # fmt: skip
    values.update(figures)
    return RunSummary(**values)  # type: ignore[arg-type]


def test_the_family_table_shows_the_best_tried_setting_and_the_budget() -> None:
    summaries = [
        _summary(_config("allreduce"), 2.30, 50.0),
        _summary(_config("allreduce", seed=1), 2.31, 60.0),
        _summary(_config("diloco:10"), 2.29, 40.0, post_sync_divergence=0.0),
        _summary(_config("diloco:25"), 2.28, 30.0, post_sync_divergence=0.0),  # the soonest: the best
        _summary(_config("diloco:25:lr0.5"), 2.27, None),  # lower loss, but not at the target
        _summary(_config("localsgd:10"), 2.40, None),
        _summary(_config("localsgd:25"), 2.35, None),  # none reaches it: the lowest loss
        _summary(_config("diloco:10:cerar:8:fp16"), 2.29, 35.0, post_sync_divergence=3e-3),
    ]
    rows = {row["family"]: row for row in family_rows(summaries)}
    assert list(rows) == ["allreduce", "diloco", "localsgd", "diloco-cerar-c8-fp16"]
    assert rows["allreduce"]["tried"] == 1 and rows["allreduce"]["time_to_target_s"] == 55.0  # two seeds, one setting
    assert rows["allreduce"]["best_labels"] == ["allreduce-s0", "allreduce-s1"]
    diloco = rows["diloco"]
    assert (diloco["tried"], diloco["best"], diloco["time_to_target_s"]) == (3, "diloco-h25", 30.0)
    assert rows["diloco"]["settings"] == ["diloco-h10", "diloco-h25", "diloco-h25-lr0.5"]
    assert (rows["localsgd"]["best"], rows["localsgd"]["reached"]) == ("localsgd-h25", False)
    assert rows["diloco-cerar-c8-fp16"]["post_sync_divergence"] == 3e-3
    text = format_families(list(rows.values()), 2.32)
    assert "| diloco | 3 | diloco-h25 (H=25, outer lr 0.7, momentum 0.9) | 30.0 | 2.2800 |" in text
    assert "| localsgd | 2 | localsgd-h25 (H=25) | not reached | 2.3500 |" in text
    assert text.endswith(
        "settings tried (each a full run): diloco: diloco-h10, diloco-h25, diloco-h25-lr0.5; localsgd: localsgd-h10, "
        "localsgd-h25"
    )
