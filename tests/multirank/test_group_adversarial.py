"""Each case of issue 53 as a test: cerar's process group used as an adversarial user would.

Errors that keep their type through the group; settings that differ between ranks named in
seconds; ``max_error`` binding the default codes; ``wait(timeout=)`` with a stopped peer;
overlapping groups used in different orders; two threads on one group; a strided view; the
timeouts of the groups cerar makes; compiled DDP on the group; state dicts. The cases that fail
today are strict xfails saying what they do instead, so that fixing them flips the mark. Every
rank function keeps to seconds: the groups are made with a short ``timeout`` so that a case that
waits for it today ends soon.
"""

from __future__ import annotations

import datetime
import os
import threading
import time
from typing import Any

import pytest
import torch
import torch._dynamo  # imported once here, not in every forked rank
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from multirank import RankFailure, check, run_ranks, wait_for_peers

pytestmark = pytest.mark.multirank
SHORT = datetime.timedelta(seconds=5)  # the groups' timeout here: what a case that hangs today waits for
QUICK = 3.0  # seconds within which a disagreement must be named


def _kind(exc: BaseException) -> dict[str, Any]:
    return {"type": type(exc).__name__, "message": str(exc)[:600]}


def _timed(fn: Any) -> dict[str, Any]:
    started = time.monotonic()
    try:
        fn()
        out: dict[str, Any] = {"type": None, "message": ""}
    except Exception as exc:  # what the caller sees, with its type
        out = _kind(exc)
    out["seconds"] = time.monotonic() - started
    return out


# -- 1. errors keep their type through the group ---------------------------------------------


def _error_types(rank: int, world: int) -> dict[str, Any]:
    import cerar

    group = cerar.new_group(min_bytes=0, nonfinite="raise", timeout=SHORT)
    out = {}
    for how in ("dist.all_reduce", "work.wait()", "get_future().wait()"):
        x = torch.ones(4096)
        if rank == 1:
            x[7] = float("nan")
        try:
            if how == "dist.all_reduce":
                dist.all_reduce(x, group=group)
            else:
                work = dist.all_reduce(x, group=group, async_op=True)
                work.wait() if how == "work.wait()" else work.get_future().wait()
            out[how] = {"caught": False, "type": None, "message": ""}
        except cerar.NonFiniteError as exc:
            out[how] = {"caught": True, **_kind(exc)}
        except Exception as exc:  # the type it arrived with
            out[how] = {"caught": False, **_kind(exc)}
    return out


@pytest.fixture(scope="module")
def error_types() -> list[dict[str, Any]]:
    return check(run_ranks(_error_types, 3, timeout=60, pg_timeout=20))


_WRAPPED = "issue 53: a NonFiniteError arrives as RuntimeError: Got the following error when running the callback: ..."


@pytest.mark.parametrize(
    "how",
    [
        "dist.all_reduce",
        "work.wait()",
        pytest.param(
            "get_future().wait()",
            marks=pytest.mark.xfail(
                strict=True,
                reason=_WRAPPED + " (the future DDP reads must fail with torch's own error: one completed by "
                "Future.set_exception crashes DDP, see test_ddp_crashes_on_a_future_completed_by_set_exception)",
            ),
        ),
    ],
)
def test_a_coded_calls_error_keeps_its_type_through_the_group(error_types: list[dict[str, Any]], how: str) -> None:
    for out in error_types:
        seen = out[how]
        assert "NonFiniteError" in seen["type"] + seen["message"], (how, seen)  # the error is there today
        assert seen["caught"] and seen["type"] == "NonFiniteError", (how, seen)


def _ddp_error(rank: int, world: int) -> str:
    import cerar

    group = cerar.new_group(min_bytes=0, nonfinite="raise", timeout=SHORT)
    torch.manual_seed(0)
    model = DDP(nn.Linear(64, 64), process_group=group)
    x = torch.randn(8, 64)
    if rank == 1:
        x[0, 0] = float("nan")
    model(x).sum().backward()
    return "no error"


