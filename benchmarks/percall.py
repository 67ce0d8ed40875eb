"""Per-call time of cerar.all_reduce on loopback, where the CPU and the fixed cost decide.

    python -m cerar.harness.launch -N 4 -- python benchmarks/percall.py
    python -m cerar.harness.launch -N 4 -- python benchmarks/percall.py --calls 100 --warmup 20

Each rank times ``--calls`` calls (after ``--warmup``) of three cases: 1 MB of float32 with
``perturbed(N, 2N)``, 1 MB with float16 packets (``optimized(N, 2N, "fp16")``) and 16 KB with
``perturbed(N, 2N)``; a barrier before each call lines the ranks up. Beside each, the same
call's messages without cerar: as many ring hops (handshake hops plus rounds) of packets the
same size, posted straight on the process group and waited for one round at a time, a Gloo
ping-pong around the ring. What cerar adds to it (``+``) is its coding and its Python per
round. Rank 0 prints the medians. Run old and new code side by side
(``PYTHONPATH=<worktree>/src``) to compare per-call costs.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

import cerar
from cerar import codes
from cerar.comm.runtime.handshake import dissemination_distances


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
        stats, wire = cerar.CommStats(), packet or torch.float32
        coded = _median_ms(functools.partial(_cerar_call, x, code, packet, stats), args)
        hops = stats.rounds // stats.calls + len(dissemination_distances(world))
        packet_values = stats.bytes_sent // stats.rounds // wire.itemsize
        raw = _median_ms(functools.partial(_ping_pong, hops, packet_values, wire), args)
        found.append(f"{name} {coded:.2f} ms ({hops} hops of raw Gloo {raw:.2f} ms, + {coded - raw:.2f})")
    if rank == 0:
        print(f"N = {world}, median per call: " + "; ".join(found), flush=True)
    cerar.shutdown()
    dist.destroy_process_group()


def _cerar_call(x: torch.Tensor, code: cerar.Code, packet: torch.dtype | None, stats: cerar.CommStats) -> None:
    cerar.all_reduce(x.clone(), code=code, packet_dtype=packet, stats=stats)


def _median_ms(call: Callable[[], None], args: argparse.Namespace) -> float:
    times = []
    for _ in range(args.warmup + args.calls):
        dist.barrier()
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return statistics.median(times[args.warmup :]) * 1e3


def _ping_pong(hops: int, values: int, dtype: torch.dtype) -> None:
    """``hops`` ring hops of ``values``-value packets, each waited for before the next."""
    rank, world = dist.get_rank(), dist.get_world_size()
    send, recv = torch.zeros(values, dtype=dtype), torch.empty(values, dtype=dtype)
    pg = dist.group.WORLD
    for _ in range(hops):
        recv_work = pg.recv([recv], (rank - 1) % world, 7)
        send_work = pg.send([send], (rank + 1) % world, 7)
        recv_work.wait()
        send_work.wait()


if __name__ == "__main__":
    main()
