"""The optional dependencies of the experiments, and one clear message when one is missing.

``pip install cerar`` brings numpy, scipy and torch: the library. The experiments need more
(``cerar[bench]``: matplotlib, tqdm; ``cerar[train]``: transformers, matplotlib, tqdm), and a bare
``ModuleNotFoundError: No module named 'tqdm'`` from deep inside a command says neither why nor
what to install. :func:`require` imports a module or raises :class:`MissingExtraError` naming the
command and the extra, which ``cerar`` prints as one line.
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["MissingExtraError", "pyplot", "require"]


class MissingExtraError(ImportError):
    """An experiment needs a module of an extra that is not installed."""


def require(module: str, extra: str, *, needed_by: str | None = None) -> ModuleType:
    """Import and return ``module``; if it is missing, raise :class:`MissingExtraError` saying
    ``"cerar train needs transformers: pip install 'cerar[train]'"``.

    Args:
        module: the module to import (``"matplotlib"``, ``"tqdm"``, ``"transformers"``).
        extra: the extra of ``pyproject.toml`` that installs it (``"bench"``, ``"train"``).
        needed_by: who needs it, for the message (default ``"cerar <extra>"``).
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        if exc.name is not None and exc.name != module and not module.startswith(exc.name + "."):
            raise  # the module exists but one of *its* imports failed: not ours to rename
        who = needed_by if needed_by is not None else f"cerar {extra}"
        raise MissingExtraError(f"{who} needs {module}: pip install 'cerar[{extra}]'", name=module) from exc


def pyplot(extra: str, *, needed_by: str | None = None) -> ModuleType:
    """``matplotlib.pyplot`` on the Agg backend (files only: no display needed), or
    :class:`MissingExtraError` naming ``extra``."""
    matplotlib = require("matplotlib", extra, needed_by=needed_by)
    matplotlib.use("Agg")
    return importlib.import_module("matplotlib.pyplot")
