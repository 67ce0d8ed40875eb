"""``cerar.collective``: ``all_reduce``, ``ring_all_reduce``, ``shutdown``, their errors, statistics
and default codes.

Defined in :mod:`cerar.comm.collective.api`; this module re-exports its public names and loads
:mod:`cerar.comm.auto.collective`, which registers ``all_reduce(..., method="auto")``.
"""

import cerar.comm.auto.collective  # noqa: F401 (registers method="auto")
from cerar.comm.collective.api import *  # noqa: F403 (the public names, listed in its __all__)
from cerar.comm.collective.api import __all__  # noqa: F401
