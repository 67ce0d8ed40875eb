"""CERAR's per-rank compute on a CUDA device: encode, decode and the 16-bit casts, timed against a
device-to-device copy of the same bytes, and checked against the CPU path.

    python benchmarks/gpu_check.py                    # N = 4, c = 8, 16/64/256 MB
    python benchmarks/gpu_check.py -N 8 -c 16 --sizes 16,64

One process, no process group: the work a rank does besides moving bytes is the same whatever
the network. For each message size (MB of float32) and a middle rank (the worst decoder):

* encode: all ``L = c + N - 2`` rounds as the collective computes them: each piece's
  increments ``max(4, c / 2)`` rounds at a time (``encode_rounds``, one ``(B, c) x (c, w)``
  product on the piece's rows), then each round's packet ``received + X f_t`` (one add), 16 pieces per round as
  the transport cuts a large packet (``cerar.comm.runtime.engine``);
* decode: the collective's ``fold_slots`` over its groups of observation slots, in float64
  in the ``(c, w)`` layout (the own part ``D X``, in float32, with the first group, then one ``addmm`` per
  group), piece by piece;
* casts: float32 -> float16 -> float32 and float32 -> bfloat16 -> float32 of the whole message;
* copy: ``dst.copy_(src)`` of the same number of bytes, the floor any of these is measured against.

With two or more CUDA devices it then runs the collective itself on CUDA tensors over NCCL, one
rank per device (NCCL refuses two ranks on one device): ``cerar.all_reduce`` with float32 and
float16 packets, synchronous and async (the tensor written on the caller's stream just before the
call, read on it just after ``wait()``: the stream ordering of ``cerar.comm.runtime.thread``),
``ring_all_reduce``, DDP steps with ``cerar.ddp.cerar_hook``, an async all-reduce on cerar's
process group (``wait()`` ordering the caller's stream) and DDP over that group, each against
``torch.distributed.all_reduce``'s sum (:func:`collective_check`; the suite runs the same function
on Gloo and the CPU).

Each figure is the median of ``--iters`` runs timed with CUDA events. The CPU check runs the same
encode and decode on the CPU and prints the largest relative difference (float32 encode: ~1e-6;
the float64 decode, written back in float32: ~1e-7). Exits 0 with a note when no CUDA device
is present (CI never needs one).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time

import torch

from cerar import codes
from cerar.comm.algorithms.cerar.decode import fold_slots, own_part
from cerar.comm.algorithms.cerar.encode import encode_rounds
from cerar.comm.algorithms.cerar.plans import rank_matrices, round_batches, rounds_per_product, slot_groups


def _timed(fn, iters: int, device: torch.device) -> float:
    """Median milliseconds of ``fn()`` (CUDA events on a GPU, the wall clock on the CPU), after
    one warm-up run."""
    fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(stop))
        else:
            began = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - began))
    return statistics.median(times)


_PIECES = 16


def _pieces(m: int) -> list[tuple[int, int]]:
    edges = [round(m * k / _PIECES) for k in range(_PIECES + 1)]
    return [(a, b) for a, b in itertools.pairwise(edges) if b > a]


def _encode(rows_f: torch.Tensor, own: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Every round's packet, piece by piece, as the collective sends them (into ``out[t % 2]``)."""
    c, rounds = own.shape[1], rows_f.shape[0]
    per_product = rounds_per_product(c)
    increments = torch.empty(per_product, own.shape[0], dtype=own.dtype, device=own.device)
    for first, stop in round_batches(rounds, per_product):
        batch = torch.zeros(per_product, c, dtype=own.dtype, device=own.device)
        batch[: stop - first] = rows_f[first - 1 : stop - 1]
        for a, b in _pieces(own.shape[0]):
            encode_rounds(batch, own[a:b], increments[:, a:b])
        for t in range(first, stop):
            for a, b in _pieces(own.shape[0]):
                increment = increments[t - first, a:b]
                if t == 1:
                    out[t % 2, a:b].copy_(increment)
                else:
                    torch.add(out[(t - 1) % 2, a:b], increment, out=out[t % 2, a:b])
    return out


