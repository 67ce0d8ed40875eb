"""The coding limit probe on its own: this machine's copy rate, and per coded method the bytes
its coding must move per value and the time that takes for a few sizes.

    python benchmarks/coding_limit.py
    python benchmarks/coding_limit.py -N 8 -c 16 --sizes 16,64

One process, one thread (``torch.set_num_threads(1)``, as each rank of ``cerar bench``). The bench
measures the same rate on every rank at once and records ``coding_limit_ratio`` per coded case
(:mod:`cerar.experiments.bench.limit` says what the bytes are).
"""

from __future__ import annotations

import argparse

import torch

from cerar.experiments.bench.limit import coding_bytes_per_value, copy_bandwidth
from cerar.experiments.bench.methods import ALL_REDUCE_METHODS


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-N", "--world-size", type=int, default=4)
    parser.add_argument("-c", "--components", type=int, default=8)
    parser.add_argument("--sizes", default="16,64", help="message sizes in MB (float32)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rate = copy_bandwidth()
    print(f"copy rate (read + write): {rate / 1e9:.2f} GB/s, one thread")
    sizes = [float(s) for s in args.sizes.split(",")]
    for name, method in ALL_REDUCE_METHODS.items():
        per_value = coding_bytes_per_value(method, args.world_size, args.components)
        if per_value is None or method.hierarchical:
            continue
        limits = ", ".join(f"{s:g} MB {per_value * s * (1 << 20) / 4 / rate * 1e3:.1f} ms" for s in sizes)
        print(f"{name} (N = {args.world_size}, c = {args.components}): {per_value:g} bytes per value; limit {limits}")


if __name__ == "__main__":
    main()
