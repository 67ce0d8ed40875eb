"""``cerar.group``: cerar as a ``torch.distributed`` process group (``new_group``, ``exact``,
``CerarProcessGroup``, ``GroupSettings``) and FSDP2's HSDP across nodes (``hsdp_groups``,
``all_reduce_hook``, ``set_all_reduce_hook``).

Defined in :mod:`cerar.comm.group`; this module re-exports their public names and registers the
``"cerar"`` backend with torch.distributed (``init_process_group("cerar")``,
``new_group(backend="cerar")``) when it loads.
"""

from cerar.comm.group.create import BACKEND, monitored_barrier, new_group, register_backend
from cerar.comm.group.hsdp import HSDPGroups, all_reduce_hook, hsdp_groups, set_all_reduce_hook
from cerar.comm.group.process_group import CerarProcessGroup, GroupSettings, RouteStats, exact

__all__ = [
    "BACKEND",

    "CerarProcessGroup",
    "GroupSettings",
    "HSDPGroups",
    "RouteStats",
    "all_reduce_hook",
    "exact",
    "hsdp_groups",
    "monitored_barrier",
    "new_group",
    "register_backend",
    "set_all_reduce_hook",
]

register_backend()
