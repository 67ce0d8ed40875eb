"""One call as its route resolved it (:class:`Request`): what a call body takes, whole.

The ways in (``cerar.all_reduce``, cerar's process group, the DDP hooks, ``cerar bench``) hand a
route their settings (:class:`Settings`); the route checks which apply to it, fills in the
defaults (the wire, the code) and returns the request (:meth:`cerar.comm.collective.routes.Route.resolve`).
No way in decides per row which settings apply.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from cerar.coding.linear_code import MAX_ERROR, Code
from cerar.comm.algorithms.ring.feedback import ErrorFeedback
from cerar.comm.algorithms.ring.wires import Wire
from cerar.comm.runtime.stats import CommStats

__all__ = ["Request", "Settings"]


@dataclass(frozen=True)
class Settings:
    """A caller's settings for one call: None (or the default) where the caller left one out.

    ``code``, ``wire_dtype`` (float32/float64 for the rows of no fixed wire, 16 bits for CERAR's
    family rows) and ``fresh_scale`` apply to CERAR's rows, ``ranks_per_node`` to the hierarchical
    ones; a row refuses one that does not apply to it, naming the row. ``nonfinite`` and
    ``max_error`` apply to every row (a row whose predicted error exceeds ``max_error`` is
    refused; the exact rows and the float32 ring predict float32 rounding); ``error_feedback``
    (a :class:`cerar.ErrorFeedback`) to the flat block rows (``ring-int8``, ``direct-int4``...)."""

    code: Code | None = None
    nonfinite: str = "raise"
    wire_dtype: torch.dtype | None = None
    max_error: float | None = MAX_ERROR
    stats: CommStats | None = None
    fresh_scale: bool = False
    ranks_per_node: int | None = None
    context: Mapping[str, Any] | None = None  # a layer above's settings, agreed in the call's handshake
    error_feedback: ErrorFeedback | None = None  # the block rows' residual store


@dataclass(frozen=True)
class Request:
    """One call, its arguments checked and its defaults resolved by its route: what every call
    body takes whole (the flat ring's and CERAR's on the communication thread, the hierarchical
    call's, torch's exact one)."""

    tensor: torch.Tensor
    op: str  # "sum" or "avg"
    group: Any
    async_op: bool
    route: str  # the row's name, agreed in the handshake: ranks that call different rows raise
    wire: Wire  # the ring's wire, or CERAR's packets' (the data's own for the rows of no fixed wire)
    nonfinite: str
    max_error: float | None
    stats: CommStats | None = None
    context: Mapping[str, Any] | None = None
    code: Code | None = None  # CERAR's rows: the code, given or the one rule's default
    fresh_scale: bool = False
    ranks_per_node: int | None = None
    error_feedback: ErrorFeedback | None = None
    direct: bool = False  # the direct reduce-scatter instead of the ring (the ``direct-`` rows)

    @property
    def packet_dtype(self) -> torch.dtype | None:
        """CERAR's packet dtype: the wire's, None for the data's own."""
        return getattr(self.wire, "dtype", None)
