"""The per-call handshake (cerar.comm.runtime.handshake): no collective of cerar's on the caller's group,
call counts checked, non-finite decisions identical on every rank."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist

import cerar
from cerar.coding import codes
from cerar.comm.runtime import handshake
from cerar.comm.runtime.links import Ring
from cerar.comm.runtime.stats import CommStats
from multirank import RankFailure, check, run_ranks

pytestmark = pytest.mark.multirank


def _alternation_worker(rank: int, world: int) -> list[str]:
    """An async cerar call, then the program's own all-reduce on the same (default) group from
    the main thread while cerar's is in flight, 20 times: both results must be right."""
    failures = []
    code = codes.perturbed(world, 2 * world)
    bound = 10 * float(max(code.error_bound)) + 1e-5
    for i in range(20):
        x = torch.full((50_000,), float(rank + i))
        expected = float(sum(r + i for r in range(world)))
        work = cerar.all_reduce(x, code=code, async_op=True)
        y = torch.full((1000 + i,), float(rank))
        dist.all_reduce(y)
        work.wait()
        if not torch.allclose(y, torch.full_like(y, float(sum(range(world))))):
            failures.append(f"iteration {i}: dist.all_reduce gave {y[0].item()}")
        error = float((x - expected).abs().max()) / expected if expected else float(x.abs().max())
        if error > bound:
            failures.append(f"iteration {i}: cerar error {error:.2e} > {bound:.2e}")
    return failures


def test_async_cerar_call_beside_the_programs_own_collective_20_times() -> None:
    for failures in check(run_ranks(_alternation_worker, 4, timeout=120)):
        assert failures == []


def _assert_same_mismatch(results: list, *fragments: str) -> None:
    """Every rank raised SettingsMismatchError, with one message naming all ``fragments``."""
    for r in results:
        assert isinstance(r, RankFailure) and r.type_name == "SettingsMismatchError", r
        assert all(fragment in r.message for fragment in fragments), r.message
    assert len({r.message for r in results}) == 1


def _skipped_call_worker(rank: int, world: int) -> str:
    code = codes.perturbed(world, 8)
    cerar.all_reduce(torch.ones(100), code=code)
    if rank != 1:  # rank 1 skips this call: its next one (another size) meets it
        cerar.all_reduce(torch.ones(200), code=code)
    cerar.all_reduce(torch.ones(100), code=code)
    return "no error"


def test_a_skipped_call_raises_on_every_rank() -> None:
    _assert_same_mismatch(run_ranks(_skipped_call_worker, 3, timeout=60, pg_timeout=20), "size 100", "size 200")


def _lost_call_worker(rank: int, world: int) -> str:
    """Rank 1's second call fails on its communication thread before its handshake (as when
    copying a non-contiguous input runs out of memory); the others' second call waits for it."""
    from cerar.comm.collective import call as calls

    code = codes.perturbed(world, 8)
    cerar.all_reduce(torch.ones(100), code=code)
    if rank == 1:
        original = calls.Working

        def failing(tensor: torch.Tensor) -> object:
            calls.Working = original
            raise MemoryError("simulated: no memory for the working copy")

        calls.Working = failing
        with pytest.raises(MemoryError):
            cerar.all_reduce(torch.ones(100), code=code)
    else:
        cerar.all_reduce(torch.ones(100), code=code)
    cerar.all_reduce(torch.ones(100), code=code)
    return "no error"


def test_a_call_lost_on_one_rank_raises_on_every_rank_at_the_next_meeting() -> None:
    results = run_ranks(_lost_call_worker, 3, timeout=60, pg_timeout=20)
    _assert_same_mismatch(results, "different call counts", "call #2", "call #3")


def _mismatch_then_recover_worker(rank: int, world: int) -> tuple[str, float]:
    code = codes.perturbed(world, 8)
    try:
        cerar.all_reduce(torch.ones(100 + (rank == 0)), code=code)
        first = "no error"
    except handshake.SettingsMismatchError:
        first = "SettingsMismatchError"
    # Nothing moved before the error: the next well-formed call works on every rank.
    x = torch.ones(100)
    cerar.all_reduce(x, code=code)
    return first, float(x.mean())


def test_a_mismatch_moves_no_data_and_the_next_call_works() -> None:
    for first, mean in check(run_ranks(_mismatch_then_recover_worker, 4, timeout=60, pg_timeout=20)):
        assert first == "SettingsMismatchError"
        assert mean == pytest.approx(4.0, rel=1e-3)


