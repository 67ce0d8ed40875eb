"""The all-reduce methods ``cerar bench`` compares: one :class:`AllReduceMethod` per row of the route
table (:mod:`cerar.comm.collective.routes`), the exact row under the bench's name ``builtin``.

``--methods`` takes the rows' names and the bench's own names (:data:`ALIASES`: ``exact`` is
``builtin``); the results, tables and plots name a method by the bench's name, whichever was typed,
so old results and new ones read alike (:func:`canonical_name`, :func:`method_names`).

A row says how to call it, how many bytes and rounds it needs in theory and whether its transport
reports the bytes it really sent; a method added to the table is a method of the bench.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cerar.coding.linear_code import Code
    from cerar.comm.runtime.stats import CommStats

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
        transport_stats: the method fills a :class:`cerar.comm.runtime.stats.CommStats` (bytes measured at
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
        options: case keys passed to ``call`` as keywords (``auto``: ``max_error``, its budget;
            every other method runs with ``max_error=None``: the bench measures its error).
        family: the route table's family of the row (``"ring"``, ``"cerar"``, ``"hier-ring"``,
            ``"exact"``, ``"torch"``, ``"auto"``...): which coding, if any, the method's limit
            counts (:mod:`cerar.experiments.bench.limit`).
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
    family: str = ""

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


BASELINE = "builtin"
#: The rows the bench calls by another name: ``--methods`` takes either, the results keep the bench's.
ALIASES = {"exact": BASELINE}


def _ranks_per_node() -> int | None:
    """The launcher's ``CERAR_RANKS_PER_NODE`` (else None: torchrun's ``LOCAL_WORLD_SIZE``)."""
    import os

    text = os.environ.get("CERAR_RANKS_PER_NODE")
    return int(text) if text else None


def _call(row: str) -> Call:
    """``call(tensor, code, stats, **options)``: one sum by the route table's row ``row``, which
    takes what applies to it (the launcher's nodes, the code).

    The bench measures every row's error rather than enforce a budget: it calls each row with
    ``max_error=None`` (a row whose predicted error exceeds the library's default budget, such as
    ``ring-int4``, runs all the same), except ``auto``, whose ``max_error`` is its budget, one of
    its options (:attr:`AllReduceMethod.options`), and otherwise the library's default."""

    def call(tensor: Any, code: Code | None, stats: CommStats | None, **options: Any) -> None:
        from cerar.comm.collective.routes import get_route, start

        route = get_route(row)
        budget = {} if route.family == "auto" else {"max_error": None}  # auto: its budget, or the default
        # The nodes: read as the rank runs.
        given = {"code": code, "ranks_per_node": _ranks_per_node(), **budget, **options}
        start(route, tensor, stats=stats, **route.applicable(given))

    return call


def _auto_calibrating(tensor: Any, max_error: float | None = None) -> bool:
    """Whether ``method="auto"`` has not yet decided for this tensor's size and budget."""
    from cerar.comm.auto.collective import auto_status

    for stream in auto_status():
        if stream["numel"] == tensor.numel() and stream["max_error"] == max_error:
            return not stream["decided"]
    return True


def _rounds(coded: bool) -> Callable[[int, int | None], int]:
    def rounds(n: int, c: int | None) -> int:
        return c + n - 2 if coded and c else 2 * (n - 1)

    return rounds


def _methods() -> dict[str, AllReduceMethod]:
    """Every row of the route table as a method of the bench (``exact`` under its bench name,
    ``builtin``; ``auto`` run untimed while it calibrates)."""
    import cerar.comm.auto.collective  # noqa: F401 (registers the auto row)
    from cerar.comm.collective.routes import ROUTES, WIRE_BYTES

    methods = {}
    for route in ROUTES.values():
        name = ALIASES.get(route.name, route.name)
        auto = route.family == "auto"
        methods[name] = AllReduceMethod(
            name,
            "torch.distributed.all_reduce on Gloo (the baseline)" if name == BASELINE else route.description,
            _call(route.name),
            coded=route.coded,
            transport_stats=route.transport == "cerar",
            wire_bytes_per_value=WIRE_BYTES.get(route.wire or "fp32", 4.0),
            traffic=route.values,
            rounds=_rounds(route.coded),
            requires=None,
            packet_precision=route.wire or "fp32",
            hierarchical=route.hierarchical,
            options=("max_error",) if auto else (),
            calibrating=_auto_calibrating if auto else None,
            family=route.family,
        )
    return methods


ALL_REDUCE_METHODS: dict[str, AllReduceMethod] = _methods()


def canonical_name(name: str) -> str:
    """The bench's name of the method ``name`` (a row's name or the bench's: ``exact`` is
    ``builtin``); an unknown name raises ``ValueError`` naming the argument, the value and the
    names accepted."""
    canonical = ALIASES.get(name, name)
    if canonical not in ALL_REDUCE_METHODS:
        raise ValueError(f"Argument 'methods' must name methods among {method_names()}, not {name!r}.")
    return canonical


def method_names() -> str:
    """The names ``--methods`` accepts, in the route table's order, a row the bench calls otherwise
    with the bench's name: ``exact (= builtin), torch-fp16, ...``."""
    rows = {bench: row for row, bench in ALIASES.items()}
    return ", ".join(f"{rows[name]} (= {name})" if name in rows else name for name in ALL_REDUCE_METHODS)


def get_method(name: str) -> AllReduceMethod:
    """The registered method called ``name`` (or by its row's name, :data:`ALIASES`)."""
    return ALL_REDUCE_METHODS[canonical_name(name)]
