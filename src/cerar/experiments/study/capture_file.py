"""A gradient capture's data and file (:mod:`cerar.experiments.study.capture` makes captures).

The ``.npz`` file (see :func:`save_capture`) holds ``gradients`` ``(P, N, d)`` float32 (capture
point, rank, parameter), ``steps`` ``(P,)``, ``losses`` ``(P, N)`` (each rank's local loss at the
capture), ``config``, the :class:`~cerar.experiments.train.config.TrainConfig` as JSON, and the
layout of the flat gradient: ``parameter_names`` ``(K,)`` and ``parameter_sizes`` ``(K,)`` int64,
the model's parameters in ``model.parameters()`` order (the order of
:func:`cerar.experiments.train.model.local_gradient`). Files written before the layout was stored
load with ``parameters=None``; :func:`model_parameters` rebuilds it from the config.
"""

from __future__ import annotations

import os
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from cerar._checks import check_int
from cerar._files import atomic_path
from cerar.experiments.train.config import ModelConfig, TrainConfig

__all__ = [
    "Capture",
    "check_parameters",
    "check_path",
    "load_capture",
    "model_parameters",
    "parameter_layout",
    "save_capture",
]


@dataclass(frozen=True)
class Capture:
    """Captured per-rank gradients.

    Attributes:
        steps: the training step of each capture point (``0`` = initial weights).
        gradients: ``(P, N, d)`` float32, ``gradients[p, i]`` = rank ``i``'s local gradient at
            ``steps[p]``.
        losses: ``(P, N)`` each rank's local loss on its batch at that point.
        config: the training run's settings (method ``allreduce``: exact averaging).
        parameters: the flat gradient's layout, ``(name, size)`` per model parameter in order
            (sizes sum to ``d``), or None when unknown (a file from before the layout was stored).
    """

    steps: tuple[int, ...]
    gradients: np.ndarray
    losses: np.ndarray
    config: TrainConfig
    parameters: tuple[tuple[str, int], ...] | None = None

    @property
    def world_size(self) -> int:
        return int(self.gradients.shape[1])

    @property
    def size(self) -> int:
        """``d``, the number of model parameters."""
        return int(self.gradients.shape[2])


def parameter_layout(module: Any) -> tuple[tuple[str, int], ...]:
    """``(name, numel)`` of every trainable parameter of a torch module, in the order of
    :func:`cerar.experiments.train.model.local_gradient`'s flat gradient."""
    return tuple((name, int(p.numel())) for name, p in module.named_parameters() if p.requires_grad)


def model_parameters(config: ModelConfig, seed: int = 0) -> tuple[tuple[str, int], ...]:
    """The layout (:func:`parameter_layout`) of the ``cerar train`` model of ``config``: what a
    capture of that model stores, rebuilt (needs torch and transformers; the seed does not change it)."""
    from cerar.experiments.train.model import build_model

    if not isinstance(config, ModelConfig):
        raise TypeError(f"Argument 'config' must be a ModelConfig, not {type(config).__name__}.")
    return parameter_layout(build_model(config, seed))


def check_parameters(parameters: Any, size: int) -> tuple[tuple[str, int], ...]:
    """``parameters`` as a tuple of ``(name, size)`` pairs after checking each name is a string,
    each size a non-negative integer, and that the sizes sum to ``size`` (the flat length)."""
    if isinstance(parameters, (str, bytes)) or not isinstance(parameters, Sequence):
        raise TypeError(f"Argument 'parameters' must be a sequence of (name, size) pairs, not {parameters!r:.80}.")
    checked = []
    for entry in parameters:
        if not isinstance(entry, Sequence) or isinstance(entry, (str, bytes)) or len(entry) != 2:
            raise TypeError(f"Argument 'parameters' must hold (name, size) pairs, not {entry!r:.80}.")
        name, count = entry
        if not isinstance(name, str):
            raise TypeError(f"Argument 'parameters' must name each parameter with a string, not {name!r}.")
        checked.append((name, check_int("parameters", count, minimum=0)))
    total = sum(count for _, count in checked)
    if total != size:
        raise ValueError(f"Argument 'parameters' must have sizes summing to d = {size}, not {total}.")
    return tuple(checked)


