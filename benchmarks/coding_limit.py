"""The coding limit probe on its own: this machine's copy rate, per coded method the bytes its
coding must move per value, and the compiled kernels' time against that limit, one thread alone.

    python benchmarks/coding_limit.py
    python benchmarks/coding_limit.py -N 8 -c 16 --sizes 16,64

One process, one thread (``torch.set_num_threads(1)``, as each rank of ``cerar bench``). The bench
measures the same rate on every rank at once and records ``coding_limit_ratio`` per coded case
(:mod:`cerar.experiments.bench.limit` says what the bytes are); there four ranks share the
cores, so a call's coding also waits for a core. Here the kernels (:mod:`cerar.comm.algorithms.native`: the
encode, the decode of float32 and of float16 packets) run alone, each repeat beside a copy of the
same size, and each is reported as the median over repeats of its time over the limit at that
repeat's copy rate: what the kernels themselves cost, apart from the machine's sharing. Their
speed does not depend on the values: the matrices are random, of the code's shapes.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from cerar.comm.algorithms import native
from cerar.experiments.bench.limit import coding_bytes_per_value, copy_bandwidth
from cerar.experiments.bench.methods import ALL_REDUCE_METHODS


def _timed(run) -> float:
    started = time.perf_counter()
    run()
    return time.perf_counter() - started


def time_kernels(megabytes: float, world_size: int, c: int, repeats: int) -> dict[str, tuple[float, float]] | None:
    """Per kernel, (median time in s, median of time / limit) for ``megabytes`` of float32; None
    where there is no compiled coding for ``c`` here (:func:`cerar.comm.algorithms.native.status`)."""
    rounds = c + world_size - 2
    d = int(megabytes * (1 << 20)) // 4 // c * c
    w = d // c
    g = torch.Generator().manual_seed(0)
    cpu = torch.device("cpu")
    encoder = native.fused_encoder(torch.randn(rounds, c, generator=g), torch.float32, cpu)
    matrices = torch.randn(c, c, dtype=torch.float64, generator=g), torch.randn(c, c, dtype=torch.float64, generator=g)
    if encoder is None:
        return None
    x, out = torch.randn(w, c, generator=g), torch.empty(w, c)
    increments = torch.empty(rounds, w)
    source, target = torch.ones(d), torch.empty(d)
    runs = {"encode": lambda: encoder.encode(x, increments)}
    bytes_per_value = {"encode": 4 * (1 + rounds / c)}
    for name, packet in (("decode fp32", torch.float32), ("decode fp16", torch.float16)):
        decoder = native.fused_decoder(*matrices, torch.float32, packet, cpu)
        assert decoder is not None
        observations = torch.randn(c, w, generator=g).to(packet)
        runs[name] = lambda decoder=decoder, observations=observations: decoder.decode(x, observations, 1.0, out)
        bytes_per_value[name] = packet.itemsize + 2 * 4
    for run in (lambda: target.copy_(source), *runs.values()):
        run()  # pages faulted in, the library loaded
    times: dict[str, list[float]] = {name: [] for name in runs}
    ratios: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        rate = 2 * 4 * d / _timed(lambda: target.copy_(source))
        for name, run in runs.items():
            elapsed = _timed(run)
            times[name].append(elapsed)
            ratios[name].append(elapsed / (bytes_per_value[name] * d / rate))
    return {name: (statistics.median(times[name]), statistics.median(ratios[name])) for name in runs}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-N", "--world-size", type=int, default=4)
    parser.add_argument("-c", "--components", type=int, default=8)
    parser.add_argument("--sizes", default="16,64", help="message sizes in MB (float32)")
    parser.add_argument("--repeats", type=int, default=9, help="timed repeats per size (median)")
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
    print(f"compiled kernels alone ({native.status()}), time and x limit, median of {args.repeats}:")
    for size in sizes:
        kernels = time_kernels(size, args.world_size, args.components, args.repeats)
        if kernels is None:
            print(f"  no compiled coding for c = {args.components} here: {native.status()}")
            return
        cells = ", ".join(f"{name} {t * 1e3:.2f} ms ({ratio:.2f}x)" for name, (t, ratio) in kernels.items())
        print(f"  {size:g} MB: {cells}")


if __name__ == "__main__":
    main()
