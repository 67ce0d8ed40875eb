"""The block wires below 4 bits (int3, int2) on Gloo ranks: the ring and the direct shape give
bitwise the same result on every rank, bitwise the numpy references
(cerar.protocol.simulate_ring.simulate_ring, cerar.coding.blocks.direct_round_trip), and send the
packed codes' bytes; their rows through cerar.all_reduce (ring-, direct-, hier-ring-), which the
library's default error budget refuses."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch
from wire_data import same_bits as _same
from wire_data import scaled_input as _input

import cerar
from cerar.coding.blocks import SCALE_ITEMSIZE, BlockFormat, direct_round_trip
from cerar.comm.algorithms.ring.direct import run_direct
from cerar.comm.algorithms.ring.program import run_ring
from cerar.comm.algorithms.ring.quantize import packet_bytes
from cerar.comm.algorithms.ring.wires import BlockWire
from cerar.comm.runtime.links import Ring
from cerar.comm.runtime.stats import CommStats
from cerar.protocol.simulate_ring import simulate_ring
from multirank import check, run_ranks

pytestmark = pytest.mark.multirank

#: (values, format): sizes not divisible by the ranks, the block or a byte's worth of codes,
#: smaller than the ranks, and several pieces a chunk (packets of about 256 KiB).
CASES = [
    (1001, BlockFormat("int3", 64, "bf16")),
    (3, BlockFormat("int3", 8, "fp16")),
    (4099, BlockFormat("int2", 12, "fp32")),
    (1001, BlockFormat("int2", 128, "bf16")),
    (3_000_003, BlockFormat("int3", 64, "bf16")),
    (4_000_003, BlockFormat("int2", 128, "bf16")),
]
#: The rows run through cerar.all_reduce.
ROWS = ("ring-int3", "ring-int2", "direct-int3", "direct-int2")


def _shapes_worker(rank: int, world: int) -> list[tuple[np.ndarray, np.ndarray, np.ndarray, int, int]]:
    """Every case through the ring and the direct shape: (input, ring's, direct's, ring's bytes
    sent, direct's bytes sent)."""
    os.environ["CERAR_NATIVE"] = "1"  # the compiled kernels do not take these wires: the torch ops run
    ring = Ring.of(None)
    assert ring is not None
    out = []
    for seed, (d, fmt) in enumerate(CASES):
        x = _input(rank, d, seed)
        wire = BlockWire(fmt.wire, fmt)
        y, z = x.clone(), x.clone()
        ring_stats, direct_stats = CommStats(), CommStats()
        run_ring(y, ring, ring_stats, wire)
        run_direct(z, ring, direct_stats, wire)
        assert ring_stats.bytes_sent == ring_stats.bytes_received
        out.append((x.numpy(), y.numpy(), z.numpy(), ring_stats.bytes_sent, direct_stats.bytes_sent))
    return out


@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_rank_bitwise_equal_and_the_references(world: int) -> None:
    results = check(run_ranks(_shapes_worker, world, timeout=300))
    for index, (d, fmt) in enumerate(CASES):
        inputs = np.stack([results[r][index][0] for r in range(world)])
        ring = simulate_ring(inputs, fmt.wire, block_format=fmt).outputs[0].astype(np.float32)
        direct = direct_round_trip(inputs, fmt)
        for r in range(world):
            assert _same(results[r][index][1], ring), (d, fmt, r, "ring")
            assert _same(results[r][index][2], direct), (d, fmt, r, "direct")
        chunk = math.ceil(d / world)
        packet = packet_bytes(chunk, fmt)  # the chunk's codes packed, fmt.code_bits a value
        assert packet == math.ceil(chunk / fmt.block) * SCALE_ITEMSIZE[fmt.scale] + fmt.code_bytes(chunk)
        for r in range(world):
            _, _, _, ring_sent, direct_sent = results[r][index]
            assert ring_sent == 2 * (world - 1) * packet
            assert 2 * (world - 1) * packet <= direct_sent <= 2 * (world - 1) * (packet + 16 * 16)


def _rows_worker(rank: int, world: int) -> dict[str, object]:
    """Each row of ROWS through cerar.all_reduce on one Gaussian input (max_error=None), the
    hierarchical row on two nodes of two ranks, and the default budget's refusal."""
    x = torch.randn(50_001, generator=torch.Generator().manual_seed(rank))
    out: dict[str, object] = {"input": x.numpy()}
    for method in ROWS:
        y = x.clone()
        cerar.all_reduce(y, method=method, max_error=None)
        out[method] = y.numpy()
    group = cerar.new_group(method="hier-ring-int3", ranks_per_node=2, max_error=None, min_bytes=0)
    y = x.clone()
    torch.distributed.all_reduce(y, group=group)
    out["hier-ring-int3"] = y.numpy()
    cerar.shutdown()
    try:
        cerar.all_reduce(x.clone(), method="direct-int2")
    except ValueError as exc:
        out["refused"] = str(exc)
    return out


def test_the_rows_through_all_reduce() -> None:
    results = check(run_ranks(_rows_worker, 4, timeout=300))
    inputs = np.stack([r["input"] for r in results])
    exact = inputs.astype(np.float64).sum(0)
    for method in ROWS:
        family, wire = method.split("-")
        fmt = BlockFormat(wire)
        if family == "ring":
            expected = simulate_ring(inputs, wire, block_format=fmt).outputs[0].astype(np.float32)
        else:
            expected = direct_round_trip(inputs, fmt)
        bound = cerar.collective.get_route(method).error_bound(4)
        error = np.linalg.norm(results[0][method] - exact) / np.linalg.norm(exact)
        assert error < bound, (method, error, bound)
        for r in range(4):
            assert _same(results[r][method], expected), (method, r)  # Gaussian inputs: no pre-scaling
    hier = np.linalg.norm(results[0]["hier-ring-int3"] - exact) / np.linalg.norm(exact)
    assert hier < cerar.collective.get_route("hier-ring-int3").error_bound(2)  # the int3 ring between 2 nodes
    for r in range(4):
        assert _same(results[r]["hier-ring-int3"], results[0]["hier-ring-int3"])
        assert "'max_error' is 0.1, but method 'direct-int2' predicts" in results[r]["refused"]