def test_ddp_backward_gets_a_coded_error_as_torchs_runtime_error_naming_it() -> None:
    """DDP without a hook: the C++ reducer waits on the work's future and rethrows its error as
    torch's RuntimeError, whatever the Python type was; the message names it. DDP gives no way to
    keep the type (issue 53, item 1, for DDP)."""
    for failure in run_ranks(_ddp_error, 3, timeout=60, pg_timeout=20):
        assert isinstance(failure, RankFailure) and failure.type_name == "RuntimeError", failure
        assert failure.message.startswith("Got the following error when running the callback: ")
        assert "NonFiniteError: cerar.all_reduce: NaN or Inf in the input of rank(s) [1]" in failure.message


def _set_exception_under_ddp(rank: int, world: int) -> str:
    import faulthandler

    import cerar

    faulthandler.disable()  # the crash is expected: no dump of every thread into the test's log
    from cerar.comm.group import process_group

    group = cerar.new_group(min_bytes=0, timeout=SHORT)

    class RawWork(dist.Work):  # hands DDP the future itself (cerar's Work hands it one made by then())
        def __init__(self, future: torch.futures.Future[Any]) -> None:
            super().__init__()
            self.future = future

        def get_future(self) -> torch.futures.Future[Any]:
            return self.future

    def allreduce(self: Any, tensors: Any, opts: Any = None) -> Any:
        future: torch.futures.Future[Any] = torch.futures.Future()
        future.set_exception(ValueError("an error set on the work's future"))
        return RawWork(future)

    process_group.CerarProcessGroup.allreduce = allreduce  # this rank's copy of the class only
    model = DDP(nn.Linear(4, 4), process_group=group)
    model(torch.ones(2, 4)).sum().backward()
    return "no crash"


def test_ddp_crashes_on_a_future_completed_by_set_exception() -> None:
    """torch's behaviour the group must avoid: ``Future.set_exception`` completes the future with
    the exception object as its value (only Python's ``wait()`` raises it), DDP's reducer reads
    that value as tensors, and the rank dies of a segmentation fault in ``backward()`` (so does a
    future completed with None). An error raised inside a ``then`` callback is stored as torch's
    own error and reaches ``backward()`` as RuntimeError (the test above). If torch starts
    checking the value, this test fails: then the group's futures may carry the error's type."""
    results = run_ranks(_set_exception_under_ddp, 2, timeout=30, pg_timeout=10, allow_missing=True)
    assert results == [None, None], results  # both ranks died without reporting


def _mismatch_type(rank: int, world: int) -> dict[str, Any]:
    """Ranks calling with different sizes: the coded call's handshake names the mismatch."""
    import cerar

    group = cerar.new_group(min_bytes=0, timeout=SHORT)
    started = time.monotonic()
    try:
        dist.all_reduce(torch.ones(4096 if rank == 0 else 4000), group=group)
        return {"caught": False, "type": None, "seconds": time.monotonic() - started}
    except cerar.SettingsMismatchError as exc:
        return {"caught": True, **_kind(exc), "seconds": time.monotonic() - started}
    except Exception as exc:
        return {"caught": False, **_kind(exc), "seconds": time.monotonic() - started}


def test_a_settings_mismatch_keeps_its_type_through_the_group() -> None:
    for out in check(run_ranks(_mismatch_type, 3, timeout=60, pg_timeout=20)):
        assert "SettingsMismatchError" in str(out.get("type")) + out.get("message", ""), out  # named today
        assert out["seconds"] < QUICK, out
        assert out["caught"], out


# -- 2. settings that differ between ranks: named in seconds ----------------------------------


