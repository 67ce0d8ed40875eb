"""The choices shared by the collective, the DDP hooks and the training configs.

Kept in a module of their own, with no torch import, so that a config can check its settings
without loading torch.distributed.
"""

from __future__ import annotations

__all__ = ["NONFINITE_POLICIES"]

#: What a call does when some rank's input holds NaN or Inf: ``"raise"`` (an error on every
#: rank), ``"exact"`` (the exact ring for that call) or ``"ignore"`` (no check at all).
NONFINITE_POLICIES: tuple[str, ...] = ("raise", "exact", "ignore")
