"""``cerar.ddp``: the DDP communication hooks (``cerar_hook``, ``ring_hook``, the hierarchical
hooks), their states and the replicas' divergence and re-sync.

Defined in :mod:`cerar.comm.ddp`; this module re-exports its public names (it loads torch.distributed).
"""

from cerar.comm.ddp import *  # noqa: F403 (the public names, listed in its __all__)
from cerar.comm.ddp import __all__  # noqa: F401