def _differing(rank: int, world: int, what: str) -> dict[str, Any]:
    """The group made, then one all-reduce: the mismatch may be named at either (timed together)."""
    import cerar

    x = torch.randn(4096, generator=torch.Generator().manual_seed(rank))

    def call() -> None:
        if what == "min_bytes":
            group = cerar.new_group(min_bytes=0 if rank == 0 else 1 << 20, timeout=SHORT)
        elif what == "max_error":
            group = cerar.new_group(min_bytes=0, max_error=1e-2 if rank == 0 else 0.1, timeout=SHORT)
        elif what == "nonfinite":
            group = cerar.new_group(min_bytes=0, nonfinite="raise" if rank == 0 else "exact", timeout=SHORT)
        else:
            group = cerar.new_group(min_bytes=0, timeout=SHORT)
        if what == "exact()" and rank == 0:
            with cerar.exact(group):
                dist.all_reduce(x, group=group)
        else:
            dist.all_reduce(x, group=group)

    return _timed(call)


@pytest.mark.parametrize(
    "what",
    [
        "min_bytes",
        "max_error",
        "nonfinite",
        "exact()",
    ],
)
def test_ranks_with_different_settings_raise_a_mismatch_naming_the_setting_in_seconds(what: str) -> None:
    """Settings given to the group are agreed when it is made (cerar.new_group raises on every
    rank, naming the setting and each rank's value); cerar.exact() is per call."""
    results = run_ranks(_differing, 3, what, timeout=60, pg_timeout=20)
    for out in check(results):
        assert out["type"] == "SettingsMismatchError" and what.rstrip("()") in out["message"], out
        assert out["seconds"] < QUICK, out
    if what != "exact()":
        assert "rank 0: " in results[0]["message"] and "rank 2: " in results[0]["message"], results[0]


# -- 3. max_error binds the default codes -----------------------------------------------------


def _max_error(rank: int, world: int) -> dict[str, Any]:
    import cerar

    x = torch.randn(1 << 14, generator=torch.Generator().manual_seed(rank))
    exact = x.clone()
    dist.all_reduce(exact)
    out = {}
    for how in ("group", "cerar.all_reduce"):
        y = x.clone()
        try:
            if how == "group":
                group = cerar.new_group(min_bytes=0, packet_dtype=torch.bfloat16, max_error=1e-3, timeout=SHORT)
                dist.all_reduce(y, group=group)
            else:
                cerar.all_reduce(y, packet_dtype=torch.bfloat16, max_error=1e-3)
            out[how] = {"error": float((y - exact).norm() / exact.norm())}
        except Exception as exc:
            out[how] = _kind(exc)
    return out


@pytest.fixture(scope="module")
def max_error_results() -> list[dict[str, Any]]:
    return check(run_ranks(_max_error, 4, timeout=60, pg_timeout=20))


@pytest.mark.parametrize(
    "how",
    [
        "group",
        "cerar.all_reduce",
    ],
)
def test_max_error_binds_the_default_code(max_error_results: list[dict[str, Any]], how: str) -> None:
    """An error within max_error, or a refusal naming the code, the precision, the predicted error
    and the limit (the group refuses when it is made: no bfloat16 code meets 1e-3 on 4 ranks)."""
    for out in max_error_results:
        seen = out[how]
        if "error" in seen:
            assert seen["error"] <= 1e-3, (how, seen)
        else:
            assert seen["type"] == "ValueError", (how, seen)
            assert "N=4" in seen["message"] and "bf16" in seen["message"] and "limit 0.001" in seen["message"], seen


# -- 4. wait(timeout=) with a stopped peer ----------------------------------------------------


def _stopped_peer(rank: int, world: int) -> dict[str, Any] | None:
    import cerar

    group = cerar.new_group(min_bytes=1024, timeout=datetime.timedelta(seconds=10))
    ref = dist.new_group(timeout=datetime.timedelta(seconds=10))
    if rank == world - 1:  # stopped: it never calls
        wait_for_peers(at_most=11)
        return None
    calls = {"gloo": (ref, 16), "exact": (group, 16), "coded": (group, 4096)}
    works = {name: dist.all_reduce(torch.ones(numel), group=pg, async_op=True) for name, (pg, numel) in calls.items()}
    return {name: _timed(lambda work=work: work.wait(datetime.timedelta(seconds=3))) for name, work in works.items()}


