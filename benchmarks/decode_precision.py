"""CERAR with 16-bit packets: worst-rank error and coding time per call, for comparing decoders.

    python -m cerar.harness.launch -N 4 -- python benchmarks/decode_precision.py
    python -m cerar.harness.launch -N 4 -- python benchmarks/decode_precision.py --size-mb 16 --calls 5

Each rank sums ``--size-mb`` MB of i.i.d. float32 data (a seed per call) with float16 and bfloat16
packets (the default codes) and float32 packets, ``--calls`` times; rank 0 prints, per packet
dtype, the worst relative error over ranks and calls, and the median encode and decode time of a
call (``CommStats``). Run two versions side by side (``PYTHONPATH=<worktree>/src``) to compare.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist

import cerar


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=float, default=16.0)
    parser.add_argument("--calls", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    values = int(args.size_mb * (1 << 20)) // 4
    lines = []
    for packet in (torch.float16, torch.bfloat16, None):
        errors, encode, decode = [], [], []
        for call in range(args.calls + 1):
            x = torch.randn(values, generator=torch.Generator().manual_seed(1000 * call + rank))
            exact = x.double()
            dist.all_reduce(exact)
            stats = cerar.CommStats()
            cerar.all_reduce(x, packet_dtype=packet, stats=stats)
            error = torch.tensor([float((x.double() - exact).norm() / exact.norm())], dtype=torch.float64)
            dist.all_reduce(error, op=dist.ReduceOp.MAX)
            if call:  # the first call warms the buffers and the design cache
                errors.append(float(error))
                encode.append(stats.encode_s * 1e3)
                decode.append(stats.decode_s * 1e3)
        name = str(packet or torch.float32).removeprefix("torch.")
        lines.append(
            f"{name}: worst error {max(errors):.4e}, encode {statistics.median(encode):.1f} ms, "
            f"decode {statistics.median(decode):.1f} ms"
        )
    if rank == 0:
        print(f"{values * 4 / 2**20:.0f} MB per rank; " + "; ".join(lines), flush=True)
    cerar.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
