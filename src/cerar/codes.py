"""``cerar.codes``: the code constructions, the optimised designs, ``choose`` and the registry.

Defined in :mod:`cerar.coding.codes`; this module re-exports its public names (numpy only).
"""

from cerar.coding.codes import *  # noqa: F403 (the public names, listed in its __all__)
from cerar.coding.codes import __all__  # noqa: F401
