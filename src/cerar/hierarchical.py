"""``cerar.hierarchical``: the collective for clusters of nodes, exact inside each node and CERAR
or the exact ring between nodes.

Defined in :mod:`cerar.comm.runtime.layout` (the layout), :mod:`cerar.comm.collective.hierarchical`
(one call's body) and :mod:`cerar.comm.collective.api` (the calls); this module re-exports their
public names.
"""

from cerar.comm.collective.api import hierarchical_all_reduce, hierarchical_ring_all_reduce
from cerar.comm.runtime.handshake import SettingsMismatchError
from cerar.comm.runtime.layout import NodeLayout, node_layout

__all__ = [
    "NodeLayout",
    "SettingsMismatchError",
    "hierarchical_all_reduce",
    "hierarchical_ring_all_reduce",
    "node_layout",
]
