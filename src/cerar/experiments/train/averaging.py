"""How ``localsgd`` and ``diloco`` average one flat float32 tensor over the ranks, and its bytes.

==============  ============================================================  ========
method          average of ``x`` (in place)                                   bytes
==============  ============================================================  ========
``allreduce``   ``x /= N``, ``dist.all_reduce(x)`` (as torch's averager)      computed
``fp16``        ``x`` cast to float16, ``/= N``, ``dist.all_reduce``, cast    computed
``bf16``        back (as torch's ``fp16_compress_hook`` does a bucket)
``ring``        :func:`cerar.ring_all_reduce` ``(x, "avg")``                  measured
``int8``        the same with ``wire_dtype=torch.int8`` (``fp8``: float8      measured
                e4m3; ``int4``: the row ``ring-int4``), the block rings,
                the config's ``nonfinite`` policy
``direct-int8`` :func:`cerar.all_reduce` by that row (``direct-int4``), with a measured
                :class:`cerar.ErrorFeedback` of the averager's under ``+ef``
``cerar``       :func:`cerar.all_reduce` ``(x, "avg")`` with the hook's code  measured
                (``perturbed(N, c)``, 16-bit packets: ``optimized(N, c)``)
                and the config's ``nonfinite`` policy
==============  ============================================================  ========

Each runs its row of the route table (:data:`cerar.experiments.train.installed.ROWS`). Every
method but ``cerar`` leaves every rank with the same values; CERAR's
ranks decode slightly different ones (within the code's error of the mean). Computed bytes use
the ring formula of :func:`cerar.experiments.train.methods.ring_bytes`; measured ones are
:class:`cerar.comm.runtime.stats.CommStats`'. Calls come from the training loop's thread after the
optimizer step, with no DDP bucket in flight, so they run on the default group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from cerar.comm.algorithms.ring.feedback import ErrorFeedback
from cerar.comm.runtime.dtypes import DTYPES
from cerar.comm.runtime.stats import CommStats
from cerar.experiments.train.installed import BLOCK_METHODS, ROWS, HookSettings, cerar_code, ring_bytes

__all__ = ["FlatAverager"]


class FlatAverager:
    """Average a flat tensor through one method, counting what it sends.

    Attributes:
        method: ``allreduce``, ``fp16``, ``bf16``, ``ring`` or ``cerar``.
        identical: every rank ends a call with the same values (all but ``cerar``).
        measured: the bytes are the transport's (``ring``, ``cerar``), not the ring formula's.
        stats: ``ring``/``cerar``'s :class:`~cerar.comm.runtime.stats.CommStats` (bytes, coding time,
            fallbacks, rescales), summed over the calls.
        bytes_computed: the ring formula's bytes of the Gloo collectives (the averages of
            ``allreduce``/``fp16``/``bf16`` and every method's one-value finiteness vote).
        calls: averages made.
        description: the method in words, for the report.
    """

    __slots__ = (
        "bytes_computed", "calls", "code", "description", "feedback", "identical", "measured", "method",
        "nonfinite", "packet_dtype", "stats", "world_size",
    )  # fmt: skip

    def __init__(self, config: HookSettings, world_size: int) -> None:
        self.method = config.method
        self.world_size = world_size
        self.identical = self.method != "cerar"
        self.measured = self.method in ("ring", "cerar", *BLOCK_METHODS)
        # Error feedback (+ef): one residual for the one flat tensor this averager sees.
        self.feedback = ErrorFeedback() if getattr(config, "error_feedback", False) else None
        self.stats = CommStats()
        self.bytes_computed = 0
        self.calls = 0
        self.nonfinite = config.nonfinite
        self.code = None
        self.packet_dtype = None
        if self.method == "cerar":
            components = config.components if config.components is not None else 2 * world_size
            precision = config.packet or "fp32"
            self.code = cerar_code(world_size, components, precision)
            self.packet_dtype = None if precision == "fp32" else DTYPES[precision]  # None: float32's own
            packets = "" if precision == "fp32" else f", {precision} packets"
            self.description = f"cerar.all_reduce{packets}, {self.code!r}, nonfinite={self.nonfinite!r}"
        else:
            self.description = {
                "allreduce": "dist.all_reduce (exact)",
                "fp16": "dist.all_reduce in float16",
                "bf16": "dist.all_reduce in bfloat16",
                "ring": "cerar.ring_all_reduce (exact ring, cerar transport)",
                "int8": "cerar.ring_all_reduce, int8 blocks (the 8-bit ring)",
                "fp8": "cerar.ring_all_reduce, float8 e4m3 blocks (the 8-bit ring)",
            }.get(self.method, f"cerar.all_reduce(method={ROWS[self.method]!r}), block-quantized")
            if self.feedback is not None:
                self.description += ", error feedback"

    @property
    def bytes_sent(self) -> int:
        """Bytes this rank sent in all calls: measured plus computed."""
        return self.stats.bytes_sent + self.bytes_computed

    def __call__(self, flat: torch.Tensor) -> None:
        """Replace ``flat`` (1-D float32, the same size on every rank) by its mean over the ranks.

        A collective: every rank calls it with the same size."""
        from cerar.comm.collective.routes import route_for, start

        self.calls += 1
        n = self.world_size
        route = route_for(ROWS[self.method], self.packet_dtype)
        given = {"code": self.code, "nonfinite": self.nonfinite, "max_error": None}  # quality: the loss
        given["error_feedback"] = self.feedback
        if route.transport == "cerar":  # torch's collectives: counted below, by the ring formula
            given["stats"] = self.stats
        start(route, flat, "avg", **route.applicable(given))
        if route.transport == "torch":  # Gloo's collectives: the ring formula's bytes
            self.bytes_computed += ring_bytes(n, flat.numel(), 4 if route.wire == "fp32" else 2)

    def all_finite(self, flat: torch.Tensor) -> bool:
        """Whether ``flat`` is finite on every rank: one exact all-reduce of a flag, so every rank
        decides the same even where CERAR's ranks decoded different values."""
        bad = torch.tensor([0.0 if bool(torch.isfinite(flat).all()) else 1.0])
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        self.bytes_computed += ring_bytes(self.world_size, 1, bad.element_size())
        return float(bad) == 0.0
