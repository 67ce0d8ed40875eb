"""The communication-avoiding schedules' names in ``--methods``, their checks and their labels.

A schedule wraps one of the training methods of :data:`~cerar.experiments.train.methods.HOOKS`
(the *method underneath*, ``allreduce`` when the spec leaves it out):

* ``accum:K[:<method>]``: gradient accumulation over ``K`` micro-batches;
* ``localsgd:H[:<method>]``: local SGD, the parameters averaged every ``H`` steps after the
  learning-rate warm-up (so ``steps`` must exceed ``warmup_steps``);
* ``diloco:H[:lrX][:<method>]``: DiLoCo, an outer Nesterov step on the averaged pseudo-gradient
  every ``H`` inner steps (``lrX``: this run's outer learning rate, else ``--outer-lr``; ``steps``
  at least ``H``).

The run itself is :mod:`cerar.experiments.train.periodic`'s. This module loads no torch: the
config and ``cerar train --help`` use it. A :class:`~cerar.experiments.train.config.TrainConfig`
holds the method underneath in ``method`` and the schedule in ``schedule`` and ``period``, so the
hooks read their settings as they always do.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, Protocol

from cerar._checks import check_choice, check_float, check_int
from cerar.experiments.train.installed import BLOCK_METHODS

__all__ = [
    "AVERAGING_METHODS",
    "DEFAULT_OUTER_LR",
    "DEFAULT_OUTER_MOMENTUM",
    "SCHEDULES",
    "USAGE",
    "check_schedule",
    "inner_spec",
    "parse_schedule",
    "schedule_family",
    "schedule_name",
    "schedule_setting",
]

#: The schedules, and how ``--methods`` writes each.
USAGE: dict[str, str] = {
    "accum": "accum:K[:<method>]",
    "localsgd": "localsgd:H[:<method>]",
    "diloco": "diloco:H[:lrX][:<method>]",
}
SCHEDULES = tuple(USAGE)
#: The methods ``localsgd`` and ``diloco`` average through (one whole-model message per sync).
AVERAGING_METHODS = ("allreduce", "fp16", "bf16", "ring", "cerar", *BLOCK_METHODS)
#: DiLoCo's outer SGD (Douillard et al., 2023): learning rate 0.7, Nesterov momentum 0.9.
DEFAULT_OUTER_LR = 0.7
DEFAULT_OUTER_MOMENTUM = 0.9
#: What the period means per schedule, in labels (``accum-k4``, ``diloco-h10``) and messages.
_PERIOD = {"accum": "K", "localsgd": "H", "diloco": "H"}

#: ``(spec, world_size) -> (method, overrides)``: :func:`cerar.experiments.train.config.parse_method`.
ParseMethod = Callable[[str, int], tuple[str, dict[str, Any]]]


class ScheduleSettings(Protocol):
    """What the checks and labels read of a :class:`~cerar.experiments.train.config.TrainConfig`."""

    method: str
    schedule: str | None
    period: int | None
    steps: int
    warmup_steps: int
    batch_size: int
    resync_every: int | None
    outer_lr: float
    outer_momentum: float


def inner_spec(spec: str) -> str:
    """The method underneath a schedule's spec (``"diloco:10:cerar:8"`` -> ``"cerar:8"``,
    ``"accum:4"`` -> ``"allreduce"``); a plain method's spec is returned as it is."""
    name, _, rest = spec.partition(":")
    if name not in SCHEDULES:
        return spec
    inner = rest.partition(":")[2]
    if name == "diloco" and inner.startswith("lr"):
        inner = inner.partition(":")[2]
    return inner or "allreduce"


def parse_schedule(spec: str, world_size: int, parse_method: ParseMethod) -> tuple[str, dict[str, Any]]:
    """``"accum:4"``, ``"localsgd:10:fp16"``, ``"diloco:25:lr0.5:cerar:8:fp16"``... into
    ``(method underneath, overrides)``, the overrides setting ``schedule``, ``period`` (and
    ``outer_lr``) beside the method's own (``parse_method`` parses the method underneath)."""
    name, _, rest = spec.partition(":")
    period_text, _, inner = rest.partition(":")
    letter = _PERIOD[name]
    if re.fullmatch(r"\d+", period_text) is None or int(period_text) < 1:
        raise ValueError(
            f"Argument 'method' must give {name}'s {letter} as a whole number of at least 1, "
            f"like '{name}:4' ({USAGE[name]}), not {spec!r}."
        )
    overrides: dict[str, Any] = {"schedule": name, "period": int(period_text)}
    if name == "diloco" and inner.startswith("lr"):
        lr_text, _, inner = inner.partition(":")
        try:
            overrides["outer_lr"] = check_float("outer_lr", float(lr_text[2:]), positive=True)
        except ValueError:
            raise ValueError(
                f"Argument 'method' must give diloco's outer learning rate as a positive number, "
                f"like 'diloco:10:lr0.5', not {spec!r}."
            ) from None
    inner = inner or "allreduce"
    if inner.partition(":")[0] in SCHEDULES:
        raise ValueError(f"Argument 'method' must not nest schedules, not {spec!r}.")
    try:
        method, inner_overrides = parse_method(inner, world_size)
    except ValueError as exc:
        raise ValueError(f"{str(exc).rstrip('.')} (in {spec!r}).") from None
    if name != "accum" and method not in AVERAGING_METHODS:
        raise ValueError(
            f"Argument 'method' of {name} must average through one of {', '.join(AVERAGING_METHODS)}, "
            f"not {method!r} (in {spec!r})."
        )
    return method, {**inner_overrides, **overrides}


