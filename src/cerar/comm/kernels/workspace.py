"""Scratch memory the runs reuse across calls (:class:`Workspace`), one for the process."""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["WORKSPACE", "Workspace"]


class Workspace:
    """Named scratch buffers reused across calls.

    Fresh multi-megabyte allocations cost more than the arithmetic done in them (every page is
    faulted in on first touch), so buffers are kept and only grown. ``held_bytes`` is what the
    workspace holds now: the collective's extra memory beyond the caller's tensor. ``bound``
    keeps objects built on views of the buffers (a layout's :class:`Program`), and drops them
    whenever a buffer is replaced or released: they never hold memory the workspace gave up.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.dtype, str], torch.Tensor] = {}
        self.bound: dict[Any, Any] = {}  # e.g. CerarRun by layout (cerar.comm.kernels.cerar_run)

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        key = (name, dtype, str(device))
        size = math.prod(shape)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < size:
            buffer = torch.empty(size, dtype=dtype, device=device)
            self._buffers[key] = buffer
            self._replaced()
        return buffer[:size].view(shape)

    def padded(self, name: str, flat: torch.Tensor, size: int) -> torch.Tensor:
        """``flat`` itself if it holds ``size`` values, else the buffer ``name`` holding a copy of
        it zero padded to ``size`` (a ring's equal chunks)."""
        if flat.numel() == size:
            return flat
        padded = self.get(name, (size,), flat.dtype, flat.device)
        padded[: flat.numel()].copy_(flat)
        padded[flat.numel() :].zero_()
        return padded

    def release(self, name: str) -> None:
        """Drop the buffers called ``name`` (of every dtype and device)."""
        for key in [key for key in self._buffers if key[0] == name]:
            del self._buffers[key]
            self._replaced()

    @property
    def held_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def clear(self) -> None:
        self._buffers.clear()
        self._replaced()

    def _replaced(self) -> None:
        self.bound.clear()


#: One workspace for the process: all cerar calls run on one communication thread.
WORKSPACE = Workspace()
