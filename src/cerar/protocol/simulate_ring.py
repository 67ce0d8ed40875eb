"""A reference simulator of the exact ring (reduce-scatter + all-gather) with a chosen wire
precision, step for step as :func:`cerar.comm.kernels.ring_run.run_ring` runs it: values held in float32,
chunks rounded to the wire precision when sent, float16 wires scaled by
:func:`cerar.coding.scaling.ring_scale_exponent`. Pure numpy; used to compare 16-bit rings with CERAR
on the same inputs."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from cerar._checks import check_int
from cerar.coding.precision import precision_name, rounder
from cerar.coding.scaling import ring_scale_exponent
from cerar.protocol.simulate import SimulationResult, stack_inputs


def simulate_ring(inputs: Any, wire_dtype: Any = "fp32", world_size: int | None = None) -> SimulationResult:
    """Run the exact ring on all ranks in one process.

    Args:
        inputs: ``N`` arrays/tensors of one shape or an ``(N, ...)`` array (rounded to float32,
            as the collective receives them).
        wire_dtype: ``"fp32"`` (default), ``"fp16"`` or ``"bf16"`` (or the torch/numpy dtype).
        world_size: ``N``; default: the number of inputs.
    """
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
    outputs = (values.astype(np.float64) * scale)[:, :d]
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
