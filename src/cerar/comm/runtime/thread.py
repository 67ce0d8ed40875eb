"""The communication threads that run cerar's calls: one per process group.

A group's thread runs its calls in submission order, so async and sync calls interleave exactly
as issued on every rank (each rank's point-to-point messages must pair up with its neighbours'
in the same order). Groups have a thread each, as Gloo's have: two groups that share ranks and
are called in different orders by different ranks (rank 1 calls B then A, rank 2 A then B) both
complete, where one thread for the process would hold A's call behind B's on one rank and B's
behind A's on the other (a deadlock). Each thread is started on its group's first call and stopped by
:meth:`CommThread.shutdown` (``cerar.shutdown()``), which is also registered with ``atexit``:
a process that exits while a call is on the wire would otherwise tear down Gloo under a thread
still inside it, and the C++ runtime aborts the process ("terminate called without an active
exception", SIGABRT) after all its Python work is done.

Accelerators (by PyTorch's stream rules, as ``ProcessGroupNCCL`` keeps them): at submission an
event is recorded on the caller's current stream of the tensor's device; the communication
thread sets that device and runs the call on a dedicated stream (one per device) that first
waits for that event, so it sees everything the caller queued before; the call's future is a
CUDA-aware ``torch.futures.Future(devices=[...])`` completed on that stream after the call, so a
blocking call, :meth:`cerar.comm.runtime.work.Work.wait` and a consumer's ``wait()`` order the
caller's current stream after the result (no host synchronisation).

Threads. The ranks' calls pair up by their order, so every rank must issue them in the same
order, and calls made from several Python threads at once have no order across ranks (rank
0's thread A would pair with rank 1's thread B). The rules: a call from another thread while
a thread's calls are in flight **waits** until every one of them has completed (a sync call
returned, an async one's handle completed), then takes over (:meth:`CommThread.submit`); and
every call carries the thread it came from and that thread's own count of calls on the group
into its handshake (:class:`cerar.comm.runtime.groups.CallNumber`), so calls of different threads
that meet raise :class:`cerar.SettingsMismatchError` on every rank instead of summing unrelated
tensors. DDP's hooks run on the thread that calls ``backward()`` (on an accelerator, autograd's,
a "native" thread on every rank), FSDP2's likewise, the loss logging after it on the main
thread: one thread at a time, as every collective library needs. A blocking call from a group's
communication thread onto the same group (a callback), which would wait on itself forever, raises.
:data:`RUNNING` tells code running on a communication thread whose it is (the scratch memory of
:mod:`cerar.comm.algorithms.workspace` is kept per group: two groups' calls run at once).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from cerar.comm.runtime.groups import ORIGIN, thread_key
from cerar.comm.runtime.work import Work

__all__ = ["COMM", "RUNNING", "CommThread", "ShutdownError", "Work"]

#: How long :meth:`CommThread.shutdown` waits for the calls already submitted, by default. The
#: calls of a healthy ring finish in well under this; a call waiting on a dead peer fails by
#: itself within the process group's timeout.
DEFAULT_SHUTDOWN_TIMEOUT_S = 60.0


#: On a communication thread, ``RUNNING.key``: the group whose calls it runs (None: the default
#: group's, or no communication thread).
RUNNING = threading.local()


class ShutdownError(RuntimeError):
    """A call was still queued when ``cerar.shutdown()`` gave up waiting: it never ran."""


class _DeviceSync:
    """The event that orders one call on an accelerator after its caller's stream (see the
    module docstring); CPU calls have none. The call's future, completed on cerar's stream,
    orders its readers after the call."""

    __slots__ = ("device", "ready", "tensors")

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.tensors = tensors
        self.device = tensors[0].device
        self.ready = torch.cuda.Event()
        self.ready.record(torch.cuda.current_stream(self.device))

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """On the communication thread: the call's device and dedicated stream, after ``ready``."""
        stream = _dedicated_stream(self.device)
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            stream.wait_event(self.ready)
            # The caller's tensors are used on cerar's stream: the caching allocator must not hand
            # their memory out again before that stream is done with them (as ProcessGroupNCCL does).
            for tensor in self.tensors:
                tensor.record_stream(stream)
            yield