def _decode(plan, own: torch.Tensor, obs: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """The float64 sum ``(c, m)`` from the own rows and the ``c`` observation packets, group by group."""
    for start, stop in slot_groups(obs.shape[0]):
        weights = plan.decode_obs[:, start:stop].contiguous()
        for a, b in _pieces(own.shape[0]):
            begin = (
                own_part(plan.decode_own.to(own.dtype), own[a:b], torch.empty_like(own[a:b].t()))
                if start == 0
                else None
            )
            fold_slots(total[:, a:b], obs[start:stop, a:b].double(), weights, begin)
    return total


def check_size(code, rank: int, size_mb: float, iters: int, device: str = "cuda") -> dict[str, float]:
    """One row of the table: times in ms and the device-vs-CPU relative differences."""
    c = code.components
    m = int(size_mb * (1 << 20)) // 4 // c
    gpu = torch.device(device)
    generator = torch.Generator().manual_seed(m)
    own_cpu = torch.randn(m, c, generator=generator)  # the (m, c) rows of a rank's flat values
    obs_cpu = torch.randn(c, m, generator=generator)
    plan_gpu = rank_matrices(code, rank, gpu)
    plan_cpu = rank_matrices(code, rank, torch.device("cpu"))
    rows_gpu, rows_cpu = plan_gpu.increments.float(), plan_cpu.increments.float()
    own, obs = own_cpu.to(gpu), obs_cpu.to(gpu)
    packets = torch.empty(2, m, device=gpu)
    total = torch.empty(c, m, dtype=torch.float64, device=gpu)
    row = {"size_mb": size_mb}
    row["copy_ms"] = _timed(lambda: torch.empty_like(own).copy_(own), iters, gpu)
    row["encode_ms"] = _timed(lambda: _encode(rows_gpu, own, packets), iters, gpu)
    row["decode_ms"] = _timed(lambda: _decode(plan_gpu, own, obs, total), iters, gpu)
    row["fp16_cast_ms"] = _timed(lambda: own.to(torch.float16).to(torch.float32), iters, gpu)
    row["bf16_cast_ms"] = _timed(lambda: own.to(torch.bfloat16).to(torch.float32), iters, gpu)
    # The same arithmetic on the CPU: the device path must agree with it.
    packets_cpu = _encode(rows_cpu, own_cpu, torch.empty(2, m))
    decoded_cpu = _decode(plan_cpu, own_cpu, obs_cpu, torch.empty(c, m, dtype=torch.float64))
    _encode(rows_gpu, own, packets)
    _decode(plan_gpu, own, obs, total)
    row["encode_rel_diff"] = float((packets.cpu() - packets_cpu).norm() / packets_cpu.norm())
    row["decode_rel_diff"] = float((total.cpu() - decoded_cpu).norm() / decoded_cpu.norm())
    return row


def _collective_rank(rank: int, world: int, port: int, backend: str, device_type: str, results) -> None:
    import datetime
    import os

    import torch.distributed as dist

    import cerar
    from cerar import ddp

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    errors: dict[str, float] = {}
    try:
        generator = torch.Generator().manual_seed(rank)
        x = torch.randn(1_000_003, generator=generator).to(device)

        def exact(t: torch.Tensor) -> torch.Tensor:
            total = t.clone()
            dist.all_reduce(total)
            return total

        def relative(got: torch.Tensor, want: torch.Tensor) -> float:
            return float((got.double() - want.double()).norm() / want.double().norm())

        for name, packet in (("cerar fp32", None), ("cerar fp16", torch.float16)):
            y = x.clone()
            cerar.all_reduce(y, packet_dtype=packet)
            errors[name] = relative(y, exact(x))
        # Async, with the input written on the caller's stream right before the call and read on
        # it right after wait(): only the events order them.
        z = torch.empty_like(x)
        z.copy_(x).mul_(2.0)
        work = cerar.all_reduce(z, async_op=True)
        work.wait()
        errors["cerar async"] = relative(z.clone(), exact(2.0 * x))
        future = cerar.all_reduce(w := x.clone(), async_op=True).get_future()
        errors["cerar future"] = relative(future.wait()[0], exact(x))
        del w
        r = x.clone()
        cerar.ring_all_reduce(r, wire_dtype=torch.float16)
        errors["ring fp16"] = relative(r, exact(x))
        # DDP with cerar's hook against the same model with torch's own all-reduce.
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 64)).to(device)
        reference = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 64)).to(device)
        reference.load_state_dict(model.state_dict())
        ids = [rank] if device.type == "cuda" else None
        coded = torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)
        coded.register_comm_hook(ddp.CerarState(), ddp.cerar_hook)
        plain = torch.nn.parallel.DistributedDataParallel(reference, device_ids=ids)
        batch = torch.randn(32, 256, generator=generator).to(device)
        for net in (coded, plain):
            net(batch).square().mean().backward()
        grads = [torch.cat([p.grad.reshape(-1) for p in net.parameters()]) for net in (coded, plain)]
        errors["ddp cerar_hook"] = relative(*grads)
        # cerar's process group: an async all-reduce whose wait() orders the caller's stream (the
        # input written on it just before, read on it just after), and DDP with the group, no hook.
        import cerar.group

        group = cerar.group.new_group(min_bytes=0)
        g = torch.empty_like(x)
        g.copy_(x).mul_(3.0)
        dist.all_reduce(g, group=group, async_op=True).wait()
        errors["group async"] = relative(g.clone(), exact(3.0 * x))
        torch.manual_seed(0)
        grouped_model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 64))
        grouped_model.load_state_dict(model.state_dict())
        wrap = torch.nn.parallel.DistributedDataParallel
        grouped = wrap(grouped_model.to(device), device_ids=ids, process_group=group)
        grouped(batch).square().mean().backward()
        grouped_grad = torch.cat([p.grad.reshape(-1) for p in grouped.parameters()])
        errors["ddp group"] = relative(grouped_grad, grads[1])
        cerar.shutdown()
        results.put((rank, errors))
    except BaseException as exc:  # reported to the parent
        results.put((rank, f"{type(exc).__name__}: {exc}"))
    finally:
        dist.destroy_process_group()


