"""The limit a call's coding is judged against: the bytes it must move, at the machine's copy speed.

A call's coding (``CommStats.encode_s + decode_s``) is memory-bound arithmetic, so the floor for
any implementation is the memory traffic it cannot avoid, at the rate this machine copies memory.
CERAR's coding (``s_x``: the data's bytes per value, ``s_p``: the packets'):

* encode: read the input once and write every round's increment (``L = c + N - 2`` rounds of
  ``d / c`` values, in the data's dtype): ``s_x (1 + L / c)`` bytes per value;
* decode: read the ``c`` observations (``d`` values in the packet dtype), read the input again
  for the own part, write the sum: ``s_p + 2 s_x`` bytes per value.

A lossy ring's codec (the 16-bit and the block wires, :mod:`cerar.comm.algorithms.ring.wires`;
``w``: the wire's bytes per value, a block wire's scales included) on a ring of ``N`` ranks, each
of its ``N`` chunks of ``d / N`` values touched once per rank: round 1 encodes the own chunk
(read ``s_x``, write ``w``), each of the ``N - 1`` reduce-scatter hops reads the own chunk and
the packet that arrived and writes the next packet (``s_x + 2w``), the last of them also writing
the owner's result (``s_x``), and each of the ``N - 1`` all-gather packets is decoded (read
``w``, write ``s_x``). In all the input is read once and the result written once, ``N`` packets
written and ``2(N - 1)`` read: ``2 s_x + w (3 - 2 / N)`` bytes per value (the all-gather's
forwarding of a packet unchanged is the program's copy, not the codec's, and is neither timed nor
counted). A hierarchical ring counts its ring of ``M`` nodes on each rank's ``1 / G`` shard.
The direct shape's codec (``direct-int8``...) encodes the ``N - 1`` chunks it sends (read
``s_x``, write ``w``), adds the ``N - 1`` packets it receives into its own chunk (read ``w``,
read and write ``s_x``), encodes and decodes its sum (``s_x + w`` twice) and decodes the ``N - 1``
sums it receives (read ``w``, write ``s_x``): ``s_x (4 - 2 / N) + w (3 - 1 / N)`` bytes per value.
Error feedback's extra passes (the residual read and written) are not counted.

:func:`copy_bandwidth` measures the rate (bytes read plus bytes written per second by
``dst.copy_(src)`` of a buffer far larger than the caches), on every rank at once, as the coding
runs; ``cerar bench`` records ``coding_limit_s`` and ``coding_limit_ratio`` (coding time over
the limit) per coded case and lossy ring, and ``coding_cpu_limit_ratio``: the coding thread's
CPU time over the same limit. The copies are short, so a rank copies while it holds a core; where ranks outnumber
the cores (four on two here), the coding's wall time also holds the time it waited for one, and
the two ratios differ by that wait. Exact methods have no coding: their limit is None (the
exact ring's float32 copies and adds are timed as its encode and decode all the same).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

#: Bytes per value of the packets each coded method sends.
_PACKET_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}


#: The families whose rows run the ring program (:func:`cerar.comm.algorithms.ring.program.run_ring`).
RING_FAMILIES = ("ring", "hier-ring")


def ring_codec(method: Any) -> bool:
    """Whether ``method`` is a ring (or the direct shape) whose wire is lossy (16 bits, or a block
    wire): a codec the limit counts (see the module doc)."""
    from cerar.comm.algorithms.ring.wires import WIRES

    wire = WIRES.get(method.packet_precision)
    return getattr(method, "family", "") in (*RING_FAMILIES, "direct") and wire is not None and wire.lossy


def coding_bytes_per_value(
    method: Any, world_size: int, components: int | None, ranks_per_node: int = 1, data_bytes: int = 4
) -> float | None:
    """Bytes the coding of ``method`` must read and write per value it codes (None: no coding;
    a hierarchical method codes each rank's shard, ``1 / G`` of the input, over ``M`` nodes):
    CERAR's encode and decode, or a lossy ring's codec (the module doc has both counts)."""
    n = method.ring_size(world_size, ranks_per_node)
    if ring_codec(method) and method.family == "direct":
        return data_bytes * (4 - 2 / n) + method.wire_bytes_per_value * (3 - 1 / n)
    if ring_codec(method):
        return 2 * data_bytes + method.wire_bytes_per_value * (3 - 2 / n)
    if not method.coded or components is None:
        return None
    rounds = components + n - 2
    packet = _PACKET_BYTES.get(method.packet_precision, 4)
    return data_bytes * (1 + rounds / components) + packet + 2 * data_bytes


def copy_bandwidth(nbytes: int = 64 << 20, repeats: int = 5) -> float:
    """Bytes read plus written per second by ``torch.Tensor.copy_`` of ``nbytes`` (median)."""
    import torch

    source = torch.ones(nbytes // 4, dtype=torch.float32)
    target = torch.empty_like(source)
    target.copy_(source)  # fault the pages in
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        target.copy_(source)
        times.append(time.perf_counter() - started)
    return 2 * nbytes / statistics.median(times)