def test_wait_with_a_timeout_and_a_stopped_peer_raises_within_it() -> None:
    results = run_ranks(_stopped_peer, 3, timeout=60, pg_timeout=30)
    for out in check(results[:-1]):
        assert out["gloo"]["type"] is not None and out["gloo"]["seconds"] < 4.5, out  # Gloo's: at 3 s
        for route in ("exact", "coded"):
            assert out[route]["type"] is not None and out[route]["seconds"] < 4.5, (route, out)


# -- 5. overlapping groups, two threads -------------------------------------------------------


def _overlapping(rank: int, world: int, backend: str) -> dict[str, Any] | None:
    import cerar

    make = (lambda ranks: cerar.new_group(ranks, min_bytes=0, timeout=SHORT)) if backend == "cerar" else None
    if make is None:
        a, b = dist.new_group([0, 1, 2], timeout=SHORT), dist.new_group([1, 2, 3], timeout=SHORT)
    else:
        a, b = make([0, 1, 2]), make([1, 2, 3])
    order = {0: [a], 1: [b, a], 2: [a, b], 3: [b]}[rank]
    tensors = [torch.full((4096,), float(rank + 1)) for _ in order]
    started = time.monotonic()
    try:
        works = [dist.all_reduce(t, group=g, async_op=True) for t, g in zip(tensors, order, strict=True)]
        for work in works:
            work.wait()
        out: dict[str, Any] = {"type": None, "sums": [float(t.mean()) for t in tensors]}
    except Exception as exc:
        out = _kind(exc)
    out["seconds"] = time.monotonic() - started
    return out


@pytest.mark.parametrize(
    "backend",
    [
        "gloo",
        "cerar",
    ],
)
def test_overlapping_groups_in_different_orders_complete_or_raise_a_named_error_quickly(backend: str) -> None:
    expected = {0: [6.0], 1: [9.0, 6.0], 2: [6.0, 9.0], 3: [9.0]}  # A = [0,1,2]: 1+2+3, B = [1,2,3]: 2+3+4
    for rank, out in enumerate(check(run_ranks(_overlapping, 4, backend, timeout=60, pg_timeout=20))):
        assert out["seconds"] < QUICK, out
        if out["type"] is None:
            assert out["sums"] == pytest.approx(expected[rank], rel=1e-3), out
        else:
            assert out["type"] != "RingError" and "group" in out["message"], out


