"""A reference simulator of the exact ring (reduce-scatter + all-gather) with a chosen wire
precision, step for step as :func:`cerar.comm.algorithms.ring.program.run_ring` runs it: values held in float32,
chunks rounded to the wire precision when sent, float16 wires scaled by
:func:`cerar.coding.scaling.ring_scale_exponent`. The 8-bit wires (``"int8"``, ``"fp8"``) are
block-quantized (:mod:`cerar.coding.blocks`): a rank quantizes the partial sum it sends, the
receiver dequantizes it and adds it to its own float32 chunk; the owner of a fully reduced chunk
quantizes it and keeps the dequantized values itself, and the all-gather forwards that packet
unchanged, so every rank ends bitwise identical. Pure numpy; used to compare the 16- and 8-bit
rings with CERAR on the same inputs."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from cerar._checks import check_int
from cerar.coding.blocks import WIRES, BlockFormat, round_trip
from cerar.coding.precision import ITEMSIZE, precision_name, rounder
from cerar.coding.scaling import ring_scale_exponent
from cerar.protocol.simulate import SimulationResult, stack_inputs


def simulate_ring(
    inputs: Any,
    wire_dtype: Any = "fp32",
    world_size: int | None = None,
    block_format: BlockFormat | None = None,
) -> SimulationResult:
    """Run the exact ring on all ranks in one process.

    Args:
        inputs: ``N`` arrays/tensors of one shape or an ``(N, ...)`` array (rounded to float32,
            as the collective receives them).
        wire_dtype: ``"fp32"`` (default), ``"fp16"`` or ``"bf16"`` (or the torch/numpy dtype), or
            an 8-bit wire, ``"int8"`` or ``"fp8"`` (float8 e4m3fn), block-quantized.
        world_size: ``N``; default: the number of inputs.
        block_format: the 8-bit wire's :class:`cerar.coding.blocks.BlockFormat` (its ``wire`` is
            replaced by ``wire_dtype``); default: ``BlockFormat()``'s block and scale. Only for
            the 8-bit wires.
    """
    if isinstance(wire_dtype, str) and wire_dtype in WIRES:
        return _simulate_ring_8bit(inputs, wire_dtype, world_size, block_format)
    if block_format is not None:
        raise ValueError(f"Argument 'block_format' applies to the 8-bit wires {WIRES} only, not {wire_dtype!r}.")
    wire = precision_name(wire_dtype, "wire_dtype")
    if wire == "fp64":
        raise ValueError("Argument 'wire_dtype' must be 'fp32', 'fp16' or 'bf16', not 'fp64'.")
    count = len(inputs) if world_size is None else check_int("world_size", world_size, minimum=2)
    flat = stack_inputs(inputs, count)
    n, d = flat.shape
    if n < 2:
        raise ValueError(f"Argument 'inputs' must hold at least 2 inputs, not {n}.")
    to_wire = rounder(wire)
    chunk = math.ceil(d / n)
    values = np.zeros((n, n * chunk), dtype=np.float32)
    values[:, :d] = flat.astype(np.float32)
    scale = 1.0
    if wire == "fp16":
        scale = 2.0 ** ring_scale_exponent(n, float(np.max(np.abs(values))), "fp64", wire)
        values /= np.float32(scale)
    chunks = values.reshape(n, n, chunk)  # [rank, chunk index, values]
    for step in range(n - 1):  # reduce-scatter: every rank sends, then every rank adds
        sent = [to_wire(chunks[r, (r - step) % n]).astype(np.float32) for r in range(n)]
        for r in range(n):
            chunks[r, (r - step - 1) % n] += sent[(r - 1) % n]
    for r in range(n):
        owned = (r + 1) % n
        chunks[r, owned] = to_wire(chunks[r, owned])
    for step in range(n - 1):  # all-gather
        sent = [chunks[r, (r + 1 - step) % n].copy() for r in range(n)]
        for r in range(n):
            chunks[r, (r - step) % n] = sent[(r - 1) % n]
    return _ring_result((values.astype(np.float64) * scale)[:, :d], flat, chunk)


def _simulate_ring_8bit(
    inputs: Any, wire: str, world_size: int | None, block_format: BlockFormat | None
) -> SimulationResult:
    if block_format is None:
        block_format = BlockFormat(wire)
    elif not isinstance(block_format, BlockFormat):
        raise TypeError(f"Argument 'block_format' must be a cerar BlockFormat, not {type(block_format).__name__}.")
    fmt = BlockFormat(wire, block_format.block, block_format.scale)
    return simulate_ring_rounded(inputs, lambda v: round_trip(v, fmt), world_size)


def simulate_ring_rounded(
    inputs: Any, round_trip_fn: Callable[[np.ndarray], np.ndarray], world_size: int | None = None
) -> SimulationResult:
    """The ring of the 8-bit wires with any packet rounding: ``round_trip_fn`` maps the ``(N,
    chunk)`` float32 packets a step sends (one row per rank) to the float32 values received. The
    8-bit rings use the block format's round trip; the frontier study also runs narrower
    (hypothetical) wires through it."""
    count = len(inputs) if world_size is None else check_int("world_size", world_size, minimum=2)
    flat = stack_inputs(inputs, count)
    n, d = flat.shape
    if n < 2:
        raise ValueError(f"Argument 'inputs' must hold at least 2 inputs, not {n}.")
    chunk = math.ceil(d / n)
    values = np.zeros((n, n * chunk), dtype=np.float32)
    values[:, :d] = flat.astype(np.float32)
    chunks = values.reshape(n, n, chunk)  # [rank, chunk index, values]; blocks start at each chunk
    ranks = np.arange(n)
    for step in range(n - 1):  # reduce-scatter: quantize the partial sum, dequantize, add in float32
        sent = round_trip_fn(chunks[ranks, (ranks - step) % n])
        chunks[ranks, (ranks - step - 1) % n] += sent[(ranks - 1) % n]
    owned = (ranks + 1) % n
    # The owner keeps what it sends: the all-gather forwards this packet unchanged.
    chunks[ranks, owned] = round_trip_fn(chunks[ranks, owned])
    for step in range(n - 1):  # all-gather
        sent = chunks[ranks, (ranks + 1 - step) % n].copy()
        chunks[ranks, (ranks - step) % n] = sent[(ranks - 1) % n]
    return _ring_result(values.astype(np.float64)[:, :d], flat, chunk)


def ring_bytes_per_value(world_size: int, wire: str, block_format: BlockFormat | None = None) -> float:
    """Bytes a rank sends per value of the vector in a ring over ``wire``: ``2 (N-1)/N`` times the
    wire's bytes per value (an 8-bit wire's includes its block scales)."""
    n = check_int("world_size", world_size, minimum=2)
    if wire in WIRES:
        fmt = block_format if block_format is not None else BlockFormat(wire)
        per_value = BlockFormat(wire, fmt.block, fmt.scale).bytes_per_value
    else:
        per_value = ITEMSIZE[precision_name(wire, "wire")]
    return 2 * (n - 1) / n * per_value


def _ring_result(outputs: np.ndarray, flat: np.ndarray, chunk: int) -> SimulationResult:
    """A ring's figures: ``2(N-1)`` rounds of ``chunk`` values, no error bound of CERAR's."""
    n = flat.shape[0]
    sent_values = np.full(n, 2 * (n - 1) * chunk)
    return SimulationResult(
        outputs=outputs,
        exact=flat.sum(axis=0),
        inputs=flat,
        rounds=2 * (n - 1),
        packet_values=chunk,
        values_sent=sent_values,
        values_received=sent_values.copy(),
        peak_packets=np.full(n, n + 2),
        peak_working_packets=np.full(n, 2),
        error_bounds=np.zeros(n),
    )
