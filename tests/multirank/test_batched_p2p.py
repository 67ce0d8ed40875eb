"""The accelerator's point-to-point branch (one ``batch_isend_irecv`` batch per piece, as NCCL
needs) forced on Gloo: the same results, bit for bit, as the plain branch CPU tensors take, for
CERAR (float32 and 16-bit packets), the exact ring and a settings mismatch."""

from __future__ import annotations

import torch
import torch.distributed as dist

import cerar
from cerar.coding import codes
from cerar.comm.runtime import links
from multirank import check, run_ranks


def _calls(rank: int, world: int) -> list[torch.Tensor]:
    out = []
    for seed, (packet, code) in enumerate(
        [(None, codes.perturbed(world, 2 * world)), (torch.float16, None), (None, codes.exact(world))]
    ):
        x = torch.randn(300_001, generator=torch.Generator().manual_seed(10 * rank + seed))  # several pieces
        cerar.all_reduce(x, packet_dtype=packet, code=code)
        out.append(x)
    y = torch.randn(70_000, generator=torch.Generator().manual_seed(rank))
    cerar.ring_all_reduce(y, wire_dtype=torch.bfloat16)
    out.append(y)
    return out


def _both_branches_worker(rank: int, world: int) -> tuple[list[bool], str, int, int]:
    batches = []
    original = dist.batch_isend_irecv

    def counting(ops):
        batches.append(len(ops))
        return original(ops)

    dist.batch_isend_irecv = counting
    links.BATCH_ON_CPU = False
    plain = _calls(rank, world)
    plain_batches = len(batches)
    links.BATCH_ON_CPU = True
    try:
        batched = _calls(rank, world)
        try:
            cerar.all_reduce(torch.randn(100 + (rank == 1)), code=codes.perturbed(world, 8))
            mismatch = "no error"
        except cerar.SettingsMismatchError as exc:
            mismatch = type(exc).__name__
    finally:
        links.BATCH_ON_CPU = False
        dist.batch_isend_irecv = original
    equal = [bool(torch.equal(a, b)) for a, b in zip(plain, batched, strict=True)]
    return equal, mismatch, plain_batches, len(batches)


def test_the_batched_branch_gives_the_plain_branchs_results() -> None:
    for equal, mismatch, plain_batches, batches in check(run_ranks(_both_branches_worker, 4, timeout=120)):
        assert all(equal), equal
        assert mismatch == "SettingsMismatchError"
        assert plain_batches == 0 and batches > 0  # every piece of every round, and the handshake's hops
