"""``cerar.transport``: the ring over torch.distributed point-to-point ops and its error.

Defined in :mod:`cerar.comm.transport`; this module re-exports its public names. Its
process-wide switches (``BATCH_ON_CPU``) are set on :mod:`cerar.comm.transport` itself.
"""

from cerar.comm.transport import DATA_TAG, Ring, RingError, Workspace, group_timeout

__all__ = ["DATA_TAG", "Ring", "RingError", "Workspace", "group_timeout"]