def check_schedule(config: ScheduleSettings) -> None:
    """Raise ``ValueError`` naming the argument and the value if the schedule fields do not fit
    (called by :class:`~cerar.experiments.train.config.TrainConfig` when built)."""
    check_float("outer_lr", config.outer_lr, positive=True)
    momentum = check_float("outer_momentum", config.outer_momentum, nonnegative=True)
    if momentum is not None and momentum >= 1:
        raise ValueError(f"Argument 'outer_momentum' must be less than 1, not {momentum}.")
    if config.schedule is None:
        if config.period is not None:
            raise ValueError(
                f"Argument 'period' applies to a schedule ({', '.join(SCHEDULES)}) only, not {config.period!r}."
            )
        return
    check_choice("schedule", config.schedule, SCHEDULES)
    period = check_int("period", config.period, minimum=1)
    if config.schedule == "accum":
        if config.batch_size % period:
            raise ValueError(
                f"Argument 'batch_size' must be divisible by accum's K={period} (micro-batches of "
                f"batch_size / K sequences), not {config.batch_size}."
            )
        return
    if config.method not in AVERAGING_METHODS:
        raise ValueError(
            f"Argument 'method' of {config.schedule} must average through one of {', '.join(AVERAGING_METHODS)}, "
            f"not {config.method!r}."
        )
    if config.resync_every is not None:
        raise ValueError(
            f"Argument 'resync_every' applies to the DDP hooks, not to {config.schedule}'s averaging "
            f"(give divergence_tol instead), not {config.resync_every!r}."
        )
    # A run whose first scheduled average falls after its last step is not the schedule it is
    # named: localsgd would be DDP's all-reduce throughout, diloco one average after the last step.
    if config.schedule == "localsgd" and config.steps <= config.warmup_steps:
        raise ValueError(
            f"Argument 'steps' must exceed warmup_steps={config.warmup_steps} for localsgd (it averages only after "
            f"the learning-rate warm-up, DDP all-reducing every gradient until then), not {config.steps}."
        )
    if config.schedule == "diloco" and config.steps < period:
        raise ValueError(
            f"Argument 'steps' must be at least diloco's H={period} (it averages every H steps; fewer leave only "
            f"the average after the last step), not {config.steps}."
        )


def schedule_name(config: ScheduleSettings, method_name: str) -> str:
    """``accum-k4``, ``localsgd-h10-fp16``, ``diloco-h25-lr0.5-cerar-c8-fp16`` (the outer
    learning rate and momentum only where they are not DiLoCo's defaults), from the method
    underneath's name (``cerar-c8-fp16``; ``allreduce`` is left out)."""
    parts = [f"{config.schedule}-{_PERIOD[str(config.schedule)].lower()}{config.period}"]
    if config.schedule == "diloco":
        if config.outer_lr != DEFAULT_OUTER_LR:
            parts.append(f"lr{config.outer_lr:g}")
        if config.outer_momentum != DEFAULT_OUTER_MOMENTUM:
            parts.append(f"m{config.outer_momentum:g}")
    if config.method != "allreduce":
        parts.append(method_name)
    return "-".join(parts)


def schedule_family(config: ScheduleSettings, method_name: str) -> str:
    """The name without the tuned settings (``K``, ``H``, the outer lr and momentum):
    ``diloco-h10-cerar-c8-fp16`` and ``diloco-h25-lr0.5-cerar-c8-fp16`` are both
    ``diloco-cerar-c8-fp16``; a plain method is its own family (its ``c`` or rank is its identity)."""
    if config.schedule is None:
        return method_name
    return str(config.schedule) + ("" if config.method == "allreduce" else f"-{method_name}")


def schedule_setting(config: ScheduleSettings) -> str:
    """The tuned settings as text: ``K=4``, ``H=10``, ``H=10, outer lr 0.7, momentum 0.9``
    (``-`` for a plain method)."""
    if config.schedule is None:
        return "-"
    setting = f"{_PERIOD[config.schedule]}={config.period}"
    if config.schedule == "diloco":
        setting += f", outer lr {config.outer_lr:g}, momentum {config.outer_momentum:g}"
    return setting
