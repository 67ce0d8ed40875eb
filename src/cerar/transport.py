"""``cerar.transport``: the ring over torch.distributed point-to-point ops, its error, and the
scratch memory the runs reuse.

Defined in :mod:`cerar.comm.runtime.links` and :mod:`cerar.comm.algorithms.workspace`; this module
re-exports their public names. Its process-wide switch ``BATCH_ON_CPU`` is set on
:mod:`cerar.comm.runtime.links` itself.
"""

from cerar.comm.algorithms.workspace import Workspace
from cerar.comm.runtime.links import DATA_TAG, Ring, RingError, group_timeout

__all__ = ["DATA_TAG", "Ring", "RingError", "Workspace", "group_timeout"]