_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _dedicated_stream(device: torch.device) -> torch.cuda.Stream:
    """cerar's own stream on ``device`` (created once, on the communication thread)."""
    if device not in _STREAMS:
        _STREAMS[device] = torch.cuda.Stream(device)
    return _STREAMS[device]


def _device_sync(tensors: list[torch.Tensor]) -> _DeviceSync | None:
    return _DeviceSync(tensors) if tensors and tensors[0].device.type == "cuda" else None


def _key(group: Any) -> Any:
    """The thread a group's calls go to: the default group's (None) for None and the world."""
    if group is None or (dist.is_initialized() and group is dist.group.WORLD):
        return None
    return group


@dataclass(frozen=True)
class _Job:
    """One queued call: what runs, the future it completes (value: ``tensors``), and on an
    accelerator its events."""

    run: Callable[[], None]
    future: torch.futures.Future[list[torch.Tensor]]
    tensors: list[torch.Tensor]
    sync: _DeviceSync | None
    origin: str = field(default_factory=thread_key)  # the submitting thread (cerar.comm.runtime.groups)
    token: object = field(default_factory=object)


class _Worker:
    """One started thread and its own queue (``None`` in the queue tells it to stop).

    A queue per thread, not one for the process: a thread that :meth:`CommThread.shutdown`
    gave up on (stuck in a call) must never pick up the calls of the thread that replaces it.
    """

    def __init__(self, finished: Callable[[object], None], key: Any = None) -> None:
        self.jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self.finished = finished  # told before each future completes (see _Callers)
        self.key = key
        name = "cerar-comm" if key is None else f"cerar-comm-{id(key):x}"
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        torch.set_num_threads(max(1, torch.get_num_threads()))
        RUNNING.key = self.key
        while True:
            job = self.jobs.get()
            if job is None:
                return
            # Completed inside the device's stream context: a CUDA-aware future records its events
            # on cerar's stream, after the call's work.
            ORIGIN.key = job.origin
            with job.sync.running() if job.sync is not None else contextlib.nullcontext():
                try:
                    job.run()
                except BaseException as exc:  # handed to the caller with its own type
                    self.finished(job.token)
                    job.future.set_exception(exc)
                else:
                    self.finished(job.token)
                    job.future.set_result(job.tensors)
            # Not kept while the thread waits for the next call: the call's tensors, and the
            # closures that hold its process group, go with their caller's references.
            del job

    def fail_queued(self) -> int:
        """Fail every call still queued (never started); returns how many."""
        failed = 0
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                return failed
            if job is not None:
                self.finished(job.token)
                job.future.set_exception(
                    ShutdownError("cerar.shutdown: the call was still queued behind a stuck call and never ran.")
                )
                failed += 1


class _Callers:
    """The thread whose calls are in flight: another thread's call waits until they have all
    completed (see the module docstring).

    A call leaves the count just *before* its future completes (the communication thread calls
    :meth:`leave` first), so a thread that saw ``wait()`` return can hand over at once; a
    done-callback would run only after the waiter woke up. Its own lock, because ``leave`` runs
    on the communication thread while :meth:`CommThread.shutdown` may hold the other one.
    """

    def __init__(self) -> None:
        self._turn = threading.Condition()
        self._thread: threading.Thread | None = None
        self._in_flight: set[object] = set()

    def enter(self, token: object) -> None:
        """Count the call ``token`` as the calling thread's, once no other thread's calls are in flight."""
        me = threading.current_thread()
        with self._turn:
            while self._in_flight and self._thread is not None and self._thread is not me:
                self._turn.wait()
            self._thread = me
            self._in_flight.add(token)

    def leave(self, token: object) -> None:
        """The call ``token`` is about to complete (idempotent)."""
        with self._turn:
            self._in_flight.discard(token)
            if not self._in_flight:
                self._thread = None
                self._turn.notify_all()


