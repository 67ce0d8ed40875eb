"""One rank of ``cerar bench``: ``python -m cerar.experiments.bench.worker CONFIG.json``.

Started by :func:`cerar.harness.launch.launch` (which sets ``RANK``, ``WORLD_SIZE``, ``MASTER_*``). For
each case of the config (a method, its code, a message size) the rank runs, in the nccl-tests
manner: warm-up iterations, then timed iterations with a barrier before each; an iteration's time
is the slowest rank's. A separate pass afterwards checks the result against the exact sum, so
the check never sits inside the timed loop. Rank 0 writes the records to the config's ``out``
path after every case, atomically (a later failure keeps the earlier results, and the driver
never reads half a file), and prints progress lines of kind ``bench`` (:mod:`cerar.harness.progress`,
detail: the case's label) that the driver turns into a progress bar. The process starts and
stops as every rank does (:func:`cerar.harness.rank.rank_process`).

With emulated nodes (``ranks_per_node`` G > 1) it also measures, per iteration, the bytes that
the busiest node sent to other nodes at cerar's transport and through its one link.

Config keys: ``world_size``, ``ranks_per_node`` (default 1), ``seed``, ``warmup``, ``iters``, ``out``
and ``cases``, a list of ``{"method", "size_bytes", "iters", "components", "construction", "code"}`` (``code``
a :meth:`cerar.Code.to_dict`, or null; ``iters``, the case's timed iterations, defaults to the config's).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cerar._files import atomic_write_text
from cerar.harness.progress import print_progress
from cerar.harness.rank import exit_rank, rank_process

#: The kind of this worker's progress lines (see :mod:`cerar.harness.progress`).
PROGRESS_KIND = "bench"
#: The most untimed calls a self-calibrating method may take for one size.
MAX_CALIBRATION = 200


def _tx_bytes() -> int | None:
    """Bytes this rank's namespace link has sent so far (slow regime only; headers included)."""
    ifname = os.environ.get("CERAR_IFNAME")
    if not ifname:
        return None
    try:
        return int(Path(f"/sys/class/net/{ifname}/statistics/tx_bytes").read_text())
    except (OSError, ValueError):
        return None


def _inputs(values: int, seed: int, rank: int) -> Any:
    """Rank ``rank``'s input: i.i.d. standard normal float32, reproducible on every rank."""
    import torch

    generator = torch.Generator().manual_seed(seed * 1_000_003 + rank)
    return torch.randn(values, generator=generator, dtype=torch.float32)


def _exact_sum(values: int, seed: int, world_size: int) -> Any:
    """The exact sum of every rank's input in float64, recomputed locally (no communication)."""
    import torch

    total = torch.zeros(values, dtype=torch.float64)
    for rank in range(world_size):
        total += _inputs(values, seed, rank).to(torch.float64)
    return total


class _Progress:
    def __init__(self, total: int, enabled: bool) -> None:
        self.done, self.total, self.enabled = 0, total, enabled

    def tick(self, label: str) -> None:
        self.done += 1
        if self.enabled:
            print_progress(PROGRESS_KIND, self.done, self.total, label)


