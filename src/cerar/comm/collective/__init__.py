"""The public collectives (``cerar.all_reduce``, ``cerar.hierarchical_all_reduce``), their checks and bodies."""
