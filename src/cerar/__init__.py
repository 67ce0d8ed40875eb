"""cerar: coded approximate ring all-reduce (CERAR) for data-parallel training.

The public facade. The package is layered, each folder one concern, imports flowing one way
(checked by ``tests/unit/test_layers.py``)::

    coding/       the maths: Code, constructions, decoders, optimised designs (numpy/scipy only)
    protocol/     the ring schedule as data and the single-process simulators (numpy only)
    comm/         torch.distributed: transport, algorithms, the collective, statistics, DDP hooks
    harness/      launching N local ranks, the emulated slow network, one rank's start and stop
    experiments/  bench, train, study (optional extras ``cerar[bench]``, ``cerar[train]``)
    cli/          the ``cerar`` command

The maths (:class:`Code`, :mod:`cerar.codes`, :func:`simulate`) imports numpy only; the
collective (:func:`all_reduce`, :func:`ring_all_reduce`, :func:`shutdown`) and the DDP hooks
(:mod:`cerar.ddp`) load torch.distributed on first use, and so does the hierarchical collective
for clusters of nodes (:func:`hierarchical_all_reduce`, :func:`hierarchical_ring_all_reduce`:
exact inside each node, CERAR or the exact ring between nodes). The documented submodules
``cerar.codes``, ``cerar.ddp``, ``cerar.hierarchical``, ``cerar.transport`` and ``cerar.collective``
are reachable both as attributes of ``cerar`` and by ``import cerar.ddp``.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Any

from cerar._version import __version__
from cerar.coding import codes
from cerar.coding.code import Code
from cerar.comm.stats import CommStats
from cerar.protocol.schedule import RankPlan, RoundStep, Schedule
from cerar.protocol.simulate import SimulationResult, simulate
from cerar.protocol.simulate_ring import simulate_ring

__all__ = [
    "Code",
    "CommStats",
    "NonFiniteError",
    "RankPlan",
    "RoundStep",
    "Schedule",
    "SettingsMismatchError",
    "SimulationResult",
    "__version__",
    "all_reduce",
    "codes",
    "collective",
    "ddp",
    "hierarchical",
    "hierarchical_all_reduce",
    "hierarchical_ring_all_reduce",
    "ring_all_reduce",
    "shutdown",
    "simulate",
    "simulate_ring",
    "transport",
]

#: Documented submodules that live deeper in the tree, by their public name.
_SUBMODULES = {
    "codes": "cerar.coding.codes",
    "collective": "cerar.comm.collective",
    "ddp": "cerar.comm.ddp",
    "hierarchical": "cerar.comm.hierarchical",
    "transport": "cerar.comm.transport",
}
#: Names of the collective, loaded (with torch.distributed) on first use.
_COLLECTIVE_NAMES = ("all_reduce", "ring_all_reduce", "shutdown", "NonFiniteError", "SettingsMismatchError")
#: Names of the hierarchical collective (exact inside nodes, CERAR between them), loaded likewise.
_HIERARCHICAL_NAMES = ("hierarchical_all_reduce", "hierarchical_ring_all_reduce")


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Makes ``import cerar.ddp`` load ``cerar.comm.ddp`` (the same module object)."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        public = fullname.removeprefix("cerar.")
        if fullname.startswith("cerar.") and public in _SUBMODULES:
            return importlib.machinery.ModuleSpec(fullname, self)
        return None

    def create_module(self, spec: Any) -> ModuleType:
        module = importlib.import_module(_SUBMODULES[spec.name.removeprefix("cerar.")])
        spec.loader_state = module.__spec__  # the import system overwrites it: put it back below
        return module

    def exec_module(self, module: ModuleType) -> None:
        # Already executed under its real name; keep that name's spec (reload, pickling).
        module.__spec__ = module.__spec__.loader_state


sys.meta_path.append(_Alias())


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(_SUBMODULES[name])
    if name in _COLLECTIVE_NAMES:
        return getattr(importlib.import_module("cerar.comm.collective"), name)
    if name in _HIERARCHICAL_NAMES:
        return getattr(importlib.import_module("cerar.comm.hierarchical"), name)
    raise AttributeError(f"module 'cerar' has no attribute {name!r}")