def _agreed_layout_worker(rank: int, world: int, kind: str) -> tuple[str, str, float, int]:
    """Two layouts agreed (sizes 100 and 200, twice each), then one mismatched call of an
    agreed layout on the others' side; then a call every rank makes the same must work."""
    code = codes.perturbed(world, 8)
    stats = CommStats()
    for size in (100, 200, 100, 200):
        cerar.all_reduce(torch.ones(size), code=code, stats=stats)
    try:
        if kind == "new size":  # rank 0 a size of its own (its first call of it), the others agreed
            cerar.all_reduce(torch.ones(101 if rank == 0 else 100), code=code)
        elif kind == "other agreed size":  # rank 2 another agreed layout: every rank takes the early path
            cerar.all_reduce(torch.ones(200 if rank == 2 else 100), code=code)
        elif kind == "skipped":  # rank 1 skips the call of size 200 that the others make first
            if rank != 1:
                cerar.all_reduce(torch.ones(200), code=code)
            cerar.all_reduce(torch.ones(100), code=code)
        elif kind == "fresh scale":  # rank 3 asks for a scale from its data, the others the agreed one
            cerar.all_reduce(torch.ones(100), code=code, fresh_scale=rank == 3)
        first, message = "no error", ""
    except handshake.SettingsMismatchError as exc:
        first, message = "SettingsMismatchError", str(exc)
    x = torch.full((100,), float(rank))
    cerar.all_reduce(x, code=code, stats=stats)
    return first, message, float(x.mean()), stats.agreed_calls


@pytest.mark.parametrize("kind", ["new size", "other agreed size", "skipped", "fresh scale"])
def test_an_agreed_layout_still_raises_on_every_rank_and_the_next_call_works(kind: str) -> None:
    # After a layout's first call, round 1 leaves beside the handshake's last hops, on the links
    # whose two ends sent the same header; a mismatch must still raise everywhere, with the same
    # message, and leave no message pending: the next call works and takes the early path again.
    results = check(run_ranks(_agreed_layout_worker, 4, kind, timeout=90, pg_timeout=20))
    assert {r[0] for r in results} == {"SettingsMismatchError"}
    assert len({r[1] for r in results}) == 1
    message = results[0][1]
    assert "agreed layout at packet scale" in message
    fragment = {
        "new size": "size 101",
        "other agreed size": "size 200",
        "skipped": "size 200",
        "fresh scale": "size 100",
    }
    assert fragment[kind] in message
    for _, _, mean, agreed_calls in results:
        assert mean == pytest.approx(6.0, rel=1e-3)
        assert agreed_calls == 3  # the repeats of 100 and 200, and the last call


def _alternating_codes_worker(rank: int, world: int) -> tuple[int, float]:
    """Two codes in turns at one size (a benchmark running methods side by side, or two models'
    buckets of a size): each keeps its agreed layout although the other's calls come between."""
    stats, worst = CommStats(), 0.0
    for k in range(6):
        x = torch.full((1000,), float(rank + k))
        cerar.all_reduce(x, code=codes.perturbed(world, 8 if k % 2 else 4), stats=stats)
        worst = max(worst, float((x - sum(r + k for r in range(world))).abs().max()))
    return stats.agreed_calls, worst


def test_codes_in_turns_keep_their_agreed_layouts() -> None:
    for agreed_calls, worst in check(run_ranks(_alternating_codes_worker, 4, timeout=60)):
        assert agreed_calls == 4, agreed_calls  # all but each code's first call
        assert worst < 1e-2


def _agreed_equals_first_worker(rank: int, world: int, packet: str) -> tuple[bool, int, int]:
    """The same input three times: the first call runs the whole handshake first, the next two
    the early path; the sums must be bitwise the same (the same scale, the same arithmetic)."""
    code = cerar.codes.optimized(world, 2 * world, "fp16") if packet == "float16" else codes.perturbed(world, 8)
    generator = torch.Generator().manual_seed(rank)
    x = torch.randn(30_000, generator=generator)
    stats = CommStats()
    sums = []
    for _ in range(3):
        y = x.clone()
        cerar.all_reduce(y, code=code, packet_dtype=getattr(torch, packet), stats=stats)
        sums.append(y)
    return all(torch.equal(sums[0], s) for s in sums[1:]), stats.agreed_calls, stats.calls


@pytest.mark.parametrize("packet", ["float32", "float16"])
@pytest.mark.parametrize("world", [2, 3, 4])
def test_an_agreed_call_gives_the_first_calls_sum_bitwise(world: int, packet: str) -> None:
    for equal, agreed_calls, calls in check(run_ranks(_agreed_equals_first_worker, world, packet, timeout=60)):
        assert equal
        assert (agreed_calls, calls) == (2, 3)


def _flag_worker(rank: int, world: int, c: int) -> tuple[str, list[int], bool]:
    """NaN on rank 2 only; the policy "exact" must fall back on every rank, together."""
    x = torch.ones(1000)
    if rank == 2:
        x[5] = float("nan")
    stats = CommStats()
    cerar.all_reduce(x, code=codes.perturbed(world, c), nonfinite="exact", stats=stats)
    nan = torch.isnan(x)
    counts = f"fallbacks={stats.fallbacks} events={stats.nonfinite_events}"
    return counts, torch.nonzero(nan).flatten().tolist(), bool(torch.all(x[~nan] == world))


