"""``cerar.ddp``: the DDP communication hooks (``cerar_hook``, ``ring_hook``, the hierarchical
hooks, ``auto_hook``), their states, the replicas' divergence and re-sync, and the hooks by name.

Defined in :mod:`cerar.comm.ddp.hooks` and :mod:`cerar.comm.auto.ddp`; this module re-exports
their public names (it loads torch.distributed) and names the hooks (:data:`HOOKS`).
"""

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from cerar._checks import check_choice
from cerar.comm.auto.ddp import AutoState, AutoStep, auto_hook
from cerar.comm.auto.pins import PinnedTable
from cerar.comm.auto.tournament import AutoConfig
from cerar.comm.ddp.hooks import *  # noqa: F403 (the public names, listed in its __all__)
from cerar.comm.ddp.hooks import __all__ as _HOOKS_ALL
from cerar.comm.ddp.hooks import cerar_hook, hier_cerar_hook, hier_ring_hook, ring_hook

__all__ = [*_HOOKS_ALL, "HOOKS", "AutoConfig", "AutoState", "AutoStep", "PinnedTable", "auto_hook", "get_hook"]

Hook = Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]

#: The hooks by name, for configs and command lines that name the method (the hierarchical
#: ones take a :class:`HierarchicalState`, ``auto`` an :class:`AutoState`).
HOOKS: dict[str, Hook] = {
    "cerar": cerar_hook,
    "auto": auto_hook,
    "ring": ring_hook,
    "hier-cerar": hier_cerar_hook,
    "hier-ring": hier_ring_hook,
}


def get_hook(name: str) -> Hook:
    """The hook :data:`HOOKS` holds under ``name`` (``"cerar"``, ``"auto"``, ``"ring"``,
    ``"hier-cerar"``, ``"hier-ring"``)."""
    return HOOKS[check_choice("name", name, tuple(HOOKS))]
