"""cerar: coded approximate ring all-reduce (CERAR) for data-parallel training.

The public facade. The package is layered, each folder one concern, imports flowing one way
(checked by ``tests/unit/test_layers.py``)::

    coding/       the maths: Code, constructions, decoders, optimised designs (numpy/scipy only)
    protocol/     the ring schedule as data and the single-process simulators (numpy only)
    comm/         torch.distributed: ring/ (transport), kernels/ (the runs), collective/ (the calls),
                  ddp/ (hooks), auto/ (method="auto"), group/ (cerar as a process group)
    harness/      launching N local ranks, the emulated slow network, one rank's start and stop
    experiments/  bench, train, study (optional extras ``cerar[bench]``, ``cerar[train]``)
    cli/          the ``cerar`` command

The maths (:class:`Code`, :mod:`cerar.codes`, :func:`simulate`) imports numpy only; the
collective (:func:`all_reduce`, :func:`ring_all_reduce`, :func:`shutdown`) and the DDP hooks
(:mod:`cerar.ddp`) load torch.distributed on first use, and so does the hierarchical collective
for clusters of nodes (:func:`hierarchical_all_reduce`, :func:`hierarchical_ring_all_reduce`:
exact inside each node, CERAR or the exact ring between nodes), and cerar as a process group
(:func:`new_group`, :func:`exact`, :mod:`cerar.group`). The documented submodules
``cerar.codes``, ``cerar.ddp``, ``cerar.group``, ``cerar.hierarchical``, ``cerar.transport`` and ``cerar.collective``
are plain modules that re-export the public names of the modules that define them, reachable as
attributes of ``cerar`` and by ``import cerar.ddp``.
"""

from __future__ import annotations

import importlib
from typing import Any

from cerar import codes
from cerar._version import __version__
from cerar.coding.linear_code import Code
from cerar.comm.runtime.stats import CommStats
from cerar.protocol.schedule import RankPlan, RoundStep, Schedule
from cerar.protocol.simulate import SimulationResult, simulate
from cerar.protocol.simulate_ring import simulate_ring

__all__ = [
    "Code",
    "CommStats",
    "ErrorFeedback",
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
    "exact",
    "group",
    "hierarchical",
    "hierarchical_all_reduce",
    "hierarchical_ring_all_reduce",
    "new_group",
    "ring_all_reduce",
    "shutdown",
    "simulate",
    "simulate_ring",
    "transport",
]

#: The facade's submodules that load torch.distributed, imported on first use.
_SUBMODULES = ("collective", "ddp", "group", "hierarchical", "transport")
#: Names of the collective, loaded (with torch.distributed) on first use.
_COLLECTIVE_NAMES = (
    "all_reduce", "ring_all_reduce", "shutdown", "NonFiniteError", "SettingsMismatchError", "ErrorFeedback",
)  # fmt: skip
#: Names of the hierarchical collective (exact inside nodes, CERAR between them), loaded likewise.
_HIERARCHICAL_NAMES = ("hierarchical_all_reduce", "hierarchical_ring_all_reduce")
#: Names of cerar's process group (it registers the "cerar" backend), loaded likewise.
_GROUP_NAMES = ("new_group", "exact")


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"cerar.{name}")
    if name in _COLLECTIVE_NAMES:
        return getattr(importlib.import_module("cerar.collective"), name)
    if name in _HIERARCHICAL_NAMES:
        return getattr(importlib.import_module("cerar.hierarchical"), name)
    if name in _GROUP_NAMES:
        return getattr(importlib.import_module("cerar.group"), name)
    raise AttributeError(f"module 'cerar' has no attribute {name!r}")