def _two_threads(rank: int, world: int) -> dict[str, Any]:
    import cerar

    group = cerar.new_group(min_bytes=0, timeout=SHORT)
    outcomes: list[str] = []
    lock = threading.Lock()

    def calls(numel: int, base: float) -> None:
        for i in range(10):
            x = torch.full((numel,), base + i + rank)
            expected = world * (base + i) + sum(range(world))
            try:
                dist.all_reduce(x, group=group)
                ok = float((x - expected).abs().max()) <= 1e-3 * abs(expected)
                seen = "right" if ok else f"wrong: {float(x.mean()):.4g} for {expected}"
            except Exception as exc:
                seen = f"error {type(exc).__name__}"
            with lock:
                outcomes.append(seen)

    threads = [threading.Thread(target=calls, args=args) for args in ((3000, 1.0), (5000, 100.0))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(40)
    return {"outcomes": outcomes, "alive": any(t.is_alive() for t in threads)}


def test_two_threads_on_one_group_never_give_a_wrong_sum() -> None:
    """Either every call right, or errors: never a sum that is off (issue 53 saw 0.8-1.15 relative).
    Today's outcome varies from run to run; 10 calls per thread made a wrong sum in every run tried."""
    results = run_ranks(_two_threads, 3, timeout=90, pg_timeout=20)
    for out in results:
        if isinstance(out, RankFailure):
            continue
        wrong = [o for o in out["outcomes"] if o.startswith("wrong")]
        assert not wrong, out["outcomes"]


# -- 6. a strided view ------------------------------------------------------------------------


def _strided(rank: int, world: int) -> dict[str, Any]:
    import cerar

    out = {}
    for route, min_bytes in (("exact", 1 << 30), ("coded", 0)):
        group = cerar.new_group(min_bytes=min_bytes, timeout=SHORT)
        base = torch.randn(8192, generator=torch.Generator().manual_seed(rank))
        untouched = base[1::2].clone()
        expected = base[::2].clone()
        dist.all_reduce(expected)
        view = base[::2]
        dist.all_reduce(view, group=group)
        out[route] = {
            "error": float((view - expected).norm() / expected.norm()),
            "outside_kept": bool(torch.equal(base[1::2], untouched)),
        }
    ref = dist.new_group(timeout=SHORT)
    base = torch.randn(8192, generator=torch.Generator().manual_seed(rank))
    untouched = base[1::2].clone()
    dist.all_reduce(base[::2], group=ref)
    out["gloo_outside_kept"] = bool(torch.equal(base[1::2], untouched))
    return out


@pytest.mark.parametrize(
    "route",
    [
        "exact",
        "coded",
    ],
)
def test_a_strided_view_gets_the_right_sum_and_its_storage_outside_is_untouched(route: str) -> None:
    for out in check(run_ranks(_strided, 3, timeout=60, pg_timeout=20)):
        assert out[route]["outside_kept"], out
        assert out[route]["error"] < 1e-3, out


# -- 7. the timeouts of the groups cerar makes --------------------------------------------------


def _timeouts(rank: int, world: int) -> dict[str, Any]:
    import cerar
    from cerar.comm.group.hsdp import hsdp_groups
    from cerar.comm.runtime.links import group_timeout

    given = cerar.new_group(min_bytes=0, timeout=datetime.timedelta(seconds=7))
    default = cerar.new_group(min_bytes=0)
    backend = dist.new_group(backend="cerar", timeout=datetime.timedelta(seconds=9))
    hsdp = hsdp_groups(2)
    hsdp_given = hsdp_groups(2, timeout=datetime.timedelta(seconds=11))
    seconds = {
        "given": [group_timeout(given.exact), group_timeout(given.transport)],
        "default": [group_timeout(default.exact), group_timeout(default.transport)],
        "backend": [group_timeout(backend.exact), group_timeout(backend.transport)],
        "hsdp": [
            group_timeout(hsdp.shard),
            group_timeout(hsdp.replicate.exact),
            group_timeout(hsdp.replicate.transport),
        ],
        "hsdp_given": [group_timeout(g) for g in (hsdp_given.shard, hsdp_given.replicate.transport)],
        "world": [group_timeout(None)],
    }
    x = torch.ones(4096)
    dist.all_reduce(x, group=given)  # the groups work
    try:
        cerar.new_group(timeout=5)
        refused = ""
    except TypeError as exc:
        refused = str(exc)
    return {
        "seconds": {k: [t.total_seconds() for t in v] for k, v in seconds.items()},
        "sum": float(x.mean()),
        "refused": refused,
    }


def test_every_group_cerar_makes_takes_the_timeout_it_was_made_with() -> None:
    for out in check(run_ranks(_timeouts, 4, timeout=90, pg_timeout=13)):
        s = out["seconds"]
        assert s["world"] == [13.0]
        assert s["given"] == [7.0, 7.0] and s["default"] == [13.0, 13.0] and s["backend"] == [9.0, 9.0]
        assert s["hsdp"] == [13.0, 13.0, 13.0] and s["hsdp_given"] == [11.0, 11.0]  # not dist.new_group's 30 min
        assert out["sum"] == pytest.approx(4.0, rel=1e-3)
        assert "Argument 'timeout'" in out["refused"] and "5" in out["refused"]


# -- 8. torch.compile of DDP on the group --------------------------------------------------------


def _compiled_ddp(rank: int, world: int) -> dict[str, Any]:
    """Three steps of a compiled DDP with a BatchNorm (DDP broadcasts its buffers every forward)
    on cerar's group and on Gloo's: the gradients, or the error."""
    import cerar

    groups = {"cerar": cerar.new_group(min_bytes=0, timeout=SHORT), "gloo": dist.new_group(timeout=SHORT)}
    out: dict[str, Any] = {}
    for name, group in groups.items():
        torch.manual_seed(0)
        layers = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 2))
        model = torch.compile(DDP(layers, process_group=group), backend="aot_eager")
        try:
            for step in range(3):
                model(torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank))).sum().backward()
            out[name] = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        except Exception as exc:
            out[name] = _kind(exc)
    if isinstance(out["cerar"], dict):
        return out["cerar"]
    return {"type": None, "error": float((out["cerar"] - out["gloo"]).norm() / out["gloo"].norm())}


