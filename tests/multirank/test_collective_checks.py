"""Up-front checks of cerar.all_reduce / ring_all_reduce: tensors, op, requires_grad, threads.

Every refusal here happens on the caller's thread before anything is queued: the tensor and
op checks are run without any process group (they come first), and on two ranks a good call
still pairs up after a run of refused ones.
"""

from __future__ import annotations

import functools
import itertools
import random
import re
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import cerar
from cerar.coding import codes
from cerar.comm.collective.checks import check_op as _check_op
from cerar.comm.collective.checks import overlaps_itself as _overlaps_itself
from cerar.comm.ddp.hooks import CerarState, cerar_hook
from multirank import check, run_ranks

pytestmark = pytest.mark.multirank

CALLS: dict[str, Callable[..., Any]] = {"all_reduce": cerar.all_reduce, "ring_all_reduce": cerar.ring_all_reduce}

BAD_TENSORS: dict[str, tuple[Callable[[], torch.Tensor], type[Exception], str]] = {
    "meta": (
        lambda: torch.ones(4, device="meta"),
        ValueError,
        r"^Argument 'tensor' must hold data, not be on the meta",
    ),
    "sparse_coo": (
        lambda: torch.ones(4).to_sparse(),
        TypeError,
        r"^Argument 'tensor' must be a dense \(torch.strided\) tensor, not torch.sparse_coo\.$",
    ),
    "sparse_csr": (
        lambda: torch.ones(2, 2).to_sparse_csr(),
        TypeError,
        r"^Argument 'tensor' must be a dense \(torch.strided\) tensor, not torch.sparse_csr\.$",
    ),
    "expand": (
        lambda: torch.ones(1).expand(8),
        ValueError,
        r"^Argument 'tensor' must not overlap itself .* not a view with shape \(8,\) and strides \(0,\)",
    ),
    "expand_2d": (
        lambda: torch.ones(3, 1).expand(3, 5),
        ValueError,
        r"^Argument 'tensor' must not overlap itself .* shape \(3, 5\) and strides \(1, 0\); pass tensor.clone\(\)\.$",
    ),
    "as_strided": (
        lambda: torch.ones(6).as_strided((3, 2), (1, 1)),
        ValueError,
        r"^Argument 'tensor' must not overlap itself .* shape \(3, 2\) and strides \(1, 1\)",
    ),
}


def _no_group() -> None:
    if dist.is_initialized():
        pytest.skip("a process group exists in this process")


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.parametrize("call", sorted(CALLS))
@pytest.mark.parametrize("kind", sorted(BAD_TENSORS))
def test_bad_tensors_are_refused_before_anything_else(call: str, kind: str) -> None:
    # No process group: the check must fire before the call even looks for one.
    _no_group()
    make, error, message = BAD_TENSORS[kind]
    with pytest.raises(error, match=message):
        CALLS[call](make())


@pytest.mark.parametrize("call", sorted(CALLS))
@pytest.mark.parametrize("op", [False, True, 0, 1, 0.0, "SUM", "mean", None, dist.ReduceOp.MAX, dist.ReduceOp.PRODUCT])
def test_op_accepts_only_sum_and_avg_by_type(call: str, op: Any) -> None:
    _no_group()
    message = re.escape(f"Argument 'op' must be 'sum' or 'avg' (or ReduceOp.SUM/AVG), not {op!r}.")
    with pytest.raises(ValueError, match=f"^{message}$"):
        CALLS[call](torch.ones(3), op=op)


def test_fresh_scale_is_checked_and_left_to_auto() -> None:
    _no_group()
    with pytest.raises(TypeError, match=r"^Argument 'fresh_scale' must be a bool, not 'yes'"):
        cerar.all_reduce(torch.ones(3), fresh_scale="yes")
    with pytest.raises(ValueError, match=r"Argument 'fresh_scale' applies to CERAR's rows, not to method 'auto'"):
        cerar.all_reduce(torch.ones(3), method="auto", fresh_scale=True)


def test_an_unknown_method_is_named() -> None:
    _no_group()
    message = r"^Argument 'method' must be one of \[.*'auto'.*'ring-fp16'.*\], not 'nccl'\.$"
    with pytest.raises(ValueError, match=message):
        cerar.all_reduce(torch.ones(3), method="nccl")


def test_op_spellings_that_are_accepted() -> None:
    assert dist.ReduceOp.SUM == 0  # why the check compares by type first
    accepted = {
        "sum": "sum",
        "avg": "avg",
        dist.ReduceOp.SUM: "sum",
        dist.ReduceOp.AVG: "avg",
        dist.ReduceOp(dist.ReduceOp.SUM): "sum",
        dist.ReduceOp(dist.ReduceOp.AVG): "avg",
    }
    for op, name in accepted.items():
        assert _check_op(op) == name, op