def collective_check(world: int, backend: str = "nccl", device_type: str = "cuda", timeout_s: float = 300.0) -> dict:
    """Run the collective and the DDP hook on ``world`` ranks (one per CUDA device with NCCL);
    return each check's worst relative error over the ranks against ``dist.all_reduce``."""
    import multiprocessing as mp
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    # CUDA cannot be used in a forked child once the parent has touched it; the CPU check (the
    # suite, which loads this file by path, where spawn could not import it) forks.
    context = mp.get_context("spawn" if device_type == "cuda" else "fork")
    results = context.Queue()
    ranks = [
        context.Process(target=_collective_rank, args=(r, world, port, backend, device_type, results))
        for r in range(world)
    ]
    for process in ranks:
        process.start()
    found = {}
    try:
        for _ in range(world):
            rank, value = results.get(timeout=timeout_s)
            if isinstance(value, str):
                raise RuntimeError(f"gpu_check: rank {rank} failed: {value}")
            found[rank] = value
    finally:
        for process in ranks:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    return {name: max(found[r][name] for r in found) for name in found[0]}


#: Worst relative errors the collective check accepts: the default codes' predicted worst-rank
#: errors (2e-4 in float32, 1.6e-2 with float16 packets at N = 4) with room for N up to 8.
COLLECTIVE_LIMITS = {"cerar fp32": 1e-3, "cerar fp16": 5e-2, "cerar async": 1e-3, "cerar future": 1e-3,
                     "ring fp16": 5e-3, "ddp cerar_hook": 1e-3, "group async": 1e-3, "ddp group": 1e-3}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-N", "--world-size", type=int, default=4)
    parser.add_argument("-c", "--components", type=int, default=8)
    parser.add_argument("--sizes", default="16,64,256", help="message sizes in MB (float32)")
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; nothing to check (run it where one is at hand).")
        return 0
    code = codes.perturbed(args.world_size, args.components)
    rank = args.world_size // 2
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, {code!r}, rank {rank}")
    header = ("size MB", "copy ms", "encode ms", "x copy", "decode ms", "x copy", "fp16 cast", "bf16 cast",
              "encode diff", "decode diff")  # fmt: skip
    print(" | ".join(header))
    for size in (int(s) for s in args.sizes.split(",")):
        r = check_size(code, rank, size, args.iters)
        print(
            f"{size} | {r['copy_ms']:.3f} | {r['encode_ms']:.3f} | {r['encode_ms'] / r['copy_ms']:.1f} | "
            f"{r['decode_ms']:.3f} | {r['decode_ms'] / r['copy_ms']:.1f} | {r['fp16_cast_ms']:.3f} | "
            f"{r['bf16_cast_ms']:.3f} | {r['encode_rel_diff']:.1e} | {r['decode_rel_diff']:.1e}"
        )
        if r["encode_rel_diff"] > 1e-4 or r["decode_rel_diff"] > 1e-6:
            print("gpu_check: the device path disagrees with the CPU path", file=sys.stderr)
            return 1
    devices = torch.cuda.device_count()
    if devices < 2:
        print("gpu_check: the collective on CUDA tensors needs 2+ GPUs (NCCL takes one rank per GPU); skipped.")
        return 0
    world = min(devices, args.world_size)
    worst = collective_check(world)
    print(f"collective on {world} GPUs over NCCL, worst relative error against dist.all_reduce:")
    failed = False
    for name, error in worst.items():
        ok = error <= COLLECTIVE_LIMITS[name]
        failed |= not ok
        print(f"  {name}: {error:.2e} (limit {COLLECTIVE_LIMITS[name]:.0e}){'' if ok else '  FAILED'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
