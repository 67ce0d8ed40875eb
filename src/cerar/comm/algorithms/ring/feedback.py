"""Error feedback for the block wires: each rank keeps what its quantizer rounded away and adds
it to what it quantizes next time, so the error of the sum over many calls stays bounded
instead of growing with the calls (the form of 1-bit Adam, LoCo and ZeRO++'s qgZ).

A rank quantizes each value of a call once per chunk in either shape, so one residual of the
padded tensor's size holds it all: on the ring (:func:`cerar.comm.algorithms.ring.program.run_ring`)
the residual of chunk ``j`` is what this rank's hop on chunk ``j`` rounded away (its own chunk in
round 1, a partial sum at a later hop, the full sum at the owner); in the direct shape
(:func:`cerar.comm.algorithms.ring.direct.run_direct`) that of its own gradient's chunk ``j`` sent
to owner ``j``, and at its own chunk that of the sum it owns. The residuals differ from rank to
rank; the sums every rank ends with are still bitwise the same (each rank decodes the owner's
packet). A residual is kept in the caller's units (not the call's power-of-two prescale) and
never holds NaN or Inf: a call whose inputs held one zeroes the residual's non-finite entries.

:class:`ErrorFeedback` (``cerar.ErrorFeedback``) is one stream's store: the residual of one
tensor all-reduced call after call by one method on one group. A call finds its residual in the
store it is given; a store that holds another stream's residual (another method, size or group)
is refused with the two named, as is a store given to two calls at once. Pass one store per
tensor, and :meth:`ErrorFeedback.reset` it when its tensor's layout changes or the replicas are
re-synchronised.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

__all__ = ["ErrorFeedback", "check_residual", "feedback_encode"]


class ErrorFeedback:
    """The error-feedback residual of one stream of calls (see the module doc).

    Attributes:
        identity: ``(method, values, ranks)`` of the stream it holds, None while empty.
        residual: float32, the padded tensor's size, on the tensor's device; None while empty.
    """

    def __init__(self) -> None:
        self.identity: tuple[str, int, int] | None = None
        self.residual: torch.Tensor | None = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        held = "empty" if self.identity is None else "method {!r}, {} values, {} ranks".format(*self.identity)
        return f"ErrorFeedback({held})"

    @property
    def nbytes(self) -> int:
        """Bytes the residual holds (0 while empty)."""
        return 0 if self.residual is None else self.residual.numel() * self.residual.element_size()

    def check(self, method: str, values: int, ranks: int) -> None:
        """Refuse a call this store cannot serve (on the caller's thread, before it is queued)."""
        identity = (method, values, ranks)
        if self.identity is not None and self.identity != identity:
            raise ValueError(
                f"Argument 'error_feedback' holds the residual of a call of method {self.identity[0]!r} on "
                f"{self.identity[1]} values over {self.identity[2]} ranks, not of this call (method {method!r}, "
                f"{values} values over {ranks} ranks): pass one cerar.ErrorFeedback() per tensor, or reset() it "
                f"when the tensor's layout changes."
            )

    def take(self, method: str, values: int, ranks: int, padded: int, device: torch.device) -> torch.Tensor:
        """The residual for this call (zeros the first time), held until :meth:`give_back`."""
        self.check(method, values, ranks)
        if not self._lock.acquire(blocking=False):
            raise ValueError(
                "Argument 'error_feedback' is in use by a call still in flight: pass one cerar.ErrorFeedback() "
                "per tensor (two calls in flight cannot share a residual)."
            )
        residual = self.residual
        if residual is None or residual.numel() != padded:
            residual = torch.zeros(padded, dtype=torch.float32, device=device)
        elif residual.device != device:  # loaded from a checkpoint
            residual = residual.to(device)
        self.identity, self.residual = (method, values, ranks), residual
        return residual

    def give_back(self, nonfinite: bool) -> None:
        """End the call that took the residual; ``nonfinite``: an input held NaN or Inf, so the
        residual's non-finite entries are zeroed (they never carry into the next call)."""
        try:
            if nonfinite and self.residual is not None:
                self.residual.masked_fill_(~torch.isfinite(self.residual), 0.0)
        finally:
            self._lock.release()

    def reset(self) -> None:
        """Drop the residual: the next call starts from none (a new layout, a re-sync)."""
        self.identity, self.residual = None, None

    def state_dict(self) -> dict[str, Any]:
        """The residual and its stream, for a checkpoint (a CPU copy; waits for a call in flight)."""
        with self._lock:
            residual = None if self.residual is None else self.residual.detach().cpu().clone()
            return {"identity": self.identity, "residual": residual}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (the residual moves to the tensor's device on
        the next call)."""
        identity, residual = state.get("identity"), state.get("residual")
        if (identity is None) != (residual is None):
            raise ValueError(f"Argument 'state' must hold both an identity and a residual or neither, not {state!r}.")
        if residual is not None and (not isinstance(residual, torch.Tensor) or residual.dtype != torch.float32):
            raise ValueError(f"Argument 'state' must hold a float32 residual, not {type(residual).__name__}.")
        self.identity = None if identity is None else tuple(identity)  # type: ignore[assignment]
        self.residual = None if residual is None else residual.clone()


def feedback_encode(
    codec: Any, value: torch.Tensor, residual: torch.Tensor, packet: torch.Tensor, sent: torch.Tensor | None = None
) -> None:
    """Encode ``value + residual`` into ``packet`` and keep what was rounded away in ``residual``;
    ``sent``, if given, gets what the packet decodes to (the owner keeps it). ``value`` is
    scratch: it ends holding ``value + residual``."""
    value.add_(residual)
    codec.encode(value, packet)
    codec.decode(packet, residual)
    residual.sub_(value).neg_()
    if sent is not None:
        codec.decode(packet, sent)


def check_residual(residual: torch.Tensor | None, size: int) -> None:
    """Refuse a residual that is not float32 of the padded tensor's ``size``."""
    if residual is not None and (residual.numel() != size or residual.dtype != torch.float32):
        have = f"{residual.dtype} of {residual.numel()} values"
        raise ValueError(f"Argument 'residual' must be float32 of {size} values, not {have}.")