@pytest.mark.parametrize("c", [8, 1])  # c = 1: N - 1 rounds, fewer than the flag hops
def test_nonfinite_decision_is_the_same_on_every_rank(c: int) -> None:
    for counts, nan, exact_elsewhere in check(run_ranks(_flag_worker, 4, c, timeout=60)):
        assert counts == "fallbacks=1 events=1"
        assert nan == [5]
        assert exact_elsewhere


def _maxima_chain_worker(rank: int, world: int, packet: str) -> list[float]:
    """The chain alone, with fewer data rounds than hops: one hop rides in front of a "data
    packet" of ``packet`` dtype, the other N - 2 run in maxima()."""
    from cerar.comm.runtime.links import Ring, post_pair
    from cerar.comm.runtime.maxima import MaximaChain

    dtype = getattr(torch, packet)
    ring = Ring.of(None)
    chain = MaximaChain(ring, torch.device("cpu"), dtype)
    chain.set_own_from(torch.tensor([float("nan") if rank in (1, 3) else float(rank + 1), -0.5]))
    send, recv = torch.full((chain.front + 3,), 7.0, dtype=dtype), torch.zeros(chain.front + 3, dtype=dtype)
    assert chain.carries(2, rounds=2) and not chain.carries(1, rounds=2) and not chain.carries(3, rounds=2)
    chain.write(send[: chain.front])
    recv_work, send_work = post_pair(send, recv, ring, 2)
    recv_work.wait()
    send_work.wait()
    chain.absorb(recv[: chain.front])
    assert recv[chain.front :].tolist() == [7.0] * 3  # the values behind the front are untouched
    return chain.maxima(3)


@pytest.mark.parametrize("packet", ["float64", "float32", "float16", "bfloat16"])
def test_maxima_chain_gives_every_rank_every_maximum(packet: str) -> None:
    for maxima in check(run_ranks(_maxima_chain_worker, 5, packet, timeout=60)):
        assert maxima == [1.0, float("inf"), 3.0, float("inf"), 5.0]


def _handshake_maximum_worker(rank: int, world: int) -> tuple[float, int, int]:
    """Each rank proposes its own max|x| and scale exponent; every rank must agree on the largest."""
    ring = Ring.of(None)
    agreed = handshake.handshake(ring, 7.0, 1, "settings", handshake.Proposal(float(10 + rank), -rank))
    return agreed.max_abs, agreed.scale_exponent, len(handshake.dissemination_distances(world))


@pytest.mark.parametrize("world", [2, 3, 5, 6])
def test_the_handshake_hops_give_every_rank_the_maximum(world: int) -> None:
    # Dissemination hops (1, 2, 4, ...): every rank hears from every rank, also when N is not a
    # power of two, in ceil(log2 N) hops instead of the ring's N - 1.
    hops = (world - 1).bit_length()
    assert check(run_ranks(_handshake_maximum_worker, world, timeout=60)) == [(float(9 + world), 0, hops)] * world


def test_dissemination_distances_cover_every_rank() -> None:
    for size in range(1, 40):
        distances = handshake.dissemination_distances(size)
        assert len(distances) == (size - 1).bit_length()
        heard = [{r} for r in range(size)]  # whom each rank has heard from, directly or not
        for distance in distances:
            heard = [heard[r] | heard[(r - distance) % size] for r in range(size)]
        assert all(h == set(range(size)) for h in heard), size


def _no_collective_worker(rank: int, world: int) -> int:
    """Count the collectives cerar issues on the caller's group: there must be none."""
    calls = []
    original = dist.all_reduce

    def counting(*args, **kwargs):
        if threading.current_thread().name == "cerar-comm":
            calls.append(1)
        return original(*args, **kwargs)

    dist.all_reduce = counting
    try:
        for _ in range(3):
            cerar.all_reduce(torch.randn(10_000), code=codes.perturbed(world, 8))
            cerar.ring_all_reduce(torch.randn(10_000), wire_dtype=torch.float16)
    finally:
        dist.all_reduce = original
    return len(calls)


def test_no_collective_runs_on_the_communication_thread() -> None:
    assert check(run_ranks(_no_collective_worker, 3, timeout=60)) == [0, 0, 0]


def _dies_before_the_call_worker(rank: int, world: int) -> str:
    import os

    cerar.all_reduce(torch.ones(1000), code=codes.perturbed(world, 8))
    if rank == 2:
        os._exit(3)  # gone before its second call: the others wait in that call's handshake
    cerar.all_reduce(torch.ones(1000), code=codes.perturbed(world, 8))
    return "no error"


def test_a_peer_lost_before_the_rounds_makes_every_survivor_raise_ring_error() -> None:
    results = run_ranks(_dies_before_the_call_worker, 4, timeout=90, pg_timeout=4.0, allow_missing=True)
    assert results[2] is None
    for rank in (0, 1, 3):
        failure = results[rank]
        assert isinstance(failure, RankFailure) and failure.type_name == "RingError", failure
