"""The all-reduce methods ``cerar bench`` compares: one :class:`AllReduceMethod` entry per method.

Adding a method (say ``ring-fp16``) is one entry in :data:`ALL_REDUCE_METHODS`: how to call it, how many
bytes and rounds the algorithm needs in theory, and whether its transport reports the bytes it
really sent. Nothing here imports torch at module load: the calls import it when they run.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cerar.coding.code import Code
    from cerar.comm.ring.stats import CommStats

Call = Callable[[Any, "Code | None", "CommStats | None"], None]


@dataclass(frozen=True)
class AllReduceMethod:
    """One all-reduce method under test (not to be confused with the training methods, the DDP
    hooks of :data:`cerar.experiments.train.methods.HOOKS`).

    Attributes:
        name: the name in ``--methods``, the table and the JSON (``"builtin"``, ``"cerar"``...).
        description: one line for ``--help`` and the README.
        call: ``call(tensor, code, stats)`` reduces the float32 ``tensor`` in place (sum over
            ranks); ``code`` is the method's code (``None`` unless ``coded``); ``stats``, when the
            method has ``transport_stats``, accumulates the call's bytes and encode/decode times.
        coded: the method takes a :class:`cerar.Code` (one series per ``c`` and construction).
        transport_stats: the method fills a :class:`cerar.comm.ring.stats.CommStats` (bytes measured at
            the transport); otherwise the byte count reported is the algorithm's theory.
        wire_bytes_per_value: bytes per value on the wire (4 for float32, 2 for a 16-bit wire).
        traffic: values sent per rank per value reduced, as a function of ``(N, c)``.
        rounds: sequential message rounds per call, as a function of ``(N, c)``.
        requires: a module that must be importable for the method to exist (else it is skipped).
        packet_precision: the precision the method's codes are designed for (``"fp32"``, or
            ``"fp16"``/``"bf16"`` for CERAR with 16-bit packets).
        hierarchical: exact inside each node, the algorithm only between nodes
            (:mod:`cerar.comm.collective.hierarchical`): ``traffic`` and ``rounds`` are then functions of the
            number of nodes ``M`` (and the code is for ``M``), and each rank sends ``1/G`` of it.
        options: case keys passed to ``call`` as keywords (``auto``: ``max_error``).
        calibrating: ``calibrating(tensor, **options)`` is True while the method still calibrates
            for this size (``auto``): the worker runs such calls untimed, before the warm-up.
    """

    name: str
    description: str
    call: Call
    coded: bool = False
    transport_stats: bool = True
    wire_bytes_per_value: float = 4.0
    traffic: Callable[[int, int | None], float] = lambda n, c: 2.0 * (n - 1) / n
    rounds: Callable[[int, int | None], int] = lambda n, c: 2 * (n - 1)
    requires: str | None = "cerar.comm.collective.api"
    packet_precision: str = "fp32"
    hierarchical: bool = False
    options: tuple[str, ...] = ()
    calibrating: Callable[..., bool] | None = None

    def ring_size(self, world_size: int, ranks_per_node: int = 1) -> int:
        """The size of the ring the algorithm runs on: ``M`` nodes if hierarchical, else ``N``."""
        return world_size // ranks_per_node if self.hierarchical else world_size

    def theory_bytes_per_rank(
        self, size_bytes: int, world_size: int, components: int | None, ranks_per_node: int = 1
    ) -> float:
        """Bytes each rank sends for a ``size_bytes`` float32 message, in theory (hierarchical
        methods: between nodes only, ``1/G`` of the node's)."""
        if self.hierarchical:
            return self.theory_bytes_per_node(size_bytes, world_size, components, ranks_per_node) / ranks_per_node
        values = size_bytes / 4.0
        return values * self.traffic(world_size, components) * self.wire_bytes_per_value

    def theory_bytes_per_node(
        self, size_bytes: int, world_size: int, components: int | None, ranks_per_node: int = 1
    ) -> float:
        """Bytes that leave each node over its link, in theory. Flat methods: the node's last
        rank's (the one ring hop out of the node): ``2(N-1)/N`` values per value for the ring,
        ``1 + (N-2)/c`` for CERAR. Hierarchical: the ``G`` rings between nodes, ``2(M-1)/M``
        and ``1 + (M-2)/c``."""
        values = size_bytes / 4.0
        n = self.ring_size(world_size, ranks_per_node)
        if n < 2:
            return 0.0
        return values * self.traffic(n, components) * self.wire_bytes_per_value

    def available(self) -> bool:
        """Whether the code this method needs exists in this installation."""
        return self.requires is None or importlib.util.find_spec(self.requires) is not None


def _builtin(tensor: Any, code: Code | None, stats: CommStats | None) -> None:
    import torch.distributed as dist

    dist.all_reduce(tensor)


def _ring(tensor: Any, code: Code | None, stats: CommStats | None) -> None:
    from cerar.comm.collective.api import ring_all_reduce

    ring_all_reduce(tensor, stats=stats)


def _ring_16(wire: str) -> Call:
    def call(tensor: Any, code: Code | None, stats: CommStats | None) -> None:
        import torch

        from cerar.comm.collective.api import ring_all_reduce

        ring_all_reduce(tensor, wire_dtype=getattr(torch, wire), stats=stats)

    return call


def _cerar(tensor: Any, code: Code | None, stats: CommStats | None) -> None:
    from cerar.comm.collective.api import all_reduce

    all_reduce(tensor, code=code, stats=stats)


def _cerar_16(packet: str) -> Call:
    def call(tensor: Any, code: Code | None, stats: CommStats | None) -> None:
        import torch

        from cerar.comm.collective.api import all_reduce

        all_reduce(tensor, code=code, packet_dtype=getattr(torch, packet), stats=stats)

    return call


def _auto(tensor: Any, code: Code | None, stats: CommStats | None, max_error: float | None = None) -> None:
    from cerar.comm.auto.collective import auto_all_reduce  # what all_reduce(method="auto") runs

    auto_all_reduce(tensor, max_error=max_error, stats=stats)


def _auto_calibrating(tensor: Any, max_error: float | None = None) -> bool:
    """Whether ``method="auto"`` has not yet decided for this tensor's size and budget."""
    from cerar.comm.auto.collective import auto_status

    for stream in auto_status():
        if stream["numel"] == tensor.numel() and stream["max_error"] == max_error:
            return not stream["decided"]
    return True


def _ranks_per_node() -> int | None:
    """The launcher's ``CERAR_RANKS_PER_NODE`` (else None: torchrun's ``LOCAL_WORLD_SIZE``)."""
    import os

    text = os.environ.get("CERAR_RANKS_PER_NODE")
    return int(text) if text else None


def _hier_ring(tensor: Any, code: Code | None, stats: CommStats | None) -> None:
    from cerar.comm.collective.hierarchical import hierarchical_ring_all_reduce

    hierarchical_ring_all_reduce(tensor, ranks_per_node=_ranks_per_node(), stats=stats)


def _hier_cerar(tensor: Any, code: Code | None, stats: CommStats | None) -> None:
    from cerar.comm.collective.hierarchical import hierarchical_all_reduce

    hierarchical_all_reduce(tensor, ranks_per_node=_ranks_per_node(), code=code, stats=stats)


def _cerar_traffic(n: int, c: int | None) -> float:
    assert c is not None
    return (c + n - 2) / c


def _cerar_rounds(n: int, c: int | None) -> int:
    assert c is not None
    return c + n - 2


ALL_REDUCE_METHODS: dict[str, AllReduceMethod] = {
    m.name: m
    for m in (
        AllReduceMethod(
            "builtin",
            "torch.distributed.all_reduce on Gloo (the baseline)",
            _builtin,
            transport_stats=False,
            requires=None,
        ),
        AllReduceMethod("ring", "cerar's exact ring (reduce-scatter + all-gather) on cerar's transport", _ring),
        AllReduceMethod(
            "ring-fp16",
            "the exact ring sending float16 (power-of-two scaled), accumulating in float32",
            _ring_16("float16"),
            wire_bytes_per_value=2.0,
        ),
        AllReduceMethod(
            "ring-bf16",
            "the exact ring sending bfloat16, accumulating in float32",
            _ring_16("bfloat16"),
            wire_bytes_per_value=2.0,
        ),
        AllReduceMethod(
            "cerar",
            "CERAR, one series per c and construction",
            _cerar,
            coded=True,
            traffic=_cerar_traffic,
            rounds=_cerar_rounds,
        ),
        AllReduceMethod(
            "cerar-fp16",
            "CERAR with float16 packets (power-of-two scaled; codes designed for float16), decoded in float64",
            _cerar_16("float16"),
            coded=True,
            wire_bytes_per_value=2.0,
            traffic=_cerar_traffic,
            rounds=_cerar_rounds,
            packet_precision="fp16",
        ),
        AllReduceMethod(
            "cerar-bf16",
            "CERAR with bfloat16 packets (codes designed for bfloat16), decoded in float64",
            _cerar_16("bfloat16"),
            coded=True,
            wire_bytes_per_value=2.0,
            traffic=_cerar_traffic,
            rounds=_cerar_rounds,
            packet_precision="bf16",
        ),
        AllReduceMethod(
            "auto",
            "cerar.all_reduce(method='auto'): the fastest of builtin, ring-fp16, cerar, cerar-fp16 within "
            "--auto-max-error, decided from its own calls (calibration untimed)",
            _auto,
            options=("max_error",),
            calibrating=_auto_calibrating,
        ),
        AllReduceMethod(
            "hier-ring",
            "exact reduce-scatter in each node, cerar's exact ring between nodes, all-gather in each node",
            _hier_ring,
            requires="cerar.comm.collective.hierarchical",
            hierarchical=True,
        ),
        AllReduceMethod(
            "hier-cerar",
            "exact reduce-scatter in each node, CERAR (a code for M nodes) between nodes, all-gather in each node",
            _hier_cerar,
            coded=True,
            traffic=_cerar_traffic,
            rounds=_cerar_rounds,
            requires="cerar.comm.collective.hierarchical",
            hierarchical=True,
        ),
    )
}
BASELINE = "builtin"


def get_method(name: str) -> AllReduceMethod:
    """The registered method called ``name``."""
    if name not in ALL_REDUCE_METHODS:
        listed = ", ".join(repr(m) for m in ALL_REDUCE_METHODS)
        raise ValueError(f"Argument 'methods' must name methods among {listed}, not {name!r}.")
    return ALL_REDUCE_METHODS[name]