def save_capture(capture: Capture, path: Path | str) -> Path:
    """Write ``capture`` as an ``.npz`` (atomically: a temporary file, then a rename)."""
    if not isinstance(capture, Capture):
        raise TypeError(f"Argument 'capture' must be a Capture, not {type(capture).__name__}.")
    path = check_path(path)
    layout: dict[str, np.ndarray] = {}
    if capture.parameters is not None:
        parameters = check_parameters(capture.parameters, capture.size)
        layout = {
            "parameter_names": np.array([name for name, _ in parameters], dtype=str),
            "parameter_sizes": np.array([count for _, count in parameters], dtype=np.int64),
        }
    with atomic_path(path, suffix=".npz") as tmp:  # the suffix keeps np.savez from adding one
        np.savez(
            tmp,
            gradients=capture.gradients.astype(np.float32),
            steps=np.asarray(capture.steps, dtype=np.int64),
            losses=capture.losses.astype(np.float64),
            config=np.array(capture.config.to_json()),
            **layout,
        )
    return path


def load_capture(path: Path | str, *, name: str = "path") -> Capture:
    """Read a file written by :func:`save_capture`; ``ValueError`` naming the argument ``name``
    and the file if it is not one (a missing or unreadable file, another archive, a broken one)."""
    path = check_path(path)
    where = f"({str(path)!r})"
    if not path.is_file():
        folder = "the folder " if path.is_dir() else ""
        raise ValueError(f"Argument '{name}' must name an existing capture file, not {folder}{str(path)!r}.")
    # np.load takes what is not a zip archive for a pickle and advises allow_pickle: not our case.
    if not zipfile.is_zipfile(path):
        raise ValueError(
            f"Argument '{name}' is not a gradient capture: {str(path)!r} is not an .npz archive (as cerar study "
            "--gradients writes)."
        )
    try:
        with np.load(path, allow_pickle=False) as data:
            missing = {"gradients", "steps", "losses", "config"} - set(data.files)
            if missing:
                raise ValueError(
                    f"Argument '{name}' is not a gradient capture ({str(path)!r} lacks {sorted(missing)})."
                )
            gradients = data["gradients"]
            steps_array = data["steps"]
            losses = data["losses"]
            config_text = str(data["config"])
            names = data["parameter_names"] if "parameter_names" in data.files else None
            sizes = data["parameter_sizes"] if "parameter_sizes" in data.files else None
    except (OSError, EOFError, zipfile.BadZipFile) as exc:
        raise ValueError(
            f"Argument '{name}' is not a gradient capture: {str(path)!r} cannot be read ({exc})."
        ) from None
    except ValueError as exc:
        if str(exc).startswith(f"Argument '{name}'"):
            raise
        raise ValueError(f"Argument '{name}' holds an array that is not plain numbers {where}.") from None
    if gradients.ndim != 3 or gradients.shape[0] != len(steps_array) or gradients.shape[1] < 2:
        raise ValueError(
            f"Argument '{name}' holds gradients of shape {gradients.shape} and {len(steps_array)} steps, "
            f"not (P, N >= 2, d) with P steps {where}."
        )
    if not np.issubdtype(gradients.dtype, np.floating) or gradients.shape[2] < 1:
        raise ValueError(
            f"Argument '{name}' holds gradients of {gradients.dtype} and d = {gradients.shape[2]}, "
            f"not floats with d >= 1 {where}."
        )
    if losses.shape != gradients.shape[:2] or not np.issubdtype(steps_array.dtype, np.integer):
        raise ValueError(
            f"Argument '{name}' holds losses of shape {losses.shape} and steps of {steps_array.dtype}, "
            f"not {gradients.shape[:2]} and integers {where}."
        )
    steps = tuple(int(s) for s in steps_array)
    try:
        config = TrainConfig.from_json(config_text)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"Argument '{name}' holds a broken training config {where}: {exc}") from None
    parameters = None
    if names is not None or sizes is not None:  # older files have neither
        if names is None or sizes is None or names.shape != sizes.shape or names.ndim != 1:
            raise ValueError(f"Argument '{name}' holds a broken parameter layout {where}.")
        try:
            pairs = [(str(n), int(k)) for n, k in zip(names, sizes, strict=True)]
            parameters = check_parameters(pairs, gradients.shape[2])
        except (TypeError, ValueError) as exc:
            raise ValueError(f"Argument '{name}' holds a broken parameter layout {where}: {exc}") from None
    return Capture(steps=steps, gradients=gradients, losses=losses, config=config, parameters=parameters)


def check_path(path: Path | str) -> Path:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"Argument 'path' must be a path, not {path!r}.")
    return Path(path)
