"""One rank of ``cerar bench``: ``python -m cerar.experiments.bench.worker CONFIG.json``.

Started by :func:`cerar.harness.launch.launch` (which sets ``RANK``, ``WORLD_SIZE``, ``MASTER_*``). For
each case of the config (a method, its code, a message size) the rank runs, in the nccl-tests
manner: warm-up iterations, then timed iterations with a barrier before each; an iteration's time
is the slowest rank's. The cases of one size take turns, one call each per iteration
(:func:`run_size`), so that methods are compared side by side. A separate pass afterwards checks
the result against the exact sum, so the check never sits inside the timed loop. Rank 0 writes
the records to the config's ``out`` path after every size, atomically (a later failure keeps the
earlier results, and the driver never reads half a file), and prints progress lines of kind
``bench`` (:mod:`cerar.harness.progress`, detail: the case's label) that the driver turns into a
progress bar. The process starts and
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


class CaseRun:
    """One case (a method, its code, a size) on this rank: calibrated, then timed one iteration at
    a time (:meth:`time_one`), so that the cases of a size take turns, then checked and reduced
    across ranks (:meth:`finish`)."""

    def __init__(self, case: dict[str, Any], config: dict[str, Any]) -> None:
        from cerar.coding.linear_code import Code
        from cerar.experiments.bench.methods import get_method

        self.case, self.config = case, config
        self.method = method = get_method(case["method"])
        self.code = Code.from_dict(case["code"]) if case.get("code") else None
        self.warmup, self.iters = int(config["warmup"]), int(case.get("iters", config["iters"]))
        coded = f" c={case['components']}" if method.coded else ""
        self.label = f"{method.name}{coded} {case['size_bytes'] >> 10}K"
        self.options = {name: case[name] for name in method.options}
        self.calibration = 0
        self.times: list[float] = []
        self.encode: list[float] = []
        self.decode: list[float] = []
        self.coding_cpu: list[float] = []
        self.handshake: list[float] = []
        self.sent: list[float] = []
        self.wire: list[float] = []
        self.node_wire: list[float] = []

    def calibrate(self, x: Any, buf: Any) -> None:
        """A method that calibrates itself (auto) does so first, untimed, as many calls as it
        needs (every rank runs the same calls, so every rank knows the same answer)."""
        import torch.distributed as dist

        calibrating = self.method.calibrating
        while calibrating is not None and calibrating(x, **self.options) and self.calibration < MAX_CALIBRATION:
            buf.copy_(x)
            dist.barrier()
            self.method.call(buf, self.code, None, **self.options)
            self.calibration += 1

    def time_one(self, it: int, x: Any, buf: Any, progress: _Progress) -> None:
        """Iteration ``it`` (warm-up first): one call from a barrier, timed on this rank."""
        import torch.distributed as dist

        from cerar.comm.runtime.stats import CommStats

        per_node, rank = int(self.config.get("ranks_per_node", 1)), dist.get_rank()
        buf.copy_(x)
        stats = CommStats() if self.method.transport_stats else None
        tx_before = _tx_bytes()
        dist.barrier()
        started = time.perf_counter()
        self.method.call(buf, self.code, stats, **self.options)
        elapsed = time.perf_counter() - started
        tx_after = _tx_bytes()
        if it >= self.warmup:
            self.times.append(elapsed)
            if stats is not None:
                self.encode.append(stats.encode_s)
                self.decode.append(stats.decode_s)
                self.coding_cpu.append(stats.coding_cpu_s)
                self.handshake.append(stats.handshake_s)
                self.sent.append(stats.bytes_sent)
            if tx_before is not None and tx_after is not None:
                self.wire.append(tx_after - tx_before)
                self.node_wire.append(tx_after - tx_before if rank % per_node == 0 else 0)  # one reader per link
        progress.tick(self.label)

    def finish(self, x: Any, exact: Any, buf: Any, progress: _Progress) -> dict:
        """The accuracy pass (same input, untimed, against the exact float64 sum, never inside
        the timed loop) and the raw figures, reduced across ranks (all ranks call it)."""
        import torch
        import torch.distributed as dist

        buf.copy_(x)
        self.method.call(buf, self.code, None, **self.options)
        diff = torch.linalg.vector_norm(buf.to(torch.float64) - exact)
        error = float(diff / torch.linalg.vector_norm(exact))
        progress.tick(self.label)
        per_node, rank = int(self.config.get("ranks_per_node", 1)), dist.get_rank()

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

        # Bytes leaving the node at the transport: every rank's for the hierarchical methods, the
        # node's last rank's (its ring hop is the one out of the node) for the flat ones.
        crosses = self.method.hierarchical or rank % per_node == per_node - 1
        inter_node = per_node_max([s if crosses else 0.0 for s in self.sent]) if self.sent else []
        errors = [torch.zeros(1, dtype=torch.float64) for _ in range(dist.get_world_size())]
        dist.all_gather(errors, torch.tensor([error], dtype=torch.float64))
        return {
            "case": self.case,
            "times_s": reduce_max(self.times),  # per iteration, the slowest rank
            "encode_s": reduce_max(self.encode),
            "decode_s": reduce_max(self.decode),
            "coding_cpu_s": reduce_max(self.coding_cpu),
            "handshake_s": reduce_max(self.handshake),
            "bytes_sent": reduce_max(self.sent),
            "wire_bytes": reduce_max(self.wire),
            "inter_node_bytes": inter_node,
            "node_wire_bytes": reduce_max(self.node_wire),
            "rel_errors": [float(e.item()) for e in errors],
            "copy_bandwidth": self.config.get("copy_bandwidth"),
            "auto": _auto_choice(x, self.calibration) if self.method.calibrating is not None else None,
        }


def run_size(
    cases: list[dict[str, Any]], config: dict[str, Any], x: Any, exact: Any, progress: _Progress
) -> list[dict]:
    """The cases of one size, side by side: each calibrates (auto), then iteration by iteration
    every case takes one timed call in turn, so that a slow spell of the machine (four ranks
    share two cores here) falls on every method alike instead of on whichever ran then; the
    turn starts one case later each iteration, so that no method always follows the same one
    (a call finds the link, the sockets and the caches as the call before left them); then
    each is checked. Returns their records (all ranks)."""
    import torch

    runs = [CaseRun(case, config) for case in cases]
    buf = torch.empty_like(x)
    for run in runs:
        run.calibrate(x, buf)
    for it in range(max(run.warmup + run.iters for run in runs)):
        shift = it % len(runs)
        for run in runs[shift:] + runs[:shift]:
            if it < run.warmup + run.iters:
                run.time_one(it, x, buf, progress)
    return [run.finish(x, exact, buf, progress) for run in runs]


def _auto_choice(x: Any, calibration: int) -> dict[str, Any] | None:
    """What ``method="auto"`` chose for this size: the choice, the candidates, the calibration."""
    from cerar.comm.auto.collective import auto_status

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
        # Cases come sorted by size: one input and one exact sum per size, its cases side by side.
        sizes = sorted({case["size_bytes"] for case in cases}, key=[c["size_bytes"] for c in cases].index)
        for size in sizes:
            values = size // 4
            x = _inputs(values, seed, rank)
            exact = _exact_sum(values, seed, world_size)
            records += run_size([c for c in cases if c["size_bytes"] == size], config, x, exact, progress)
            del x, exact  # free this size before the next
            if rank == 0:
                atomic_write_text(config["out"], json.dumps(records))
    return 0


if __name__ == "__main__":
    exit_rank(main)
