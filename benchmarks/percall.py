"""Per-call time of cerar.all_reduce on loopback, where the CPU and the fixed cost decide.

    python -m cerar.harness.launch -N 4 -- python benchmarks/percall.py
    python -m cerar.harness.launch -N 4 -- python benchmarks/percall.py --calls 100 --warmup 20

Each rank times ``--calls`` calls (after ``--warmup``) of three cases: 1 MB of float32 with
``perturbed(N, 2N)``, 1 MB with float16 packets (``optimized(N, 2N, "fp16")``) and 16 KB with
``perturbed(N, 2N)``; a barrier before each call lines the ranks up. Rank 0 prints the medians.
Run old and new code side by side (``PYTHONPATH=<worktree>/src``) to compare per-call costs.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import cerar
from cerar import codes


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=10)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cases = [
        ("1 MB float32", 1 << 18, None, codes.perturbed(world, 2 * world)),
        ("1 MB float16 packets", 1 << 18, torch.float16, codes.optimized(world, 2 * world, "fp16")),
        ("16 KB float32", 1 << 12, None, codes.perturbed(world, 2 * world)),
    ]
    found = []
    for name, size, packet, code in cases:
        x = torch.randn(size, generator=torch.Generator().manual_seed(rank))
        times = []
        for _ in range(args.warmup + args.calls):
            y = x.clone()
            dist.barrier()
            started = time.perf_counter()
            cerar.all_reduce(y, code=code, packet_dtype=packet)
            times.append(time.perf_counter() - started)
        found.append(f"{name} {statistics.median(times[args.warmup :]) * 1e3:.2f} ms")
    if rank == 0:
        print(f"N = {world}, median per call: " + ", ".join(found), flush=True)
    cerar.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
