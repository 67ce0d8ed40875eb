"""cerar: coded approximate ring all-reduce (CERAR) for data-parallel training.

The maths (:class:`Code`, :mod:`cerar.codes`, :func:`simulate`) imports numpy only; the
collective (:func:`all_reduce`, :func:`ring_all_reduce`) and the DDP hook (:mod:`cerar.ddp`)
load torch.distributed on first use.
"""

from __future__ import annotations

from typing import Any

from cerar import codes
from cerar.code import Code
from cerar.schedule import RankPlan, RoundStep, Schedule
from cerar.simulate import SimulationResult, simulate
from cerar.simulate_ring import simulate_ring
from cerar.stats import CommStats

__version__ = "0.1.0"

__all__ = [
    "Code",
    "CommStats",
    "NonFiniteError",
    "RankPlan",
    "RoundStep",
    "Schedule",
    "SettingsMismatchError",
    "SimulationResult",
    "all_reduce",
    "codes",
    "ring_all_reduce",
    "simulate",
    "simulate_ring",
]

_LAZY = {
    name: "cerar.collective"
    for name in ("all_reduce", "ring_all_reduce", "NonFiniteError", "SettingsMismatchError")
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'cerar' has no attribute {name!r}")
