"""``cerar.hierarchical``: the collective for clusters of nodes, exact inside each node and CERAR
or the exact ring between nodes.

Defined in :mod:`cerar.comm.hierarchical`; this module re-exports its public names.
"""

from cerar.comm.hierarchical import *  # noqa: F403 (the public names, listed in its __all__)
from cerar.comm.hierarchical import __all__  # noqa: F401
