"""``cerar.hierarchical``: the collective for clusters of nodes, exact inside each node and CERAR
or the exact ring between nodes.

Defined in :mod:`cerar.comm.collective.hierarchical`; this module re-exports its public names.
"""

from cerar.comm.collective.hierarchical import *  # noqa: F403 (the public names, listed in its __all__)
from cerar.comm.collective.hierarchical import __all__  # noqa: F401
