"""What ``cerar bench`` measures: :class:`BenchConfig`, checked when built, whose flagged
fields are the command's options (:mod:`cerar.experiments._flags`), and the size notation.

Sizes are bytes of float32 written ``64K``, ``1M``, ``16M`` (powers of 1024), as the command
line and the table show them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cerar._checks import check_choice, check_float, check_int, format_size, parse_size
from cerar.coding import codes
from cerar.coding.linear_code import MAX_ERROR
from cerar.experiments._flags import flag
from cerar.experiments.bench.methods import BASELINE, canonical_name, get_method, method_names
from cerar.harness import netem
from cerar.harness.launch import DEFAULT_RATE, LAUNCHERS, RENDEZVOUS

__all__ = [
    "DEFAULT_SIZES",
    "QUICK_PRESET",
    "QUICK_SIZES",
    "REGIME_CHOICES",
    "BenchConfig",
    "format_size",
    "parse_size",
]

REGIME_CHOICES = ("fast", "slow", "both")
DEFAULT_METHODS = (
    "builtin", "ring-fp16", "ring-bf16", "ring-int8", "direct-int8", "ring-int4", "direct-int4", "cerar", "cerar-fp16",
    "auto",
)  # fmt: skip
NODE_METHODS = ("builtin", "ring", "cerar", "hier-ring", "hier-cerar")  # the default with --ranks-per-node > 1
MiB = 1 << 20
DEFAULT_SIZES = (1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB)
#: From this size up a case runs ``iters`` timed iterations (:meth:`BenchConfig.iterations_for`).
FULL_ITERS_BYTES = 16 * MiB
#: A smaller size runs at most this many times ``iters``.
MAX_ITERS_FACTOR = 12
QUICK_SIZES = (64 << 10, 256 << 10)


# Parsers of the comma-list options: applied when the config is built, so a bad value is a
# ValueError naming the argument (``cerar`` prints it and exits 2), as in Python.
def _sizes(text: str) -> tuple[int, ...]:
    return tuple(parse_size(s) for s in text.split(",") if s.strip())


def _components(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise ValueError(f"Argument 'components' must be a comma list of integers, not {text!r}.") from None


def _names(text: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in text.split(",") if v.strip())


def _regimes(text: str) -> tuple[str, ...]:
    return ("fast", "slow") if text == "both" else (text,)


def _sizes_text(sizes: tuple[int, ...]) -> str:
    return ",".join(format_size(s) for s in sizes)


@dataclass(frozen=True)
class BenchConfig:
    """What to measure, checked when built: bad values raise ``ValueError``/``TypeError``
    naming the argument and the value.

    ``components=None`` becomes ``(2N,)`` (with nodes: ``(2M, 2N)``); sizes are sorted and
    repeated ones dropped. Emulated nodes: ``nodes=M`` sets ``world_size`` to ``M x
    ranks_per_node``; ``ranks_per_node=G`` alone takes ``M = N / G``. The hierarchical methods'
    codes are for ``M`` (``hier-cerar``), the flat ones' for ``N``.
    ``regimes`` lists ``"fast"`` and/or ``"slow"``; ``timeout_s=None`` sizes the limit of each
    regime's run from the cases (generously: it only exists to stop a hung run).
    """

    world_size: int = field(default=4, metadata=flag("ranks (set by --nodes x --ranks-per-node)", short="-N"))
    nodes: int | None = field(
        default=None,
        metadata=flag("emulated nodes M, each one namespace of G ranks with one link", default_text="N / G"),
    )
    ranks_per_node: int = field(default=1, metadata=flag("ranks per emulated node G (1: a namespace per rank)"))
    sizes_bytes: tuple[int, ...] = field(
        default=DEFAULT_SIZES,
        metadata=flag(
            "message sizes, e.g. 1M,4M,16M",
            name="--sizes",
            parse=_sizes,
            default_text=f"{_sizes_text(DEFAULT_SIZES)}; --quick {_sizes_text(QUICK_SIZES)}",
        ),
    )
    components: tuple[int, ...] | None = field(
        default=None, metadata=flag("c values for cerar, e.g. 4,8", short="-c", parse=_components, default_text="2N")
    )
    constructions: tuple[str, ...] = field(
        default=("perturbed",),
        metadata=flag(
            f"comma list of {', '.join(codes.CONSTRUCTIONS)}",
            name="--construction",
            parse=_names,
            default_text="perturbed",
        ),
    )
    methods: tuple[str, ...] = field(
        default=DEFAULT_METHODS,
        metadata=flag(
            f"comma list of the route table's rows, each '= the bench's name' where it has one (the name the "
            f"results, table and plots keep, whichever was typed): {method_names()}",
            parse=_names,
            default_text=f"{','.join(DEFAULT_METHODS)}; with nodes {','.join(NODE_METHODS)}",
        ),
    )
    regimes: tuple[str, ...] = field(
        default=("fast", "slow"),
        metadata=flag(
            "network regime(s)", name="--regime", parse=_regimes, choices=REGIME_CHOICES, default_text="both"
        ),
    )
    launcher: str = field(
        default="direct",
        metadata=flag(
            "direct: start every rank; torchrun: one torchrun --nnodes M --nproc-per-node G agent per node",
            choices=LAUNCHERS,
        ),
    )
    rdzv: str = field(default="c10d", metadata=flag("torchrun's rendezvous at node 0", choices=RENDEZVOUS))
    rate: str = field(default=DEFAULT_RATE, metadata=flag("slow: per-rank (with nodes: per-node) link rate"))
    delay: str = field(default="0ms", metadata=flag("slow: added latency per link (needs netem)"))
    iters: int = field(
        default=5,
        metadata=flag("timed iterations from 16 MB; smaller sizes up to 12x more", default_text="5; --quick 2"),
    )
    warmup: int = field(default=1, metadata=flag("warm-up iterations"))
    seed: int = field(default=0, metadata=flag("seed of the inputs"))
    auto_max_error: float = field(default=MAX_ERROR, metadata=flag("auto: the error budget (max_error)"))
    timeout_s: float | None = field(
        default=None, metadata=flag("seconds per regime", name="--timeout", default_text="from the sizes")
    )
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        g = check_int("ranks_per_node", self.ranks_per_node, minimum=1)
        if self.nodes is not None:
            object.__setattr__(self, "world_size", check_int("nodes", self.nodes, minimum=1) * g)
        n = check_int("world_size", self.world_size, minimum=2)
        if n % g:
            raise ValueError(f"Argument 'ranks_per_node' must divide world_size {n}, not {g}.")
        object.__setattr__(self, "nodes", n // g)
        # The bench's names (exact: builtin), each once: the name the results keep.
        object.__setattr__(self, "methods", tuple(dict.fromkeys(canonical_name(name) for name in self.methods)))
        if g > 1 and tuple(self.methods) == DEFAULT_METHODS:  # nodes: compare the hierarchical methods too
            object.__setattr__(self, "methods", NODE_METHODS)
        hierarchical = [name for name in self.methods if get_method(name).hierarchical]
        if hierarchical and n // g < 2:
            raise ValueError(f"Argument 'nodes' must be at least 2 for methods {hierarchical}, not {n // g}.")
        if not self.sizes_bytes:
            raise ValueError("Argument 'sizes' must list at least one size, not ().")
        for size in self.sizes_bytes:
            check_int("sizes", size, minimum=4)
            if size % 4:
                raise ValueError(f"Argument 'sizes' must be multiples of 4 bytes (float32), not {size}.")
        default = (2 * n,) if g == 1 else tuple(sorted({2 * (n // g), 2 * n}))
        comps = self.components if self.components is not None else default
        for c in comps:
            check_int("components", c, minimum=1)
        for name in self.constructions:
            check_choice("construction", name, codes.CONSTRUCTIONS)
            if name == "exact" and any(c != n for c in comps):
                raise ValueError(
                    f"Argument 'components' must equal world_size ({n}) for construction 'exact', not {list(comps)}."
                )
        if BASELINE not in self.methods:
            raise ValueError(
                f"Argument 'methods' must include the baseline {BASELINE!r} (the row 'exact'), not {self.methods}."
            )
        if not self.regimes:
            raise ValueError("Argument 'regime' must name at least one regime, not ().")
        for regime in self.regimes:
            check_choice("regime", regime, ("fast", "slow"))
        check_choice("launcher", self.launcher, LAUNCHERS)
        check_choice("rdzv", self.rdzv, RENDEZVOUS)
        netem.check_rate(self.rate)
        netem.check_delay(self.delay)
        check_int("iters", self.iters, minimum=1)
        check_int("warmup", self.warmup, minimum=0)
        check_int("seed", self.seed, minimum=0)
        check_float("auto_max_error", self.auto_max_error, positive=True)
        if self.timeout_s is not None:
            check_float("timeout_s", self.timeout_s, positive=True)
        # Frozen: the normal forms are set once, here.
        object.__setattr__(self, "components", tuple(dict.fromkeys(comps)))
        object.__setattr__(self, "sizes_bytes", tuple(sorted(set(self.sizes_bytes))))
        for name in ("constructions", "methods", "regimes"):
            object.__setattr__(self, name, tuple(getattr(self, name)))

    def iterations_for(self, size_bytes: int) -> int:
        """Timed iterations at ``size_bytes``: ``iters`` from :data:`FULL_ITERS_BYTES` up, and
        below it proportionally more, at most :data:`MAX_ITERS_FACTOR` x ``iters``. A small
        call's time scatters far more (latency, scheduling) and costs little, so its median
        needs more calls to compare methods a few percent apart."""
        scaled = -(-self.iters * FULL_ITERS_BYTES // size_bytes)
        return max(self.iters, min(MAX_ITERS_FACTOR * self.iters, scaled))


#: What ``--quick`` changes (a smoke test); flags given on the command line still win.
QUICK_PRESET: dict[str, Any] = {"sizes_bytes": QUICK_SIZES, "iters": 2}