def test_compiled_ddp_on_the_group() -> None:
    for out in check(run_ranks(_compiled_ddp, 2, timeout=90, pg_timeout=20)):
        assert out["type"] is None and out["error"] < 1e-3, out


# -- 9. the functional collectives by the group's name --------------------------------------------


def _by_name(rank: int, world: int) -> dict[str, Any]:
    import cerar

    group = cerar.new_group(min_bytes=1024, timeout=SHORT)
    ops = torch.ops._c10d_functional
    x = torch.randn(4096, generator=torch.Generator().manual_seed(rank))
    expected = x.clone()
    dist.all_reduce(expected)
    out = ops.wait_tensor(ops.all_reduce(x, "sum", group.group_name))  # a coded size: the group's allreduce
    gathered = torch.empty(64 * world)
    ops.wait_tensor(ops.all_gather_into_tensor_out(x[:64], world, group.group_name, out=gathered))
    reference = [torch.empty(64) for _ in range(world)]
    dist.all_gather(reference, x[:64].clone())
    routes = group.stats.as_dict()
    destroyed = []
    for which in (group, None):  # cerar's group (its backends are its exact group's), then every group
        try:
            dist.destroy_process_group(which)
            destroyed.append("ok")
        except Exception as exc:
            destroyed.append(f"{type(exc).__name__}: {exc}")
    return {
        "destroyed": destroyed,
        "error": float((out - expected).norm() / expected.norm()),
        "coded_calls": routes.get("cerar", {}).get("sum", {}).get("calls", 0),
        "gathered": bool(torch.equal(gathered, torch.cat(reference))),
    }


def test_the_functional_ops_by_the_groups_name_reach_it_or_its_exact_group() -> None:
    """``_c10d_functional`` ops resolve a group by name and some ask it for its backend by device:
    cerar's group carries its exact group's (an all-gather runs there, bitwise); an all-reduce by
    name still reaches the group's own ``allreduce`` (coded at this size)."""
    for out in check(run_ranks(_by_name, 3, timeout=60, pg_timeout=20)):
        assert out["gathered"] and out["coded_calls"] == 1 and 0 < out["error"] < 1e-3, out
        assert out["destroyed"] == ["ok", "ok"], out


# -- 10. monitored_barrier ---------------------------------------------------------------------


def _monitored(rank: int, world: int) -> dict[str, Any]:
    import cerar
    from cerar.comm.group.create import monitored_barrier

    group = cerar.new_group(min_bytes=0, timeout=SHORT)
    out: dict[str, Any] = {"torch": _timed(lambda: dist.monitored_barrier(group=group, timeout=SHORT))}
    out["cerar"] = _timed(lambda: monitored_barrier(group))
    out["method"] = _timed(lambda: group.monitored_barrier(SHORT, wait_all_ranks=True))
    if rank != 2:  # rank 2 stays away: the barrier names it
        out["missing"] = _timed(lambda: monitored_barrier(group, datetime.timedelta(seconds=2), wait_all_ranks=True))
    else:
        wait_for_peers(at_most=15)  # alive and away until the others' barrier has named it
    return out


