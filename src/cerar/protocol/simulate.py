"""A reference simulator: all N ranks of CERAR, round by round, in one process.

It executes the same :class:`cerar.protocol.schedule.RankPlan` as the real transport, in the same
layout (component ``k`` takes every ``c``-th value) and with the same exact power-of-two packet
scale, with each packet rounded to the packet precision once, as the transport sends it, and
decodes in float64. It is the yardstick the collective is tested against. Packets can also travel
block-quantized in 8 bits (``packet_dtype="int8"`` or ``"fp8"``, :mod:`cerar.coding.blocks`): each
packet is computed in float64 as before, rounded to float32, quantized per block when sent and
dequantized on receipt; the block scales set the range, so no power-of-two scale is applied.
Pure numpy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from cerar.coding.blocks import WIRES, BlockFormat, round_trip
from cerar.coding.linear_code import Code
from cerar.coding.precision import precision_name, rounder
from cerar.coding.scaling import scale_window
from cerar.protocol.schedule import Schedule


@dataclass(frozen=True)
class SimulationResult:
    """Every rank's decoded sum and the protocol's accounting.

    Attributes:
        outputs: ``(N, d)`` float64, rank ``j``'s decoded sum in row ``j``.
        exact: ``(d,)`` float64, the exact sum of the inputs.
        inputs: ``(N, d)`` float64, the inputs as received.
        rounds: rounds run (``c + N - 2``).
        packet_values: values per packet, ``ceil(d / c)``.
        values_sent, values_received: ``(N,)`` values each rank put on / took off the wire.
        peak_packets: ``(N,)`` most packet-sized buffers a rank held at once, own data included.
        peak_working_packets: ``(N,)`` the same less the ``c`` packets of the rank's own data and
            the ``c`` observation packets that become its output.
        error_bounds: ``(N,)`` absolute exact-arithmetic bound ``beta_j * D_j`` on
            ``||outputs[j] - exact||`` (see :attr:`cerar.Code.error_bound`).
    """

    outputs: np.ndarray
    exact: np.ndarray
    inputs: np.ndarray
    rounds: int
    packet_values: int
    values_sent: np.ndarray
    values_received: np.ndarray
    peak_packets: np.ndarray
    peak_working_packets: np.ndarray
    error_bounds: np.ndarray

    @property
    def errors(self) -> np.ndarray:
        """Per rank ``||S_hat_j - S||`` (2-norm)."""
        return np.linalg.norm(self.outputs - self.exact, axis=1)

    @property
    def relative_errors(self) -> np.ndarray:
        """Per rank ``||S_hat_j - S|| / ||S||`` (the absolute error if ``S = 0``)."""
        scale = float(np.linalg.norm(self.exact))
        return self.errors / scale if scale > 0 else self.errors

    @property
    def worst_relative_error(self) -> float:
        return float(np.max(self.relative_errors))


def stack_inputs(inputs: Any, world_size: int, name: str = "inputs") -> np.ndarray:
    """Turn N tensors/arrays of one shape, or an ``(N, ...)`` array, into an ``(N, d)`` float64."""
    if isinstance(inputs, np.ndarray) or hasattr(inputs, "shape"):
        rows = [inputs[i] for i in range(inputs.shape[0])] if len(inputs.shape) >= 1 else [inputs]
    elif isinstance(inputs, Sequence) and not isinstance(inputs, (str, bytes)):
        rows = list(inputs)
    else:
        raise TypeError(
            f"Argument '{name}' must be N arrays or an (N, d) array, not {type(inputs).__name__}."
        )
    if len(rows) != world_size:
        raise ValueError(f"Argument '{name}' must hold world_size={world_size} inputs, not {len(rows)}.")
    arrays = [_as_float64(row, name) for row in rows]
    shapes = {a.shape for a in arrays}
    if len(shapes) != 1:
        raise ValueError(f"Argument '{name}' must hold inputs of one shape, not {sorted(shapes)}.")
    flat = np.stack([a.reshape(-1) for a in arrays])
    if flat.shape[1] == 0:
        raise ValueError(f"Argument '{name}' must hold non-empty inputs, not shape {arrays[0].shape}.")
    return flat


def _as_float64(value: Any, name: str) -> np.ndarray:
    if hasattr(value, "detach"):  # a torch tensor; bf16 has no numpy view
        value = value.detach().cpu().double().numpy()
    array = np.asarray(value)
    if not (np.issubdtype(array.dtype, np.floating) or np.issubdtype(array.dtype, np.integer)):
        raise TypeError(f"Argument '{name}' must hold real numbers, not dtype {array.dtype}.")
    return array.astype(np.float64)


def simulate(
    code: Code, inputs: Any, packet_dtype: Any = "fp32", block_format: BlockFormat | None = None
) -> SimulationResult:
    """Run CERAR on all ``code.world_size`` ranks in one process.

    Args:
        code: the :class:`cerar.Code` to run.
        inputs: ``N`` arrays or tensors of one shape, or an ``(N, ...)`` array; any size ``d``.
        packet_dtype: precision of the packets on the wire: ``"fp32"`` (default), ``"fp64"``,
            ``"fp16"``, ``"bf16"``, or the matching numpy/torch dtype; or ``"int8"`` / ``"fp8"``,
            block-quantized 8-bit packets.
        block_format: the 8-bit packets' :class:`cerar.coding.blocks.BlockFormat` (its ``wire``
            is replaced by ``packet_dtype``); default ``BlockFormat()``'s block and scale. Only
            for the 8-bit packets.

    Returns:
        A :class:`SimulationResult` with every rank's sum and the accounting.
    """
    if not isinstance(code, Code):
        raise TypeError(f"Argument 'code' must be a cerar.Code, not {type(code).__name__}.")
    eight_bit = isinstance(packet_dtype, str) and packet_dtype in WIRES
    if eight_bit:
        packet = _block_packet(packet_dtype, block_format)
    elif block_format is not None:
        raise ValueError(f"Argument 'block_format' applies to the 8-bit packets {WIRES} only, not {packet_dtype!r}.")
    else:
        packet_name = precision_name(packet_dtype, "packet_dtype")
        packet = rounder(packet_name)
    n_ranks, c = code.world_size, code.components
    flat = stack_inputs(inputs, n_ranks)
    d = flat.shape[1]
    m = math.ceil(d / c)
    padded = np.zeros((n_ranks, c * m))
    padded[:, :d] = flat
    # Component k takes every c-th value (see cerar.comm.algorithms.cerar.run): column q holds values qc .. qc+c-1.
    own = padded.reshape(n_ranks, m, c).transpose(0, 2, 1)
    # The transport's exact power-of-two packet scale at its first call (cerar.coding.scaling).
    schedule = Schedule.for_code(code)
    rows_exponent = data_exponent = 0  # 8-bit packets: the block scales set the range
    if not eight_bit:
        window = scale_window(code, "fp64", packet_name, schedule.decode_gain(code))
        rows_exponent, data_exponent = window.split(window.exponent_for(float(np.max(np.abs(flat), initial=0.0))))
    scale = math.ldexp(1.0, rows_exponent)
    own = own * math.ldexp(1.0, -data_exponent)  # exact: a power of two

    plans = [schedule.plan(code, j) for j in range(n_ranks)]
    received = [np.zeros(m, dtype=packet(np.zeros(1)).dtype) for _ in range(n_ranks)]
    observations: list[list[np.ndarray]] = [[] for _ in range(n_ranks)]
    held = np.full(n_ranks, c)  # own data
    peak = held.copy()
    for t in range(1, schedule.rounds + 1):
        outgoing = []
        for j, plan in enumerate(plans):
            # Encoded from X as the piece is sent, in float64 here, rounded once to the packet.
            increment = (plan.increments[t - 1] / scale) @ own[j]
            peak[j] = max(peak[j], held[j] + 2)  # the packet in hand and the increment
            outgoing.append(packet(received[j].astype(np.float64) + increment))
        for j, plan in enumerate(plans):
            received[j] = outgoing[(j - 1) % n_ranks]
            if plan.slot(t) is not None:
                observations[j].append(received[j])
                held[j] += 1
    outputs = np.empty((n_ranks, d))
    for j, plan in enumerate(plans):
        stacked = np.concatenate([own[j], scale * np.asarray(observations[j], dtype=np.float64)])
        outputs[j] = (plan.decode @ stacked).T.reshape(-1)[:d] * math.ldexp(1.0, data_exponent)
    exact_sum = flat.sum(axis=0)
    sent = np.full(n_ranks, schedule.rounds * m)
    bounds = code.error_bound * np.array([code.error_scale(flat, j) for j in range(n_ranks)])
    return SimulationResult(
        outputs=outputs,
        exact=exact_sum,
        inputs=flat,
        rounds=schedule.rounds,
        packet_values=m,
        values_sent=sent,
        values_received=sent.copy(),
        peak_packets=peak,
        peak_working_packets=peak - 2 * c,
        error_bounds=bounds,
    )


def _block_packet(wire: str, block_format: BlockFormat | None) -> Any:
    """The 8-bit packet's rounding: to float32, then quantized per block and dequantized."""
    if block_format is None:
        block_format = BlockFormat(wire)
    elif not isinstance(block_format, BlockFormat):
        raise TypeError(f"Argument 'block_format' must be a cerar BlockFormat, not {type(block_format).__name__}.")
    fmt = BlockFormat(wire, block_format.block, block_format.scale)
    return lambda x: round_trip(np.asarray(x, dtype=np.float32), fmt)
