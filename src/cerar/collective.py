"""``cerar.collective``: ``all_reduce``, ``ring_all_reduce``, ``shutdown``, their errors, statistics
and default codes.

Defined in :mod:`cerar.comm.collective`; this module re-exports its public names.
"""

from cerar.comm.collective import *  # noqa: F403 (the public names, listed in its __all__)
from cerar.comm.collective import __all__  # noqa: F401
