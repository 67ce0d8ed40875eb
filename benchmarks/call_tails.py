"""Per-call time spread (median, 90th percentile, maximum) of Gloo's all-reduce, cerar's float16
ring and CERAR in float32 and float16 packets, taking turns call by call, and the CPU time each
call costs its process (user and system, every thread: Gloo's, cerar's communication thread),
beside the point-to-point messages 16-bit CERAR posts per call sent alone, without its coding or
its Python (``p2p alone``): what the messages themselves cost; ``rounds alone`` leaves out the
handshake's messages too, the floor of any engine that runs CERAR's rounds on this transport.

    python -m cerar.harness.launch -N 4 --regime slow --rate 400mbit -- python benchmarks/call_tails.py
    python -m cerar.harness.launch -N 4 --regime slow --rate 100mbit -- python benchmarks/call_tails.py --size 1M

A DDP step sums many calls, so a call's rare slow ones cost a step as much as its median does:
this shows them, where ``cerar bench`` reports medians. An iteration's time is the slowest rank's
(a barrier before each call); rank 0 prints one line per method. The CPU columns are means over
calls and ranks: where ranks share cores (and in DDP, where the calls run beside backward), a
call's CPU is taken from the ranks' compute, whatever its wall-clock time. ``gloo-fp16`` is what
torch's ``fp16_compress_hook`` runs: a cast to float16, Gloo's all-reduce, a cast back. Run it from two trees
(``PYTHONPATH=<worktree>/src``) to compare transports or emulated links side by side.
"""

from __future__ import annotations

import argparse
import functools
import resource
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

import cerar
from cerar import codes
from cerar._checks import parse_size
from cerar.comm.runtime.handshake import dissemination_distances


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="1M", help="bytes of float32 per call, e.g. 1M, 4M (default 1M)")
    parser.add_argument("--calls", type=int, default=60, help="timed calls per method (default 60)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed calls per method first (default 5)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    values = parse_size(args.size, "size") // 4
    x = torch.randn(values, generator=torch.Generator().manual_seed(rank))
    fp32_code, fp16_code = codes.perturbed(world, 2 * world), codes.optimized(world, 2 * world, "fp16")
    methods: dict[str, Callable[[torch.Tensor], object]] = {
        "builtin": dist.all_reduce,
        "gloo-fp16": _gloo_fp16,
        "ring-fp16": functools.partial(cerar.ring_all_reduce, wire_dtype=torch.float16),
        f"cerar c={2 * world}": functools.partial(cerar.all_reduce, code=fp32_code),
        f"cerar-fp16 c={2 * world}": functools.partial(cerar.all_reduce, code=fp16_code, packet_dtype=torch.float16),
        "p2p alone": _messages_alone(world, values, 2 * world, handshake=True),
        "rounds alone": _messages_alone(world, values, 2 * world, handshake=False),
    }
    times: dict[str, list[float]] = {name: [] for name in methods}
    cpu = {name: torch.zeros(2, dtype=torch.float64) for name in methods}  # user, system seconds
    for i in range(args.warmup + args.calls):
        for name, call in methods.items():
            work = x.clone()
            dist.barrier()
            before = resource.getrusage(resource.RUSAGE_SELF)
            started = time.perf_counter()
            call(work)
            elapsed = torch.tensor([time.perf_counter() - started], dtype=torch.float64)
            after = resource.getrusage(resource.RUSAGE_SELF)
            if i >= args.warmup:
                cpu[name] += torch.tensor([after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            times[name].append(elapsed.item())
    for used in cpu.values():
        dist.all_reduce(used)  # summed over ranks: divided by ranks and calls below
    if rank == 0:
        print(f"N = {world}, {args.size} of float32, {args.calls} calls each (ms; time: slowest rank; CPU: per rank):")
        for name, seconds in times.items():
            timed = [t * 1e3 for t in seconds[args.warmup :]]
            p90 = statistics.quantiles(timed, n=10)[-1]
            median = statistics.median(timed)
            user, system = (1e3 * cpu[name] / (world * args.calls)).tolist()
            print(
                f"  {name:14s} median {median:7.1f}  p90 {p90:7.1f}  max {max(timed):7.1f}  "
                f"CPU {user + system:6.2f} (user {user:5.2f}, system {system:5.2f})",
                flush=True,
            )
    cerar.shutdown()
    dist.destroy_process_group()


def _messages_alone(world: int, values: int, components: int, handshake: bool) -> Callable[[torch.Tensor], object]:
    """The messages of one 16-bit CERAR call of a layout the ranks agreed before, each waited for
    in turn: the handshake (its header to both ring neighbours, then one hop per further
    dissemination distance; left out with ``handshake=False``) and ``c + N - 2`` rounds of
    ``values / c`` float16 values. Without the handshake it is the floor of any engine that runs
    CERAR's rounds as messages on this transport."""
    rank, pg = dist.get_rank(), dist.group.WORLD
    header, arrived = torch.zeros(6, dtype=torch.float64), torch.empty(2, 6, dtype=torch.float64)
    packet = torch.zeros(-(-values // components), dtype=torch.float16)
    landed = torch.empty_like(packet)
    hops = [(1, packet, landed)] * (components + world - 2)

    def messages(_: torch.Tensor) -> None:
        if not handshake:
            return rounds([])
        works = [
            pg.recv([arrived[0]], (rank - 1) % world, 5), pg.recv([arrived[1]], (rank + 1) % world, 5),
            pg.send([header], (rank + 1) % world, 5), pg.send([header], (rank - 1) % world, 5),
        ]  # fmt: skip
        for work in works:
            work.wait()
        return rounds(dissemination_distances(world)[1:])

    def rounds(distances: list[int]) -> None:
        for distance, sent, received in [(d, header, arrived[0]) for d in distances] + hops:
            recv_work = pg.recv([received], (rank - distance) % world, 6)
            send_work = pg.send([sent], (rank + distance) % world, 6)
            recv_work.wait()
            send_work.wait()

    return messages


def _gloo_fp16(tensor: torch.Tensor) -> None:
    """What torch's ``fp16_compress_hook`` does with a bucket (without its division)."""
    packed = tensor.to(torch.float16)
    dist.all_reduce(packed)
    tensor.copy_(packed)


if __name__ == "__main__":
    main()
