"""The packet scale of one CERAR call: the one object that proposes, agrees, checks, redoes and
remembers it (the maths of its window is :mod:`cerar.coding.scaling`).

A call's packets are its increments divided by ``2**e`` (exact). ``e`` starts from the one the
previous call of this size on this ring ended with (:class:`cerar.comm.runtime.groups.GroupState`
remembers it), or, for a narrow format (float16) without one, from the data's largest magnitude
measured before the call; the handshake carries this rank's :meth:`PacketScale.proposal` and
every rank takes what :meth:`PacketScale.agree` makes of the agreed header, so ``e`` is the same
everywhere. The maxima that travel with the rounds (:class:`cerar.comm.runtime.maxima.MaximaChain`)
tell every rank whether the data fitted (:meth:`PacketScale.admits`); if not, the call is redone
at a scale that fits (:meth:`PacketScale.redo`), and the next call of the size starts from
:meth:`PacketScale.remember`'s choice.
"""

from __future__ import annotations

from typing import Any

import torch

from cerar.coding.linear_code import Code
from cerar.coding.precision import precision_name
from cerar.coding.scaling import ScaleWindow, scale_window
from cerar.comm.runtime.groups import group_state
from cerar.comm.runtime.handshake import Agreed, Proposal
from cerar.comm.runtime.links import Ring
from cerar.comm.runtime.maxima import max_abs
from cerar.protocol.schedule import Schedule

__all__ = ["PacketScale", "cerar_scale_window"]

_WINDOWS: dict[tuple[str, str, str], ScaleWindow] = {}


def cerar_scale_window(code: Code, data: torch.dtype, packet: torch.dtype) -> ScaleWindow:
    """The packet scale window of ``code`` for ``data`` (the working dtype) and ``packet``
    (:func:`cerar.coding.scaling.scale_window`), once per (code, dtypes): the same on every rank."""
    key = (code.fingerprint, str(data), str(packet))
    if key not in _WINDOWS:
        gain = Schedule.for_code(code).decode_gain(code)
        _WINDOWS[key] = scale_window(code, precision_name(data), precision_name(packet), gain)
    return _WINDOWS[key]


class PacketScale:
    """The scale ``2**exponent`` of one CERAR call on ``ring`` (see the module doc).

    Attributes:
        window: the code's :class:`cerar.coding.scaling.ScaleWindow` for the call's dtypes.
        key: what the group remembers the scale under: the ring's neighbours, the size, the
            packet precision.
        remembered: the exponent this size's previous call ended with (None: its first call).
        exponent: the call's exponent (the remembered one until :meth:`agree` or :meth:`redo`).
        checked: whether :meth:`admits` checks the maxima (a redo's run writes what it decodes).
    """

    __slots__ = ("_remembered_by", "checked", "exponent", "fresh", "key", "remembered", "window")

    def __init__(self, ring: Ring, code: Code, flat: torch.Tensor, packet: torch.dtype, fresh: bool = False) -> None:
        self.window = cerar_scale_window(code, flat.dtype, packet)
        self.key: tuple[Any, ...] = (ring.send_to, ring.recv_from, flat.numel(), precision_name(packet))
        self._remembered_by = group_state(ring.group).scale_exponents
        self.remembered: int | None = self._remembered_by.get(self.key)
        # fresh: measured from this call's data, as at a size's first call (the remembered scale is
        # kept until the call succeeds, so that a call refused on one rank changes nothing).
        self.fresh = fresh
        self.exponent = self.remembered or 0
        self.checked = True

    def proposal(self, flat: torch.Tensor) -> Proposal:
        """What this rank's handshake header carries: the remembered exponent, and for a narrow
        format with no scale to go by, the data's largest magnitude (one pass here, so that its
        first call does not have to be redone; a wide format starts from 1)."""
        measure = (self.fresh or self.remembered is None) and self.window.target is not None
        return Proposal(max_abs(flat) if measure else 0.0, self.remembered or 0)

    def agree(self, agreed: Agreed) -> None:
        """Take the agreed header's scale: from the largest magnitude some rank measured (the same
        decision everywhere), else the largest exponent proposed."""
        if agreed.max_abs > 0.0:
            self.exponent = self.window.exponent_for(agreed.max_abs)
        else:
            self.exponent = agreed.scale_exponent

    def split(self) -> tuple[int, int]:
        """``(rows, data)`` exponents: the part folded into the rows and the decoder, and the part
        that scales a copy of the input (:meth:`cerar.coding.scaling.ScaleWindow.split`)."""
        return self.window.split(self.exponent)

    def admits(self, largest: float) -> bool:
        """Whether inputs whose largest magnitude over every rank is ``largest`` (finite) fitted
        the packets at this scale (always, after :meth:`redo`)."""
        return not self.checked or self.window.admits(largest, self.exponent)

    def redo(self, largest: float) -> None:
        """The data left the packets' safe range (the same finding on every rank): the scale that
        fits it, for the call's redo."""
        self.exponent = self.window.exponent_for(largest)
        self.checked = False

    def remember(self, largest: float, written: bool) -> None:
        """The next call of this size starts from this call's scale, re-centred if the data has
        drifted (``largest`` is every rank's, so every rank takes the same)."""
        self._remembered_by[self.key] = self.window.follow(largest if written else 0.0, self.exponent)
