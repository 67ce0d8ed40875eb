"""Scratch memory the runs reuse across calls (:class:`Workspace`), one per group's
communication thread (:mod:`cerar.comm.runtime.thread`)."""

from __future__ import annotations

import math
from typing import Any

import torch

from cerar.comm.runtime.thread import RUNNING

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
        self.bound: dict[Any, Any] = {}  # e.g. CerarRun by layout (cerar.comm.algorithms.cerar.run)

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


class _GroupWorkspaces:
    """The workspace of the group whose communication thread is running (:data:`RUNNING`): one
    per group, since two groups' threads run calls at once; the default group's is also the one
    any other thread sees (a caller inspecting what its calls kept)."""

    def __init__(self) -> None:
        self._by_group: dict[Any, Workspace] = {None: Workspace()}

    def current(self) -> Workspace:
        group = getattr(RUNNING, "key", None)
        workspace = self._by_group.get(group)
        if workspace is None:  # only the group's own thread makes it: no race
            workspace = self._by_group[group] = Workspace()
        return workspace

    def clear_all(self) -> None:
        """Drop every group's buffers (``cerar.shutdown``: their threads are gone)."""
        for workspace in self._by_group.values():
            workspace.clear()
        self._by_group = {None: self._by_group[None]}

    # The running group's workspace, as a Workspace answers.
    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self.current().get(name, shape, dtype, device)

    def padded(self, name: str, flat: torch.Tensor, size: int) -> torch.Tensor:
        return self.current().padded(name, flat, size)

    def release(self, name: str) -> None:
        self.current().release(name)

    def clear(self) -> None:
        self.current().clear()

    @property
    def held_bytes(self) -> int:
        return self.current().held_bytes

    @property
    def bound(self) -> dict[Any, Any]:
        return self.current().bound


#: The scratch memory of the running group's calls (see :class:`_GroupWorkspaces`).
WORKSPACE = _GroupWorkspaces()