def _brute_force_overlap(tensor: torch.Tensor) -> bool:
    ranges = [range(size) for size in tensor.shape]
    offsets = [sum(i * s for i, s in zip(index, tensor.stride(), strict=True)) for index in itertools.product(*ranges)]
    return len(set(offsets)) < len(offsets)


def test_overlap_detection_matches_brute_force() -> None:
    rng = random.Random(7)
    cases = [
        torch.ones(5),
        torch.ones(0),
        torch.ones(1).expand(1),
        torch.ones(3, 4).t(),
        torch.ones(3, 4)[:, ::2],
        torch.ones(4, 5, 6).permute(2, 0, 1)[1:, ::3, ::2],
        torch.ones(8).as_strided((2, 3), (3, 2)),  # offsets 0 2 4 3 5 7: fails the fast test, no overlap
        torch.ones(8).as_strided((2, 2), (1, 2)),
        torch.ones(8).as_strided((3, 2), (2, 3)),  # 0 3 2 5 4 7: no overlap
        torch.ones(8).as_strided((3, 3), (1, 2)),  # 2 = 0 + 2*1: overlap
    ]
    for _ in range(300):
        dims = rng.randint(1, 3)
        shape = tuple(rng.randint(1, 4) for _ in range(dims))
        stride = tuple(rng.randint(0, 6) for _ in range(dims))
        cases.append(torch.ones(200).as_strided(shape, stride))
    found = {False: 0, True: 0}
    for tensor in cases:
        truth = _brute_force_overlap(tensor)
        assert _overlaps_itself(tensor) is truth, (tuple(tensor.shape), tensor.stride())
        found[truth] += 1
    assert min(found.values()) > 50  # both outcomes well covered


def test_overlap_check_of_a_huge_broadcast_needs_no_pass_over_it() -> None:
    # 10**12 elements: a check that visited them would never finish (the suite's hang guard).
    assert _overlaps_itself(torch.ones(1).expand(10**12))
    assert not _overlaps_itself(torch.ones(10**6)[::3])


# ---------------------------------------------------------------------------------------------
# On two ranks


def _requires_grad_worker(rank: int, world: int) -> dict[str, Any]:
    code = codes.exact(world)
    out: dict[str, Any] = {}
    for name, call in CALLS.items():
        kwargs = {"code": code} if name == "all_reduce" else {}
        leaf = torch.full((5,), float(rank + 1), requires_grad=True)
        call(leaf, **kwargs)
        nonleaf = torch.full((5,), float(rank + 1), requires_grad=True) * 2
        call(nonleaf, "avg", **kwargs)
        with torch.no_grad():
            quiet = torch.full((5,), float(rank + 1), requires_grad=True)
            work = call(quiet, async_op=True, **kwargs)
        work.wait()
        out[name] = {
            "leaf": (leaf.tolist(), leaf.requires_grad, leaf.is_leaf, leaf.grad),
            "nonleaf": nonleaf.tolist(),
            "no_grad": quiet.tolist(),
        }
    # What dist.all_reduce does with the same tensors, for comparison.
    reference = torch.full((5,), float(rank + 1), requires_grad=True)
    dist.all_reduce(reference)
    out["dist"] = (reference.tolist(), reference.requires_grad, reference.is_leaf)
    return out


def test_requires_grad_tensors_are_reduced_in_place_as_dist_does() -> None:
    for out in check(run_ranks(_requires_grad_worker, 2, timeout=90)):
        assert out["dist"] == ([3.0] * 5, True, True)
        for name in CALLS:
            values, requires_grad, is_leaf, grad = out[name]["leaf"]
            assert values == pytest.approx([3.0] * 5, abs=1e-6) and requires_grad and is_leaf and grad is None
            assert out[name]["nonleaf"] == pytest.approx([3.0] * 5, abs=1e-6)  # avg of 2 and 4
            assert out[name]["no_grad"] == pytest.approx([3.0] * 5, abs=1e-6)


def _refused_then_good_worker(rank: int, world: int) -> list[float]:
    refused = 0
    for make, error, _ in BAD_TENSORS.values():
        for call in CALLS.values():
            with pytest.raises(error):
                call(make(), async_op=True)
            refused += 1
    for op in (False, 0, dist.ReduceOp.MAX):
        with pytest.raises(ValueError):
            cerar.all_reduce(torch.ones(3), op=op)  # type: ignore[arg-type]
    # Rank 1 refuses twice more: if a refused call had been queued, the ranks' calls would no
    # longer pair up and this one would fail with a mismatch or time out.
    if rank == 1:
        for _ in range(2):
            with pytest.raises(ValueError):
                cerar.all_reduce(torch.ones(2).expand(2, 2))
    x = torch.full((7,), float(rank + 1))
    cerar.all_reduce(x, code=codes.exact(world))
    return x.tolist()


