"""The side group on which ``method="auto"``'s ranks agree: a Gloo group over the caller's ranks,
made once by every member at the same point, so that nothing is added on the caller's group.
:meth:`SideGroup.max` agrees a round's times, :meth:`SideGroup.check` a DDP state's settings.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from cerar.comm.runtime.handshake import SettingsMismatchError, settings_hash
from cerar.comm.runtime.torch_groups import new_group_like

__all__ = ["SideGroup"]


class SideGroup:
    """A Gloo group over ``process_group``'s ranks (see the module doc)."""

    def __init__(self, process_group: dist.ProcessGroup | None) -> None:
        self.group = new_group_like(process_group, backend="gloo")
        self.calls = 0

    def max(self, values: Sequence[float]) -> list[float]:
        """The elementwise maximum over the ranks."""
        tensor = torch.tensor(list(values), dtype=torch.float64)
        if tensor.numel():
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group)
        return tensor.tolist()

    def check(self, what: str, settings: Mapping[str, Any]) -> None:
        """Raise :class:`SettingsMismatchError` on every rank if any rank's ``settings`` (plain,
        ``repr``-able values) or count of checks differs, naming the first setting that differs
        and each rank's value."""
        self.calls += 1
        h = settings_hash(tuple(sorted((k, repr(v)) for k, v in settings.items())))
        agreed = self.max([h, -h, float(self.calls), -float(self.calls)])
        if agreed[0] == -agreed[1] and agreed[2] == -agreed[3]:
            return
        gathered: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(gathered, (dict(settings), self.calls), group=self.group)
        keys = list(dict.fromkeys(k for s, _ in gathered for k in s))
        key = next((k for k in keys if len({repr(s.get(k)) for s, _ in gathered}) > 1), None)
        if key is not None:  # the first setting that differs
            values = ", ".join(f"rank {r}: {s.get(key)!r}" for r, (s, _) in enumerate(gathered))
            raise SettingsMismatchError(f"cerar: ranks called {what} with different {key}: {values}")
        counts = ", ".join(f"rank {r}: {n}" for r, (_, n) in enumerate(gathered))
        raise SettingsMismatchError(f"cerar: ranks called {what} different numbers of times (a call skipped): {counts}")
