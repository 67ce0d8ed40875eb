"""Validated settings of one training run and their command-line form.

A :class:`TrainConfig` is checked when built (bad values raise ``ValueError``/``TypeError``
naming the argument and the value) and round-trips through JSON, which is how the command
hands it to every rank.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from cerar._checks import check_bool, check_choice, check_float, check_int
from cerar.comm.collective.policies import NONFINITE_POLICIES
from cerar.experiments._flags import add_flags, flag, flag_group, from_flags
from cerar.experiments.train.installed import BLOCK_METHODS
from cerar.experiments.train.methods import HOOKS, POWERSGD_START, ROW_NAMES, method_names, resolve
from cerar.experiments.train.parallel import PARALLELS, check_parallel
from cerar.experiments.train.schedules import (
    DEFAULT_OUTER_LR,
    DEFAULT_OUTER_MOMENTUM,
    SCHEDULES,
    check_schedule,
    inner_spec,
    parse_schedule,
    schedule_family,
    schedule_name,
    schedule_setting,
)

__all__ = [
    "ModelConfig",
    "TrainConfig",
    "add_config_arguments",
    "config_from_args",
    "parse_bucket_caps",
    "parse_method",
]

BYTE_VOCAB = 256  # byte-level tokens: no tokenizer to download


def parse_bucket_caps(text: str) -> tuple[float, ...]:
    """``"1,4,16"`` (``--bucket-cap-mb``) into ``(1.0, 4.0, 16.0)``; the values are checked by
    :class:`TrainConfig`, so a bad one raises the same error as in Python."""
    values = []
    for item in text.split(","):
        try:
            values.append(float(item))
        except ValueError:
            raise ValueError(
                f"Argument 'bucket_cap_mb' must be a size in MB or a comma list of them (e.g. 1,4,16), not {text!r}."
            ) from None
    return tuple(values)


def _bucket_caps(value: object) -> float | tuple[float, ...]:
    """One size (a float) or a sweep (a tuple of two or more distinct sizes, as given); each a
    positive, finite number of MB. A list of one size is that size."""
    items = tuple(value) if isinstance(value, (list, tuple)) else (value,)
    if not items:
        raise ValueError("Argument 'bucket_cap_mb' must list at least one size, not ().")
    caps = []
    for index, item in enumerate(items):
        try:
            caps.append(check_float("bucket_cap_mb", item, positive=True))
        except (TypeError, ValueError) as exc:
            if len(items) == 1:
                raise
            raise type(exc)(f"{str(exc)[:-1]} (entry {index} of {list(items)!r}).") from None
    repeated = sorted({cap for cap in caps if caps.count(cap) > 1})
    if repeated:
        raise ValueError(f"Argument 'bucket_cap_mb' must not repeat a size, not {list(items)!r} (repeats {repeated}).")
    return caps[0] if len(caps) == 1 else tuple(caps)


@dataclass(frozen=True)
class ModelConfig:
    """A Pythia-like GPT-NeoX scaled to a CPU: rotary embeddings on ``rotary_pct`` of each head,
    parallel attention + MLP residual, untied embeddings, no dropout, 4x MLP, as Pythia.

    Defaults (4 layers, hidden 128, context 128) give 0.86 M parameters: small enough that four
    ranks on a laptop-class CPU train a few hundred steps in minutes, large enough that a step's
    gradient (3.4 MB in float32) makes communication matter on a slow link.
    """

    layers: int = field(default=4, metadata=flag("transformer layers"))
    hidden: int = field(default=128, metadata=flag("hidden size (a multiple of heads)"))
    heads: int = field(default=4, metadata=flag("attention heads"))
    seq_len: int = field(default=128, metadata=flag("context length in bytes"))
    rotary_pct: float = field(default=0.25, metadata=flag("share of each head with rotary embeddings (Pythia: 0.25)"))

    def __post_init__(self) -> None:
        check_int("layers", self.layers, minimum=1)
        check_int("hidden", self.hidden, minimum=8)
        check_int("heads", self.heads, minimum=1)
        check_int("seq_len", self.seq_len, minimum=8)
        check_float("rotary_pct", self.rotary_pct, positive=True, maximum=1.0)
        if self.hidden % self.heads:
            raise ValueError(f"Argument 'hidden' must be a multiple of heads={self.heads}, not {self.hidden}.")


@dataclass(frozen=True)
class TrainConfig:
    """One run: a method, the model, the data order and the optimiser schedule.

    Every method with the same ``seed`` sees the same initial weights and the same batches in
    the same order (see :mod:`cerar.experiments.train.data`). The fields with a flag are the
    options of ``cerar train`` and of the worker (their help is in the field's metadata); the
    others come from the method spec (:func:`parse_method`) and the command.

    ``bucket_cap_mb`` is one size, or several (``(1, 4, 16)``, ``--bucket-cap-mb 1,4,16``): a
    sweep, which ``cerar train`` runs as one run per size (:meth:`at_bucket`); a run itself
    (:func:`cerar.experiments.train.loop.train`) takes one size.

    Args:
        method: a key of :data:`~cerar.experiments.train.methods.HOOKS`.
        components: ``cerar``: the code's ``c`` (``None``: ``2N``).
        max_error: ``auto``: the error budget (``None``: the library's, 0.1), from ``auto:1e-3``.
        error_feedback: the block methods' error feedback (:class:`cerar.ErrorFeedback`), from a
            spec ending in ``+ef`` (``direct-int4+ef``, ``diloco:10:int4+ef``).
        packet: ``cerar``: 16-bit packets, ``"fp16"`` or ``"bf16"`` (``None``: float32), from
            the spec ``cerar:8:fp16``; the code is then tuned for that precision.
        parallel: ``"ddp"`` (the method's DDP hook), ``"group"`` (DDP over cerar's process
            group running the method, no hook) or ``"hsdp"`` (FSDP2's HSDP on emulated nodes,
            cerar's group running the method between them), from the specs ``group:<method>``
            and ``hsdp:<method>`` (:mod:`cerar.experiments.train.parallel`).
        schedule, period: a communication-avoiding schedule around ``method``
            (:mod:`cerar.experiments.train.schedules`: ``"accum"`` with ``K = period``,
            ``"localsgd"`` or ``"diloco"`` with ``H = period``), from the spec ``diloco:10:cerar:8``;
            ``None``: the method's DDP hook alone.
        outer_lr, outer_momentum: ``diloco``'s outer SGD (Nesterov).
        seed: initial weights and data order.
        nonfinite, resync_every, divergence_tol: ``cerar``/``ring``: see
            :class:`cerar.comm.ddp.hooks.CerarState`.
        min_bucket_mb: ``cerar``/``ring``: ``CerarState(min_bucket_bytes=...)`` in MiB (DDP's
            MB). Default 0, every bucket through the method's own ring, so that the grid
            measures the method as named; the hook's own default (2 MiB, the crossover below
            which CERAR is slower than Gloo) is what ``--min-bucket-mb 2`` tries.
    """

    method: str = "allreduce"
    components: int | None = None
    packet: str | None = None
    parallel: str = "ddp"
    powersgd_rank: int = field(default=4, metadata=flag("powersgd: the matrix approximation rank"))
    powersgd_start: int = field(
        default=POWERSGD_START, metadata=flag("powersgd: the steps averaged exactly before compression starts")
    )
    schedule: str | None = None
    period: int | None = None
    outer_lr: float = field(
        default=DEFAULT_OUTER_LR, metadata=flag("diloco: the outer SGD's learning rate (a spec's lrX wins)")
    )
    outer_momentum: float = field(
        default=DEFAULT_OUTER_MOMENTUM, metadata=flag("diloco: the outer SGD's Nesterov momentum")
    )
    steps: int = field(default=200, metadata=flag("optimizer steps"))
    batch_size: int = field(default=8, metadata=flag("sequences per rank per step (global batch N x this)"))
    model: ModelConfig = field(default_factory=ModelConfig, metadata=flag_group("model (GPT-NeoX, Pythia-like)"))
    lr: float = field(default=2e-3, metadata=flag("AdamW peak learning rate"))
    min_lr_ratio: float = field(default=0.1, metadata=flag("cosine decay ends at this x lr, at the last step"))
    warmup_steps: int = field(default=20, metadata=flag("linear learning-rate warm-up steps"))
    weight_decay: float = field(default=0.01, metadata=flag("AdamW weight decay on matrices (not biases, norms)"))
    grad_clip: float = field(
        default=1.0,
        metadata=flag("clip the averaged gradient's norm (0: off); a step whose gradient is not finite is skipped"),
    )
    eval_every: int = field(default=25, metadata=flag("validation loss every this many steps (and at the end)"))
    eval_sequences: int = field(default=64, metadata=flag("validation sequences per evaluation (fixed)"))
    seed: int = 0
    bucket_cap_mb: float | tuple[float, ...] = field(
        default=1.0,
        metadata=flag(
            "DDP's bucket size in MB: several buckets let communication overlap backward; a comma list "
            "(1,4,16) sweeps: every method at every size, reported at its best",
            parse=parse_bucket_caps,
        ),
    )
    min_bucket_mb: float = field(
        default=0.0,
        metadata=flag("cerar/ring: buckets under this many MB take torch's exact all-reduce (the hook's default: 2)"),
    )
    nonfinite: str = field(default="exact", metadata=flag("cerar/ring: raise, exact or ignore on NaN/Inf input"))
    resync_every: int | None = field(
        default=None, metadata=flag("cerar/ring: re-sync the replicas every k steps", default_text="off")
    )
    divergence_tol: float | None = field(
        default=None, metadata=flag("cerar/ring: re-sync when the replicas diverge more than this", default_text="off")
    )
    max_error: float | None = None
    error_feedback: bool = False

    def __post_init__(self) -> None:
        check_choice("method", self.method, HOOKS)
        if self.components is not None:
            check_int("components", self.components, minimum=1)
        if self.packet is not None:
            check_choice("packet", self.packet, PACKETS)
            if self.method != "cerar":
                raise ValueError(f"Argument 'packet' applies to method 'cerar' only, not {self.method!r}.")
        check_parallel(self)
        check_int("powersgd_rank", self.powersgd_rank, minimum=1)
        check_int("powersgd_start", self.powersgd_start, minimum=1)
        check_int("steps", self.steps, minimum=1)
        check_int("batch_size", self.batch_size, minimum=1)
        if not isinstance(self.model, ModelConfig):
            raise TypeError(f"Argument 'model' must be a ModelConfig, not {type(self.model).__name__}.")
        check_float("lr", self.lr, positive=True)
        check_float("min_lr_ratio", self.min_lr_ratio, nonnegative=True, maximum=1.0)
        check_int("warmup_steps", self.warmup_steps, minimum=0)
        check_float("weight_decay", self.weight_decay, nonnegative=True)
        check_float("grad_clip", self.grad_clip, nonnegative=True)
        check_int("eval_every", self.eval_every, minimum=1)
        check_int("eval_sequences", self.eval_sequences, minimum=1)
        check_int("seed", self.seed, minimum=0)
        object.__setattr__(self, "bucket_cap_mb", _bucket_caps(self.bucket_cap_mb))  # frozen: normalised once
        check_float("min_bucket_mb", self.min_bucket_mb, nonnegative=True)
        check_choice("nonfinite", self.nonfinite, NONFINITE_POLICIES)
        if self.resync_every is not None:
            check_int("resync_every", self.resync_every, minimum=1)
        if self.divergence_tol is not None:
            check_float("divergence_tol", self.divergence_tol, positive=True)
        if self.max_error is not None:
            check_float("max_error", self.max_error, positive=True)
            if self.method != "auto":
                raise ValueError(f"Argument 'max_error' applies to method 'auto' only, not {self.method!r}.")
        check_bool("error_feedback", self.error_feedback)
        if self.error_feedback and self.method not in BLOCK_METHODS:
            raise ValueError(
                f"Argument 'error_feedback' (+ef) applies to the block methods ({', '.join(BLOCK_METHODS)}), "
                f"not {self.method!r}."
            )
        check_schedule(self)

    @property
    def method_name(self) -> str:
        """The DDP method with its parameter: ``allreduce``, ``cerar-c8``, ``powersgd-r4``."""
        if self.method in ("cerar", "hier-cerar") and self.components is not None:
            return f"{self.method}-c{self.components}" + (f"-{self.packet}" if self.packet else "")
        if self.method == "powersgd":  # the start shown when it is not the default
            start = "" if self.powersgd_start == POWERSGD_START else f"-start{self.powersgd_start}"
            return f"{self.method}-r{self.powersgd_rank}{start}"
        if self.method == "auto" and self.max_error is not None:
            return f"auto-{self.max_error:g}"
        return self.method + ("+ef" if self.error_feedback else "")

    @property
    def name(self) -> str:
        """The method with its parameter, and its schedule or process group if any: ``allreduce``,
        ``cerar-c8``, ``powersgd-r4``, ``diloco-h10-cerar-c8-fp16``, ``hsdp-cerar-c8-fp16``."""
        if self.schedule is not None:
            return schedule_name(self, self.method_name)
        if self.parallel != "ddp":
            return f"{self.parallel}-{self.method_name}"
        return self.method_name

    @property
    def family(self) -> str:
        """:attr:`name` without the schedule's tuned settings (``diloco-cerar-c8-fp16``)."""
        return schedule_family(self, self.method_name)

    @property
    def setting(self) -> str:
        """The schedule's tuned settings as text (``H=10, outer lr 0.7, momentum 0.9``; ``-``)."""
        return schedule_setting(self)

    @property
    def label(self) -> str:
        """A short name: ``allreduce-s0``, ``cerar-c8-s0``, ``powersgd-r4-s1``."""
        return f"{self.name}-s{self.seed}"

    @property
    def bucket_label(self) -> str:
        """The label of one run of a bucket sweep: ``cerar-c8-b4-s0`` (4 MB buckets)."""
        return f"{self.name}-b{self.bucket_cap_mb:g}-s{self.seed}"

    @property
    def bucket_caps(self) -> tuple[float, ...]:
        """The bucket sizes (MB) this config names: one, or a sweep's."""
        caps = self.bucket_cap_mb
        return caps if isinstance(caps, tuple) else (caps,)

    def at_bucket(self, cap_mb: float) -> TrainConfig:
        """This config for one run at bucket size ``cap_mb``."""
        return replace(self, bucket_cap_mb=cap_mb)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"Argument 'data' has unknown TrainConfig fields {unknown}.")
        values = dict(data)
        if isinstance(values.get("model"), dict):
            values["model"] = ModelConfig(**values["model"])
        return cls(**values)

    @classmethod
    def from_json(cls, text: str) -> TrainConfig:
        return cls.from_dict(json.loads(text))


#: CERAR's 16-bit packet precisions in a method spec (``cerar:8:fp16``).
PACKETS = ("fp16", "bf16")
#: What a spec ends with to turn on a block method's error feedback.
EF_SUFFIX = "+ef"


def parse_method(spec: str, world_size: int, grouped: bool = False) -> tuple[str, dict[str, Any]]:
    """``"cerar"``, ``"cerar:12"``, ``"cerar:3N"``, ``"cerar:8:fp16"``, ``"cerar:2N:bf16"``,
    ``"powersgd:2"``, ``"powersgd:2:start50"``, ``"auto:1e-3"``, ``"fp16"``... into
    ``(method, overrides)`` with ``overrides`` the TrainConfig fields it sets (the hook's
    :attr:`~cerar.experiments.train.methods.Hook.parameter`, and ``packet``). A schedule's spec
    (``"accum:4"``, ``"diloco:10:cerar:8:fp16"``) gives the method underneath, its overrides
    adding ``schedule`` and ``period`` (:func:`cerar.experiments.train.schedules.parse_schedule`);
    a process group's (``"group:cerar:8"``, ``"hsdp:auto:2e-2"``), ``parallel``.

    The route table's row names mean the method each is
    (:data:`~cerar.experiments.train.methods.ROW_NAMES`): ``"exact"`` parses as ``"allreduce"``,
    ``"ring-int8"`` as ``"int8"``, ``"cerar-fp16:8"`` as ``"cerar:8:fp16"``, ``"group:ring-fp16"``
    as ``"group:fp16"`` (``grouped``: the method under ``group:``/``hsdp:``)."""
    world_size = check_int("world_size", world_size, minimum=1)
    if not isinstance(spec, str):
        raise TypeError(f"Argument 'method' must be a string, not {spec!r}.")
    if spec.endswith(EF_SUFFIX):  # direct-int4+ef, diloco:10:int4+ef: the block method's error feedback
        name, overrides = parse_method(spec.removesuffix(EF_SUFFIX), world_size, grouped)
        return name, {**overrides, "error_feedback": True}
    name, _, param = spec.partition(":")
    if name not in (*HOOKS, *ROW_NAMES, *SCHEDULES, *PARALLELS):
        raise ValueError(f"Argument 'method' must be one of {_spec_names()}, not {name!r}.")
    if name in SCHEDULES:
        return parse_schedule(spec, world_size, parse_method)
    if name in PARALLELS:  # group:<method>, hsdp:<method> (its kN: N the nodes, as passed)
        inner, overrides = parse_method(param or "allreduce", world_size, grouped=True)
        return inner, {**overrides, "parallel": name}
    name, row_packet = resolve(name, grouped)
    hook = HOOKS[name]
    param, _, packet = param.partition(":")
    if row_packet is not None:  # cerar-fp16[:c|:kN]: cerar[:c|:kN]:fp16
        if packet:
            raise ValueError(
                f"Argument 'method' must look like '{spec.partition(':')[0]}:8' or '{spec.partition(':')[0]}:3N' "
                f"(its packets are {row_packet}), not {spec!r}."
            )
        packet = row_packet
    if name == "powersgd" and packet:  # powersgd:2:start50, the exact steps before compression
        start = re.fullmatch(r"start(\d+)", packet)
        if start is None or not param:
            raise ValueError(f"Argument 'method' must look like 'powersgd:2:start50', not {spec!r}.")
        name, overrides = parse_method(f"{name}:{param}", world_size)
        return name, {**overrides, "powersgd_start": int(start.group(1))}
    if packet:
        if name != "cerar" or packet not in PACKETS:
            raise ValueError(
                f"Argument 'method' takes a packet precision only as 'cerar:8:fp16' or 'cerar:2N:bf16' "
                f"(one of {', '.join(PACKETS)}), not {spec!r}."
            )
        try:
            name, overrides = parse_method(f"{name}:{param}" if param else name, world_size)
        except ValueError as exc:
            raise ValueError(f"{str(exc).rstrip('.')} (in {spec!r}).") from None
        return name, {**overrides, "packet": packet}
    if not param:
        return name, ({hook.parameter: 2 * world_size} if hook.per_rank and hook.parameter else {})
    if hook.parameter is None:
        with_parameter = ", ".join(h.name for h in HOOKS.values() if h.parameter)
        raise ValueError(f"Argument 'method' takes a parameter only for {with_parameter}, not {spec!r}.")
    if hook.parameter == "max_error":  # auto:1e-3, the error budget
        try:
            budget = float(param)
        except ValueError:
            budget = math.nan
        if not (math.isfinite(budget) and budget > 0):
            raise ValueError(f"Argument 'method' must look like 'auto:1e-3' (a positive error budget), not {spec!r}.")
        return name, {"max_error": budget}
    match = re.fullmatch(r"(\d+)(N?)", param)
    if match is None or (match.group(2) and not hook.per_rank):
        raise ValueError(f"Argument 'method' must look like 'cerar:8', 'cerar:3N' or 'powersgd:2', not {spec!r}.")
    value = int(match.group(1)) * (world_size if match.group(2) else 1)
    if value < 1:
        raise ValueError(f"Argument 'method' must have a parameter of at least 1, not {spec!r}.")
    return name, {hook.parameter: value}


def _spec_names() -> str:
    """What a spec may start with: the rows' and methods' names, the schedules, the groups."""
    around = ", ".join(repr(name) for name in (*SCHEDULES, *PARALLELS))
    return f"{method_names()}, or a schedule or process group around one, {around}"


# ---------------------------------------------------------------------------------------------
# Command-line form, shared by `cerar train` and the workers (so they also run under torchrun):
# the flags are the fields' own (:mod:`cerar.experiments._flags`).


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """Options for every model and run setting, defaulting to :class:`TrainConfig`'s."""
    add_flags(parser, TrainConfig, title="training")


def config_from_args(
    args: argparse.Namespace, method: str, seed: int, world_size: int, nodes: int | None = None
) -> TrainConfig:
    """The :class:`TrainConfig` for one method spec (see :func:`parse_method`) and seed: the
    spec's parameter wins over ``--powersgd-rank``. ``nodes``: the ``M`` of a hierarchical
    method's ``kN`` (its code is for the nodes)."""
    base = inner_spec(method).partition(":")[0]  # a schedule's: the method underneath
    base = resolve(base)[0] if base in ROW_NAMES and ROW_NAMES[base][0] else base  # a row's name: its method
    hierarchical = HOOKS[base].hierarchical if base in HOOKS else base == "hsdp"
    name, overrides = parse_method(method, nodes if hierarchical and nodes else world_size)
    return from_flags(args, TrainConfig, method=name, seed=seed, **overrides)
