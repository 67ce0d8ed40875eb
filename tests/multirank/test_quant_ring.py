"""The 8-bit ring on Gloo ranks (cerar.comm.algorithms.ring.block_ops, cerar.comm.collective.quant_call):
bitwise the same result on every rank and bitwise the simulator's
(cerar.protocol.simulate_ring.simulate_ring), the compiled kernels and the torch ops alike; the
bytes it sends; the non-finite policies decided alike on every rank; avg; sizes not divisible by
the ranks or the block."""

from __future__ import annotations

import itertools
import math
import os

import numpy as np
import pytest
import torch
from wire_data import same_bits as _same
from wire_data import scaled_input as _input

from cerar.coding.blocks import SCALE_ITEMSIZE, BlockFormat
from cerar.comm.algorithms.ring.block_ops import quant_pieces
from cerar.comm.algorithms.ring.program import run_ring
from cerar.comm.algorithms.ring.quantize import packet_bytes
from cerar.comm.algorithms.ring.wires import BlockWire
from cerar.comm.collective.call import NonFiniteError, ring_call
from cerar.comm.collective.request import Request
from cerar.comm.runtime.handshake import SettingsMismatchError
from cerar.comm.runtime.links import Ring
from cerar.comm.runtime.stats import CommStats
from cerar.protocol.simulate_ring import simulate_ring
from multirank import RankFailure, check, run_ranks

pytestmark = pytest.mark.multirank

#: (values, format): sizes not divisible by the ranks nor the block, smaller than the ranks, and
#: one of several pieces a chunk (packets of about 256 KiB).
CASES = [
    (1000, BlockFormat("int8", 64, "bf16")),
    (1001, BlockFormat("fp8", 64, "fp32")),
    (3, BlockFormat("int8", 7, "fp16")),
    (4099, BlockFormat("fp8", 33, "bf16")),
    (2_000_003, BlockFormat("int8", 64, "bf16")),
    (1001, BlockFormat("int4", 32, "bf16")),  # odd chunks: the last block ends on a pad nibble
    (4099, BlockFormat("int4", 6, "fp16")),
]


def run_quantized_ring(x: torch.Tensor, ring: Ring, stats: CommStats, fmt: BlockFormat) -> None:
    run_ring(x, ring, stats, BlockWire(fmt.wire, fmt))


def quant_ring_call(
    x: torch.Tensor, op: str, ring: Ring, fmt: BlockFormat, policy: str, stats: CommStats | None
) -> None:
    """One call of the block wire's ring, as the route table's row starts it (max_error unchecked)."""
    wire = BlockWire(fmt.wire, fmt)
    ring_call(Request(x, op, None, False, f"ring-{fmt.wire}", wire, policy, None, stats), ring)


def _ring_worker(rank: int, world: int, native: str) -> list[tuple[np.ndarray, np.ndarray, int, int, int]]:
    """Every case through run_quantized_ring: (input, result, bytes sent, received, rounds)."""
    os.environ["CERAR_NATIVE"] = native
    ring = Ring.of(None)
    assert ring is not None
    out = []
    for seed, (d, fmt) in enumerate(CASES):
        x = _input(rank, d, seed)
        given = x.clone()
        stats = CommStats()
        run_quantized_ring(x, ring, stats, fmt)
        out.append((given.numpy(), x.numpy(), stats.bytes_sent, stats.bytes_received, stats.rounds))
    return out


@pytest.mark.parametrize(("world", "native"), [(2, "1"), (3, "1"), (4, "1"), (4, "0")])
def test_every_rank_bitwise_equal_and_the_simulators(world: int, native: str) -> None:
    results = check(run_ranks(_ring_worker, world, native, timeout=300))
    for index, (d, fmt) in enumerate(CASES):
        inputs = np.stack([results[r][index][0] for r in range(world)])
        outputs = [results[r][index][1] for r in range(world)]
        for r in range(1, world):
            assert _same(outputs[r], outputs[0]), (d, fmt, r)
        simulated = simulate_ring(inputs, fmt.wire, block_format=fmt).outputs[0]
        assert _same(outputs[0], simulated.astype(np.float32)), (d, fmt)
        exact = inputs.astype(np.float64).sum(0)
        error = np.linalg.norm(outputs[0] - exact) / np.linalg.norm(exact)
        limit = 0.1 if fmt.code_bits == 8 else 0.5  # int4 errs 0.1-0.3 (docs/protocol.md)
        assert error < limit, error  # well within the format's error; the bitwise checks carry the weight
        chunk = math.ceil(d / world)
        packet = fmt.code_bytes(chunk) + math.ceil(chunk / fmt.block) * SCALE_ITEMSIZE[fmt.scale]  # whole blocks
        assert packet == packet_bytes(chunk, fmt)
        for r in range(world):
            _, _, sent, received, rounds = results[r][index]
            assert rounds == 2 * (world - 1)
            assert sent == received == 2 * (world - 1) * packet
            # The formula, up to the padding of the last chunk and of the chunks' last blocks.
            formula = 2 * (world - 1) / world * d * fmt.bytes_per_value
            assert formula - 1 <= sent <= formula + 2 * (world - 1) * (world + SCALE_ITEMSIZE[fmt.scale])


def test_compiled_and_torch_ops_give_the_same_bits() -> None:
    native = check(run_ranks(_ring_worker, 3, "1", timeout=300))
    torch_ops = check(run_ranks(_ring_worker, 3, "0", timeout=300))
    for r in range(3):
        for index in range(len(CASES)):
            assert _same(native[r][index][1], torch_ops[r][index][1])