def test_monitored_barrier_on_the_group() -> None:
    """torch's ``dist.monitored_barrier`` refuses any group whose backend is not named "gloo" (a
    clear ValueError, today's behaviour); cerar's ``monitored_barrier`` (and the group's own
    method) runs it on the exact group, and names a rank that stays away."""
    results = check(run_ranks(_monitored, 3, timeout=60, pg_timeout=20))
    for out in results:
        assert out["torch"]["type"] == "ValueError" and "only implemented for GLOO" in out["torch"]["message"], out
        assert out["cerar"]["type"] is None and out["method"]["type"] is None, out
    assert "2" in results[0]["missing"]["message"] and results[0]["missing"]["seconds"] < QUICK, results[0]


def _cerar_world(rank: int, world: int, port: int, results: Any) -> None:
    """A rank whose default group is cerar's (``init_process_group("cerar")``): the backend's
    creator makes its inner groups from the store, agrees the settings, adopts the exact group's
    backends."""
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    try:
        import cerar.group
        from cerar.comm.group.create import monitored_barrier
        from cerar.comm.runtime.links import group_timeout

        dist.init_process_group("cerar", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=11))
        pg = dist.group.WORLD
        x = torch.randn(1 << 12, generator=torch.Generator().manual_seed(rank))
        expected = x.clone()
        dist.all_reduce(expected, group=pg.exact)
        dist.all_reduce(x)  # coded: 16 KB, the backend's default settings (min_bytes 2 MiB) send it exact
        monitored_barrier()
        gathered = torch.empty(64 * world)
        ops = torch.ops._c10d_functional
        ops.wait_tensor(ops.all_gather_into_tensor_out(x[:64].contiguous(), world, pg.group_name, out=gathered))
        sub = dist.new_group([0, 1], backend="cerar")
        out: Any = {
            "cerar": isinstance(pg, cerar.group.CerarProcessGroup),
            "same": bool(torch.equal(x, expected)),
            "timeouts": [group_timeout(g).total_seconds() for g in (pg.exact, pg.transport)],
            "inner_backend": str(dist.get_backend(pg.exact)),
            "sub": type(sub).__name__,
        }
    except Exception as exc:  # reported to the parent
        out = f"{type(exc).__name__}: {exc}"
    results.put((rank, out))
    results.close()
    results.join_thread()  # before destroy: the queue's thread must flush first
    os._exit(0)


def test_init_process_group_cerar_agrees_adopts_and_barriers() -> None:
    import multiprocessing as mp

    from multirank import free_port

    ctx = mp.get_context("fork")
    results, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_cerar_world, args=(r, 3, port, results), daemon=True) for r in range(3)]
    for proc in procs:
        proc.start()
    try:
        outs = dict(results.get(timeout=60) for _ in procs)
    finally:
        for proc in procs:
            proc.join(5)
            if proc.is_alive():
                proc.kill()
    for rank, out in outs.items():
        assert isinstance(out, dict), (rank, out)
        assert out["cerar"] and out["same"] and out["timeouts"] == [11.0, 11.0] and out["inner_backend"] == "gloo"
        assert (out["sub"] == "CerarProcessGroup") == (rank < 2), out  # non-members: torch's marker


# -- 11. state dicts (the full table is tests/unit/test_state_dict_values.py) --------------------


@pytest.mark.parametrize(("key", "value"), [("bucket_numel", {0: -5}), ("world_size", "4"), ("rank", -1)])
def test_auto_state_refuses_a_malformed_value_naming_the_key_and_the_value(key: str, value: Any) -> None:
    from cerar.ddp import AutoState

    state = AutoState()
    with pytest.raises(ValueError) as info:
        state.load_state_dict({**state.state_dict(), key: value})
    assert repr(key) in str(info.value) and repr(value) in str(info.value)