class CommThread:
    """The process's communication threads, one per group: started on demand, stopped by
    :meth:`shutdown`."""

    def __init__(self) -> None:
        self._workers: dict[Any, _Worker] = {}
        # Held while a thread is started or stopped, and while a call is queued: a call
        # submitted during a shutdown waits for it and then goes to a fresh thread, so two
        # threads never run one group's calls at the same time.
        self._lock = threading.Lock()
        self._atexit_registered = False
        self._callers: dict[Any, _Callers] = {}

    def submit(
        self,
        run: Callable[[], None],
        tensors: torch.Tensor | list[torch.Tensor],
        async_op: bool,
        group: Any = None,
    ) -> Work | None:
        """Queue ``run`` (which works on ``tensors`` in place) on ``group``'s thread (None: the
        default group's); a :class:`Work` whose future's value is ``tensors`` (a list), or with
        ``async_op=False`` wait for it (its error raised here)."""
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        group = _key(group)
        worker = self._workers.get(group)
        if not async_op and worker is not None and worker.thread is threading.current_thread():
            raise RuntimeError(
                "cerar: a blocking call (async_op=False) cannot be made from the communication thread "
                "(a Work's callback): it would wait for itself. Pass async_op=True."
            )
        sync = _device_sync(tensors)
        devices = [sync.device] if sync is not None else None
        job = _Job(run, torch.futures.Future(devices=devices), tensors, sync)
        with self._lock:
            callers = self._callers.setdefault(group, _Callers())
        callers.enter(job.token)
        try:
            self._queue(job, group, callers)
        except BaseException:
            callers.leave(job.token)
            raise
        if async_op:
            return Work(job.future)
        job.future.wait()  # the call's own error; on an accelerator, orders the current stream after it
        return None

    def _queue(self, job: _Job, group: Any, callers: _Callers) -> None:
        with self._lock:
            worker = self._workers.get(group)
            if worker is None or not worker.thread.is_alive():
                worker = self._workers[group] = _Worker(callers.leave, group)
                if not self._atexit_registered:
                    # Registered at the first call, so it runs before the exit handlers of
                    # whatever the program set up before (atexit runs them last-in first-out).
                    atexit.register(self.shutdown)
                    self._atexit_registered = True
            worker.jobs.put(job)

    def shutdown(self, timeout_s: float | None = DEFAULT_SHUTDOWN_TIMEOUT_S) -> bool:
        """Stop the threads after the calls already submitted; see ``cerar.shutdown``.

        Returns True if every thread is gone (or none ran), False if a call was still running
        after ``timeout_s`` (the calls queued behind it then fail with :class:`ShutdownError`
        and its thread is abandoned; it exits once that call returns).
        """
        with self._lock:
            workers, self._workers = self._workers, {}
            current = threading.current_thread()
            if any(worker.thread is current for worker in workers.values()):
                self._workers = workers
                raise RuntimeError("cerar.shutdown cannot be called from the communication thread (a callback).")
            for worker in workers.values():
                worker.jobs.put(None)
            stopped, deadline = True, None if timeout_s is None else time.monotonic() + timeout_s
            for worker in workers.values():
                worker.thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
                if worker.thread.is_alive():
                    worker.fail_queued()
                    worker.jobs.put(None)  # the stop request was drained too: ask again
                    stopped = False
        return stopped

    def _after_fork(self) -> None:
        # A forked child has no thread (only the forking one survives fork) and may have
        # inherited the lock held: start from scratch.
        self._workers = {}
        self._lock = threading.Lock()
        self._callers = {}


COMM = CommThread()
with contextlib.suppress(AttributeError):  # os.register_at_fork: POSIX only
    os.register_at_fork(after_in_child=COMM._after_fork)