def run_case(case: dict[str, Any], config: dict[str, Any], x: Any, exact: Any, progress: _Progress) -> dict:
    """Time one case on this rank and return the raw, cross-rank-reduced figures (all ranks)."""
    import torch
    import torch.distributed as dist

    from cerar.coding.code import Code
    from cerar.comm.stats import CommStats
    from cerar.experiments.bench.methods import get_method

    method = get_method(case["method"])
    code = Code.from_dict(case["code"]) if case.get("code") else None
    warmup, iters = int(config["warmup"]), int(case.get("iters", config["iters"]))
    label = f"{method.name}" + (f" c={case['components']}" if method.coded else "") + f" {case['size_bytes'] >> 10}K"
    buf = torch.empty_like(x)
    times, encode, decode, handshake, sent, wire, node_wire = [], [], [], [], [], [], []
    per_node = int(config.get("ranks_per_node", 1))
    rank = dist.get_rank()
    options = {name: case[name] for name in method.options}
    calibration = 0
    # A method that calibrates itself (auto) does so first, untimed, as many calls as it needs
    # (every rank runs the same calls, so every rank knows the same answer).
    while method.calibrating is not None and method.calibrating(x, **options) and calibration < MAX_CALIBRATION:
        buf.copy_(x)
        dist.barrier()
        method.call(buf, code, None, **options)
        calibration += 1
    # Bytes leaving the node at the transport: every rank's for the hierarchical methods, the
    # node's last rank's (its ring hop is the one out of the node) for the flat ones.
    crosses = method.hierarchical or rank % per_node == per_node - 1
    for it in range(warmup + iters):
        buf.copy_(x)
        stats = CommStats() if method.transport_stats else None
        tx_before = _tx_bytes()
        dist.barrier()
        started = time.perf_counter()
        method.call(buf, code, stats, **options)
        elapsed = time.perf_counter() - started
        tx_after = _tx_bytes()
        if it >= warmup:
            times.append(elapsed)
            if stats is not None:
                encode.append(stats.encode_s)
                decode.append(stats.decode_s)
                handshake.append(stats.handshake_s)
                sent.append(stats.bytes_sent)
            if tx_before is not None and tx_after is not None:
                wire.append(tx_after - tx_before)
                node_wire.append(tx_after - tx_before if rank % per_node == 0 else 0)  # one reader per link
        progress.tick(label)

    # The accuracy pass: same input, untimed, compared with the exact float64 sum.
    buf.copy_(x)
    method.call(buf, code, None, **options)
    diff = torch.linalg.vector_norm(buf.to(torch.float64) - exact)
    error = float(diff / torch.linalg.vector_norm(exact))
    progress.tick(label)

    def reduce_max(values: Sequence[float]) -> list[float]:
        if not values:
            return []
        tensor = torch.tensor(list(values), dtype=torch.float64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return tensor.tolist()

    def per_node_max(values: Sequence[float]) -> list[float]:
        """Per iteration, the largest over nodes of the sum over each node's ranks."""
        if not values:
            return []
        mine = torch.tensor(list(values), dtype=torch.float64)
        everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, mine)
        stacked = torch.stack(everyone).view(-1, per_node, len(values)).sum(1)
        return stacked.max(0).values.tolist()

    inter_node = per_node_max([s if crosses else 0.0 for s in sent]) if sent else []
    errors = [torch.zeros(1, dtype=torch.float64) for _ in range(dist.get_world_size())]
    dist.all_gather(errors, torch.tensor([error], dtype=torch.float64))
    return {
        "case": case,
        "times_s": reduce_max(times),  # per iteration, the slowest rank
        "encode_s": reduce_max(encode),
        "decode_s": reduce_max(decode),
        "handshake_s": reduce_max(handshake),
        "bytes_sent": reduce_max(sent),
        "wire_bytes": reduce_max(wire),
        "inter_node_bytes": inter_node,
        "node_wire_bytes": reduce_max(node_wire),
        "rel_errors": [float(e.item()) for e in errors],
        "copy_bandwidth": config.get("copy_bandwidth"),
        "auto": _auto_choice(x, calibration) if method.calibrating is not None else None,
    }


def _auto_choice(x: Any, calibration: int) -> dict[str, Any] | None:
    """What ``method="auto"`` chose for this size: the choice, the candidates, the calibration."""
    from cerar.comm.auto_collective import auto_status

    for stream in auto_status():
        if stream["numel"] == x.numel() and stream["choice"] is not None:
            chosen = next(c for c in stream["candidates"] if c["label"] == stream["choice"]["method"])
            return {**stream["choice"], **{k: chosen[k] for k in ("bytes_per_value", "predicted_error")},
                    "calibration_calls": calibration}  # fmt: skip
    return None


def _slowest_copy_bandwidth() -> float:
    """The copy rate (:func:`cerar.experiments.bench.limit.copy_bandwidth`) measured on every rank
    at once, as their coding runs; the slowest rank's."""
    import torch
    import torch.distributed as dist

    from cerar.experiments.bench.limit import copy_bandwidth

    dist.barrier()
    rate = torch.tensor([copy_bandwidth()], dtype=torch.float64)
    dist.all_reduce(rate, op=dist.ReduceOp.MIN)
    return float(rate)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m cerar.experiments.bench.worker CONFIG.json", file=sys.stderr)
        return 2
    config = json.loads(Path(args[0]).read_text())
    with rank_process() as me:
        rank, world_size = me.rank, me.world_size
        config["copy_bandwidth"] = _slowest_copy_bandwidth()
        cases = config["cases"]
        ticks = sum(int(config["warmup"]) + int(case.get("iters", config["iters"])) + 1 for case in cases)
        progress = _Progress(ticks, enabled=rank == 0)
        seed = int(config["seed"])
        records: list[dict] = []
        current_size, x, exact = None, None, None
        # Cases come sorted by size: one input and one exact sum per size.
        for case in cases:
            if case["size_bytes"] != current_size:
                current_size = case["size_bytes"]
                values = current_size // 4
                x, exact = None, None  # free the previous size first
                x = _inputs(values, seed, rank)
                exact = _exact_sum(values, seed, world_size)
            records.append(run_case(case, config, x, exact, progress))
            if rank == 0:
                atomic_write_text(config["out"], json.dumps(records))
    return 0


if __name__ == "__main__":
    exit_rank(main)