def test_refused_calls_queue_nothing() -> None:
    for values in check(run_ranks(_refused_then_good_worker, 2, timeout=90)):
        assert values == pytest.approx([3.0] * 7, abs=1e-6)


def _in_thread(fn: Callable[[], Any], name: str) -> Any:
    """Run ``fn`` on a new thread named ``name``; return its result or its exception."""
    box: list[Any] = []

    def run() -> None:
        try:
            box.append(fn())
        except BaseException as exc:
            box.append(exc)

    thread = threading.Thread(target=run, name=name)
    thread.start()
    thread.join(60)
    return box[0]


def _threads_worker(rank: int, world: int) -> dict[str, Any]:
    code = codes.exact(world)
    out: dict[str, Any] = {}
    first = torch.full((10,), float(rank + 1))
    if rank == 1:
        time.sleep(2.0)  # keeps rank 0's first call in flight for two seconds
    work = cerar.all_reduce(first, async_op=True, code=code)
    # Another thread calls while the main thread's call is still in flight: it waits for it.
    extra = torch.full((10,), float(rank + 1))

    def second_thread() -> bool:
        cerar.ring_all_reduce(extra)
        return work.is_completed()  # the first thread's call had completed before this one ran

    out["waited"] = _in_thread(second_thread, "second")
    work.wait()
    # Once the main thread's calls have completed, another thread may take over (on both ranks).
    second = torch.full((10,), float(rank + 1))
    out["handover"] = _in_thread(lambda: cerar.all_reduce(second, code=code), "handover")
    # ... and hand back: a sync call from the main thread right after.
    third = torch.full((10,), float(rank + 1))
    cerar.ring_all_reduce(third)
    # A blocking call from a callback (the communication thread) would wait on itself. Each rank
    # in turn chains it to a call its peer joins only after a Gloo barrier, so the future is still
    # in flight when the callback is attached: a future already complete would run the callback
    # inline, on this thread, where the call is allowed and would wait for a peer that never comes.
    for caller in range(world):
        if rank == caller:
            fut = cerar.all_reduce(torch.ones(10), async_op=True, code=code).get_future()
            chained = fut.then(lambda _: cerar.all_reduce(torch.ones(3), code=code))
            dist.barrier()
            try:
                chained.wait()
                out["callback"] = "no error"
            except RuntimeError as exc:
                out["callback"] = str(exc)
        else:
            dist.barrier()
            cerar.all_reduce(torch.ones(10), code=code)
    out["values"] = [float(first[0]), float(extra[0]), float(second[0]), float(third[0])]
    return out


def test_a_second_threads_call_waits_for_the_first_threads_calls_in_flight() -> None:
    results = check(run_ranks(_threads_worker, 2, timeout=90))
    for out in results:
        assert out["waited"] is True  # it ran after the first thread's call, on both ranks
        assert out["handover"] is None
        assert out["values"] == [3.0, 3.0, 3.0, 3.0]
        assert "cannot be made from the communication thread" in out["callback"]


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def _ddp_threads_worker(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(_Net(), bucket_cap_mb=0.0001)  # several buckets
    state = CerarState(code=codes.perturbed(world, 2 * world), min_bucket_bytes=0)
    hook_threads: list[list[str]] = []  # per step

    @functools.wraps(cerar_hook)  # DDP checks the annotations, which are strings in this file
    def recording_hook(s: CerarState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        hook_threads[-1].append(threading.current_thread().name)
        return cerar_hook(s, bucket)

    model.register_comm_hook(state, recording_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(rank)
    backward_threads = []

    def step() -> float:
        backward_threads.append(threading.current_thread().name)
        hook_threads.append([])
        opt.zero_grad()
        loss = model(torch.randn(4, 8, generator=g)).pow(2).mean()
        loss.backward()
        opt.step()
        return float(loss)

    losses = []
    for i in range(4):
        # Alternate the thread that trains: each hands over once its calls have completed.
        losses.append(step() if i % 2 == 0 else _in_thread(step, f"trainer-{i}"))
        metric = torch.tensor([losses[-1]])
        cerar.ring_all_reduce(metric, "avg")  # a call of the main thread between the steps
    return {"hooks": hook_threads, "backward": backward_threads, "losses": losses}


def test_ddp_hooks_run_on_the_backward_thread_and_may_change_threads() -> None:
    for out in check(run_ranks(_ddp_threads_worker, 2, timeout=120)):
        assert out["backward"] == ["MainThread", "trainer-1", "MainThread", "trainer-3"]
        assert all(len(names) >= 2 for names in out["hooks"][1:])  # several buckets after the rebuild
        for names, thread in zip(out["hooks"], out["backward"], strict=True):
            assert names and set(names) == {thread}  # on CPU DDP calls its hook on backward()'s thread
        assert all(isinstance(v, float) for v in out["losses"])