@pytest.mark.parametrize("fmt", [BlockFormat("int8", 64, "bf16"), BlockFormat("int4", 32, "bf16")])
def test_pieces_hold_whole_blocks(fmt: BlockFormat) -> None:
    pieces = quant_pieces(2_000_001, fmt)
    assert len(pieces) > 1 and pieces[0][0] == 0 and pieces[-1][1] == 2_000_001
    for (a, b, offset, size), (a2, _, offset2, _) in itertools.pairwise(pieces):
        assert a % fmt.block == 0 and b == a2 and offset % 16 == 0 and offset + size <= offset2
        assert size == packet_bytes(b - a, fmt)  # int4: even pieces, whole bytes
    assert pieces[-1][3] == packet_bytes(pieces[-1][1] - pieces[-1][0], fmt)
    assert quant_pieces(0, fmt) == []


def _nonfinite_worker(rank: int, world: int, policy: str, op: str) -> tuple[object, ...]:
    ring = Ring.of(None)
    assert ring is not None
    fmt = BlockFormat("int8", 16, "bf16")
    d = 1003
    x = _input(rank, d, 7)
    if rank == 2:
        x[100] = float("nan")
    if rank == 1 and policy == "exact":
        x[100] = float("inf")
        x[101] = float("inf")
    given = x.clone()
    stats = CommStats()
    quant_ring_call(x, op, ring, fmt, policy, stats)
    return given.numpy(), x.numpy(), stats.fallbacks, stats.nonfinite_events, stats.bytes_sent


def test_nonfinite_raise_raises_on_every_rank() -> None:
    results = run_ranks(_nonfinite_worker, 4, "raise", "sum", timeout=120)
    for result in results:
        assert isinstance(result, RankFailure) and result.type_name == NonFiniteError.__name__, result
        assert "group rank 2" in result.message


def test_nonfinite_exact_falls_back_to_the_exact_ring() -> None:
    results = check(run_ranks(_nonfinite_worker, 4, "exact", "sum", timeout=120))
    inputs = np.stack([r[0] for r in results])
    for _, out, fallbacks, events, sent in results:
        assert fallbacks == 1 and events == 1
        assert np.isnan(out[100]) and np.isposinf(out[101])  # NaN + Inf, Inf + finite: the exact ring's
        finite = np.isfinite(inputs).all(0)
        assert np.allclose(out[finite], inputs.astype(np.float64).sum(0)[finite], rtol=1e-5, atol=1e-5)
        assert np.isfinite(out[finite]).all()
        assert sent >= 2 * 3 * math.ceil(1003 / 4) * 4  # float32 on the wire
        assert _same(out, results[0][1])


@pytest.mark.parametrize("op", ["sum", "avg"])
def test_nonfinite_ignore_spreads_within_its_block_only(op: str) -> None:
    results = check(run_ranks(_nonfinite_worker, 4, "ignore", op, timeout=120))
    inputs = np.stack([r[0] for r in results])
    fmt = BlockFormat("int8", 16, "bf16")
    expected = simulate_ring(inputs, "int8", block_format=fmt).outputs[0].astype(np.float32)
    if op == "avg":
        expected = expected / np.float32(4)
    chunk = math.ceil(1003 / 4)
    start = 100 - (100 % chunk)  # blocks start at their chunk
    first = start + (100 - start) // 16 * 16
    for _, out, fallbacks, events, _ in results:
        assert fallbacks == 0 and events == 1
        assert _same(out, expected)
        nan = np.flatnonzero(np.isnan(out))
        assert nan.tolist() == list(range(first, first + 16))


def _avg_worker(rank: int, world: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    ring = Ring.of(None)
    assert ring is not None
    fmt = BlockFormat("fp8", 32, "fp16")
    x = _input(rank, 777, 3)
    given = x.clone()
    quant_ring_call(x, "avg", ring, fmt, "raise", None)
    wide = _input(rank, 777, 3).double()  # a float64 tensor travels as float32
    quant_ring_call(wide, "sum", ring, fmt, "raise", None)
    empty = torch.empty(0)
    quant_ring_call(empty, "sum", ring, fmt, "raise", None)  # nothing to send, no hang
    run_quantized_ring(empty, ring, CommStats(), fmt)
    return given.numpy(), x.numpy(), wide.numpy()


def test_avg_float64_and_empty() -> None:
    results = check(run_ranks(_avg_worker, 3, timeout=120))
    inputs = np.stack([r[0] for r in results])
    fmt = BlockFormat("fp8", 32, "fp16")
    total = simulate_ring(inputs, "fp8", block_format=fmt).outputs[0].astype(np.float32)
    for _, avg, wide in results:
        assert _same(avg, total / np.float32(3))
        assert wide.dtype == np.float64 and _same(wide.astype(np.float32), total)


def _mismatch_worker(rank: int, world: int) -> None:
    ring = Ring.of(None)
    assert ring is not None
    fmt = BlockFormat("int8", 64 if rank else 32, "bf16")
    quant_ring_call(torch.randn(100), "sum", ring, fmt, "raise", None)


def test_different_formats_raise_on_every_rank_before_any_data() -> None:
    for result in run_ranks(_mismatch_worker, 3, timeout=120):
        assert isinstance(result, RankFailure) and result.type_name == SettingsMismatchError.__name__, result
        assert "blocks of 32" in result.message and "blocks of 64" in result.message

