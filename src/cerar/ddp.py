"""``cerar.ddp``: the DDP communication hooks (``cerar_hook``, ``ring_hook``, the hierarchical
hooks, ``auto_hook``), their states, the replicas' divergence and re-sync, and the hooks by name.

Defined in :mod:`cerar.comm.ddp.hooks` and :mod:`cerar.comm.auto.ddp`; this module re-exports
their public names (it loads torch.distributed) and names the hooks (:data:`HOOKS`).
"""

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import cerar.comm.auto.collective  # noqa: F401 (registers the auto row)
from cerar._checks import check_choice
from cerar.comm.auto.ddp import AutoState, AutoStep, auto_hook
from cerar.comm.auto.pins import PinnedTable
from cerar.comm.auto.tournament import AutoConfig
from cerar.comm.collective.routes import ROUTES
from cerar.comm.ddp.hooks import *  # noqa: F403 (the public names, listed in its __all__)
from cerar.comm.ddp.hooks import __all__ as _HOOKS_ALL
from cerar.comm.ddp.hooks import cerar_hook, hier_cerar_hook, hier_ring_hook, ring_hook, route_hook

__all__ = [*_HOOKS_ALL, "HOOKS", "AutoConfig", "AutoState", "AutoStep", "PinnedTable", "auto_hook", "get_hook"]

Hook = Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]

#: The hooks of the families' own rows (the hierarchical ones take a :class:`HierarchicalState`,
#: ``auto`` an :class:`AutoState`); :func:`get_hook` makes one for any other row of the table.
HOOKS: dict[str, Hook] = {
    "cerar": cerar_hook,
    "auto": auto_hook,
    "ring": ring_hook,
    "hier-cerar": hier_cerar_hook,
    "hier-ring": hier_ring_hook,
}


def get_hook(name: str) -> Hook:
    """The hook for the route table's row ``name`` (``"cerar"``, ``"auto"``, ``"ring"``,
    ``"ring-fp16"``, ``"cerar-fp16"``, ``"hier-cerar"``, ``"hier-ring"``...;
    :data:`cerar.comm.collective.routes.ROUTES`): rows on cerar's transport only (the ``exact``
    and ``torch-*`` rows are torch's own DDP hooks)."""
    rows = tuple(n for n, r in ROUTES.items() if r.transport == "cerar")
    check_choice("name", name, rows)
    return HOOKS.get(name) or route_hook(name)
