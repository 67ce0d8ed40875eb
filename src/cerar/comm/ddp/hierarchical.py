"""The state of the hierarchical DDP hooks (``cerar.ddp.hier_cerar_hook`` / ``hier_ring_hook``).

:class:`HierarchicalState` is a :class:`cerar.ddp.CerarState` that also knows the node layout:
``ranks_per_node`` (default: torchrun's ``LOCAL_WORLD_SIZE``), and whose ``code`` is for the
number of *nodes* ``M``, not of ranks, since CERAR runs only between nodes
(:mod:`cerar.comm.collective.hierarchical`). Everything else (bucket policy, resync, statistics,
checkpoints) is :class:`CerarState`'s. Like it, it builds before ``init_process_group`` and
resolves the layout, the default code and its own group at the first bucket.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from cerar.coding.linear_code import Code
from cerar.comm.ddp.state import CerarState
from cerar.comm.runtime.groups import require_initialised
from cerar.comm.runtime.layout import NodeLayout, node_layout
from cerar.comm.runtime.torch_groups import new_group_like

__all__ = ["HierarchicalState"]


class HierarchicalState(CerarState):
    """:class:`CerarState` for the hierarchical hooks.

    Args:
        process_group, nonfinite, min_bucket_bytes, start_iter, resync_every, divergence_tol,
            on_step: as :class:`CerarState`.
        code: a :class:`cerar.Code` for the group's number of nodes ``M`` (``None``: the default
            code for ``M``, resolved at the first bucket).
        ranks_per_node: ranks on each node (consecutive group ranks form a node); ``None``:
            ``LOCAL_WORLD_SIZE`` (default group only), resolved at the first bucket.

    Attributes: those of :class:`CerarState`, plus ``ranks_per_node`` as given and ``layout``,
    this rank's :class:`cerar.comm.runtime.layout.NodeLayout` (``None`` until the first bucket).
    """

    __slots__ = ("layout", "ranks_per_node")
    _NOT_PICKLED = (*CerarState._NOT_PICKLED, "layout")

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        code: Code | None = None,
        *,
        ranks_per_node: int | None = None,
        **settings: object,
    ) -> None:
        if ranks_per_node is not None and (
            isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int) or ranks_per_node < 1
        ):
            raise ValueError(f"Argument 'ranks_per_node' must be a positive integer or None, not {ranks_per_node!r}.")
        self.ranks_per_node: int | None = ranks_per_node
        self.layout: NodeLayout | None = None
        super().__init__(process_group, code, **settings)  # type: ignore[arg-type]

    def __setstate__(self, state: dict[str, object]) -> None:
        super().__setstate__(state)
        self.layout = None

    def resolve_group(self) -> dist.ProcessGroup:
        """The hook's group, created at the first bucket with the layout (the code's ranks: its ``M`` nodes)."""
        if self._comm_group is None:
            require_initialised("HierarchicalState")
            layout = node_layout(self.process_group, self.ranks_per_node)
            if layout is None:
                raise RuntimeError("HierarchicalState: this rank is not a member of its process group.")
            self.layout = layout
            self.ranks_per_node = layout.ranks_per_node
            self.world_size = layout.world_size
            self._comm_group = new_group_like(self.process_group)
        return self._comm_group

    @property
    def code_ranks(self) -> int | None:
        """The ranks the code is for: the group's nodes (known from the first bucket)."""
        return None if self.layout is None else self.layout.nodes

    def call_settings(self) -> dict[str, Any]:
        return {**super().call_settings(), "ranks_per_node": self.ranks_per_node}

    def __repr__(self) -> str:
        return super().__repr__().replace("CerarState(", f"HierarchicalState(ranks_per_node={self.ranks_per_node}, ", 1)
