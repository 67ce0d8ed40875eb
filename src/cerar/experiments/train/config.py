"""Validated settings of one training run, the method names, and their command-line form.

A :class:`TrainConfig` is checked when built (bad values raise ``ValueError``/``TypeError``
naming the argument and the value) and round-trips through JSON, which is how the command
hands it to every rank.
"""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from cerar._checks import check_choice, check_float, check_int

__all__ = ["METHODS", "ModelConfig", "TrainConfig", "add_config_arguments", "config_from_args", "parse_method"]

METHODS: tuple[str, ...] = ("allreduce", "ring", "cerar", "fp16", "bf16", "powersgd")
BYTE_VOCAB = 256  # byte-level tokens: no tokenizer to download


@dataclass(frozen=True)
class ModelConfig:
    """A Pythia-like GPT-NeoX scaled to a CPU: rotary embeddings on ``rotary_pct`` of each head,
    parallel attention + MLP residual, untied embeddings, no dropout, 4x MLP, as Pythia.

    Defaults (4 layers, hidden 128, context 128) give 0.86 M parameters: a step of 8 sequences
    takes about 0.1 s on one core here, so four ranks on two cores train 200 steps in about a minute and a half.
    """

    layers: int = 4
    hidden: int = 128
    heads: int = 4
    seq_len: int = 128
    rotary_pct: float = 0.25

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
    the same order (see :mod:`cerar.experiments.train.data`).

    Args:
        method: one of :data:`METHODS`.
        components: ``cerar``: the code's ``c`` (``None``: ``2N``).
        powersgd_rank: ``powersgd``: the matrix approximation rank.
        steps: optimizer steps.
        batch_size: sequences per rank per step (global batch ``N x batch_size``).
        model: the :class:`ModelConfig`.
        lr, min_lr_ratio, warmup_steps: AdamW learning rate, linear warm-up for
            ``warmup_steps`` then cosine decay to ``min_lr_ratio x lr`` at the last step.
        weight_decay: AdamW weight decay on matrices (not on biases and norms), as Pythia.
        grad_clip: clip the averaged gradient's norm (``0``: off). A step whose averaged
            gradient is not finite is skipped and counted.
        eval_every: evaluate the validation loss every this many steps (and at the end).
        eval_sequences: validation sequences per evaluation (fixed, the same for every run).
        seed: initial weights and data order.
        bucket_cap_mb: DDP's bucket size: several buckets let communication overlap backward.
        nonfinite, resync_every, divergence_tol: ``cerar``/``ring``: see
            :class:`cerar.comm.ddp.CerarState`.
    """

    method: str = "allreduce"
    components: int | None = None
    powersgd_rank: int = 4
    steps: int = 200
    batch_size: int = 8
    model: ModelConfig = field(default_factory=ModelConfig)
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    eval_every: int = 25
    eval_sequences: int = 64
    seed: int = 0
    bucket_cap_mb: float = 1.0
    nonfinite: str = "exact"
    resync_every: int | None = None
    divergence_tol: float | None = None

    def __post_init__(self) -> None:
        check_choice("method", self.method, METHODS)
        if self.components is not None:
            check_int("components", self.components, minimum=1)
        check_int("powersgd_rank", self.powersgd_rank, minimum=1)
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
        check_float("bucket_cap_mb", self.bucket_cap_mb, positive=True)
        check_choice("nonfinite", self.nonfinite, ("raise", "exact", "ignore"))
        if self.resync_every is not None:
            check_int("resync_every", self.resync_every, minimum=1)
        if self.divergence_tol is not None:
            check_float("divergence_tol", self.divergence_tol, positive=True)

    @property
    def label(self) -> str:
        """A short name: ``allreduce-s0``, ``cerar-c8-s0``, ``powersgd-r4-s1``."""
        middle = ""
        if self.method == "cerar" and self.components is not None:
            middle = f"-c{self.components}"
        elif self.method == "powersgd":
            middle = f"-r{self.powersgd_rank}"
        return f"{self.method}{middle}-s{self.seed}"

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


def parse_method(spec: str, world_size: int) -> tuple[str, dict[str, int]]:
    """``"cerar"``, ``"cerar:12"``, ``"cerar:3N"``, ``"powersgd:2"``, ``"fp16"``... into
    ``(method, overrides)`` with ``overrides`` the TrainConfig fields it sets."""
    world_size = check_int("world_size", world_size, minimum=1)
    if not isinstance(spec, str):
        raise TypeError(f"Argument 'method' must be a string, not {spec!r}.")
    name, _, param = spec.partition(":")
    check_choice("method", name, METHODS)
    if not param:
        return name, ({"components": 2 * world_size} if name == "cerar" else {})
    if name not in ("cerar", "powersgd"):
        raise ValueError(f"Argument 'method' takes a parameter only for cerar and powersgd, not {spec!r}.")
    match = re.fullmatch(r"(\d+)(N?)", param)
    if match is None or (match.group(2) and name != "cerar"):
        raise ValueError(f"Argument 'method' must look like 'cerar:8', 'cerar:3N' or 'powersgd:2', not {spec!r}.")
    value = int(match.group(1)) * (world_size if match.group(2) else 1)
    if value < 1:
        raise ValueError(f"Argument 'method' must have a parameter of at least 1, not {spec!r}.")
    return name, ({"components": value} if name == "cerar" else {"powersgd_rank": value})


# ---------------------------------------------------------------------------------------------
# Command-line form, shared by `cerar train` and the worker (so the worker also runs under torchrun)

_MODEL_OPTIONS = {"layers": int, "hidden": int, "heads": int, "seq_len": int, "rotary_pct": float}
_RUN_OPTIONS = {
    "steps": int,
    "batch_size": int,
    "lr": float,
    "min_lr_ratio": float,
    "warmup_steps": int,
    "weight_decay": float,
    "grad_clip": float,
    "eval_every": int,
    "eval_sequences": int,
    "bucket_cap_mb": float,
    "powersgd_rank": int,
    "resync_every": int,
    "divergence_tol": float,
    "nonfinite": str,
}


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """Options for every model and run setting, defaulting to :class:`TrainConfig`'s."""
    model_defaults, run_defaults = ModelConfig(), TrainConfig()
    group = parser.add_argument_group("model (GPT-NeoX, Pythia-like)")
    for name, kind in _MODEL_OPTIONS.items():
        default = getattr(model_defaults, name)
        group.add_argument(f"--{name.replace('_', '-')}", type=kind, default=default, help=f"(default {default})")
    group = parser.add_argument_group("training")
    for name, kind in _RUN_OPTIONS.items():
        default = getattr(run_defaults, name)
        group.add_argument(f"--{name.replace('_', '-')}", type=kind, default=default, help=f"(default {default})")


def config_from_args(args: argparse.Namespace, method: str, seed: int, world_size: int) -> TrainConfig:
    """The :class:`TrainConfig` for one method spec (see :func:`parse_method`) and seed."""
    name, overrides = parse_method(method, world_size)
    model = ModelConfig(**{k: getattr(args, k) for k in _MODEL_OPTIONS})
    values: dict[str, Any] = {k: getattr(args, k) for k in _RUN_OPTIONS}
    values.update(overrides)
    return TrainConfig(method=name, model=model, seed=seed, **values)
