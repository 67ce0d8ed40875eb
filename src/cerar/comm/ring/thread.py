"""The communication thread that runs every cerar call of a process, and the async handle.

One thread per process runs the calls in submission order, so async and sync calls interleave
exactly as issued on every rank (each rank's point-to-point messages must pair up with its
neighbours' in the same order). The thread is started on the first call and stopped by
:meth:`CommThread.shutdown` (``cerar.shutdown()``), which is also registered with ``atexit``:
a process that exits while a call is on the wire would otherwise tear down Gloo under a thread
still inside it, and the C++ runtime aborts the process ("terminate called without an active
exception", SIGABRT) after all its Python work is done.

Accelerators (by PyTorch's stream rules, as ``ProcessGroupNCCL`` keeps them): at submission an
event is recorded on the caller's current stream of the tensor's device; the communication
thread sets that device and runs the call on a dedicated stream (one per device) that first
waits for that event, so it sees everything the caller queued before; an event recorded on the
dedicated stream after the call is what the caller's side waits for: a blocking call and
:meth:`CerarWork.wait` make the caller's current stream wait for it (no host synchronisation),
and :meth:`CerarWork.get_future` returns a CUDA-aware ``torch.futures.Future(devices=[...])``,
completed after that stream waited too, so a consumer's ``wait()``/``then()`` is ordered after
the result (the DDP hooks return such futures).

Threads. The ranks' calls pair up by their order, so every rank must issue them in the same
order, and calls made from several Python threads at once have no order across ranks (rank
0's thread A would pair with rank 1's thread B). The rule: **a process's cerar calls come
from one thread at a time** (any thread: DDP's hooks run on the thread that calls
``backward()``, FSDP2's on autograd's while the main thread logs the loss), and a call from
another thread while a thread's calls are in flight **waits** until every one of them has
completed (a sync call returned, an async one's handle completed), then takes over
(:meth:`CommThread.submit`). A blocking call from the communication thread itself (a
callback), which would wait on itself forever, raises. The rule is per process, not per process
group: one thread runs the calls of every group. Waiting orders one rank's calls; the ranks must
still reach the calls in the same order (as they must for any collective).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future

import torch

__all__ = ["COMM", "CerarWork", "CommThread", "ShutdownError"]

#: How long :meth:`CommThread.shutdown` waits for the calls already submitted, by default. The
#: calls of a healthy ring finish in well under this; a call waiting on a dead peer fails by
#: itself within the process group's timeout.
DEFAULT_SHUTDOWN_TIMEOUT_S = 60.0


class ShutdownError(RuntimeError):
    """A call was still queued when ``cerar.shutdown()`` gave up waiting: it never ran."""


class _DeviceSync:
    """The events that order one call on an accelerator with its caller's streams (see the
    module docstring); CPU calls have none."""

    __slots__ = ("device", "done", "ready", "tensor")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.device = tensor.device
        self.ready = torch.cuda.Event()
        self.ready.record(torch.cuda.current_stream(self.device))
        self.done: torch.cuda.Event | None = None  # recorded on the dedicated stream after the call

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """On the communication thread: the call's device and dedicated stream, after ``ready``."""
        stream = _dedicated_stream(self.device)
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            stream.wait_event(self.ready)
            # The caller's tensor is used on cerar's stream: the caching allocator must not hand
            # its memory out again before that stream is done with it (as ProcessGroupNCCL does).
            self.tensor.record_stream(stream)
            try:
                yield
            finally:
                self.done = torch.cuda.Event()
                self.done.record(stream)

    def order_current_stream(self) -> None:
        """Make the calling thread's current stream of the device wait for the call's work."""
        if self.done is not None:
            torch.cuda.current_stream(self.device).wait_event(self.done)


_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _dedicated_stream(device: torch.device) -> torch.cuda.Stream:
    """cerar's own stream on ``device`` (created once, on the communication thread)."""
    if device not in _STREAMS:
        _STREAMS[device] = torch.cuda.Stream(device)
    return _STREAMS[device]


def _device_sync(tensor: torch.Tensor) -> _DeviceSync | None:
    return _DeviceSync(tensor) if tensor.device.type == "cuda" else None


class CerarWork:
    """Handle of an async cerar call, shaped like ``torch.distributed.Work``."""

    def __init__(self, future: Future[torch.Tensor], sync: _DeviceSync | None = None) -> None:
        self._future = future
        self._sync = sync

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the call completes; re-raise its error; on an accelerator, order the
        caller's current stream after the call's work. Returns True."""
        self._future.result(timeout=timeout)
        if self._sync is not None:
            self._sync.order_current_stream()
        return True

    def is_completed(self) -> bool:
        return self._future.done()

    def get_future(self) -> torch.futures.Future[list[torch.Tensor]]:
        """A ``torch.futures.Future`` whose value is ``[tensor]``, as for torch's all_reduce
        (CUDA-aware for a CUDA tensor: its consumers' streams wait for the result)."""
        sync = self._sync
        devices = [sync.device] if sync is not None else None
        out: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future(devices=devices)

        def forward(done: Future[torch.Tensor]) -> None:
            error = done.exception()
            if error is not None:
                out.set_exception(error)
                return
            if sync is not None:
                # The future records an event on the current stream of whichever thread runs
                # this (the communication thread, or the caller's if the call had finished): make
                # that stream wait for the call first.
                with torch.cuda.device(sync.device):
                    sync.order_current_stream()
                    out.set_result([done.result()])
            else:
                out.set_result([done.result()])

        self._future.add_done_callback(forward)
        return out


_Job = tuple[Callable[[], None], Future[torch.Tensor], torch.Tensor, "_DeviceSync | None"]


class _Worker:
    """One started thread and its own queue (``None`` in the queue tells it to stop).

    A queue per thread, not one for the process: a thread that :meth:`CommThread.shutdown`
    gave up on (stuck in a call) must never pick up the calls of the thread that replaces it.
    """

    def __init__(self, finished: Callable[[Future[torch.Tensor]], None]) -> None:
        self.jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self.finished = finished  # told before each future completes (see _Callers)
        self.thread = threading.Thread(target=self._loop, name="cerar-comm", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        torch.set_num_threads(max(1, torch.get_num_threads()))
        while True:
            item = self.jobs.get()
            if item is None:
                return
            job, future, tensor, sync = item
            if not future.set_running_or_notify_cancel():
                self.finished(future)
                continue
            try:
                with sync.running() if sync is not None else contextlib.nullcontext():
                    job()
            except BaseException as exc:  # surfaced to the caller through the future
                self.finished(future)
                future.set_exception(exc)
            else:
                self.finished(future)
                future.set_result(tensor)

    def fail_queued(self) -> int:
        """Fail every call still queued (never started); returns how many."""
        failed = 0
        while True:
            try:
                item = self.jobs.get_nowait()
            except queue.Empty:
                return failed
            if item is not None and item[1].set_running_or_notify_cancel():
                self.finished(item[1])
                item[1].set_exception(
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
        self._in_flight: set[Future[torch.Tensor]] = set()

    def enter(self, future: Future[torch.Tensor]) -> None:
        """Count ``future`` as the calling thread's, once no other thread's calls are in flight."""
        me = threading.current_thread()
        with self._turn:
            while self._in_flight and self._thread is not None and self._thread is not me:
                self._turn.wait()
            self._thread = me
            self._in_flight.add(future)

    def leave(self, future: Future[torch.Tensor]) -> None:
        """``future`` is about to complete (idempotent)."""
        with self._turn:
            self._in_flight.discard(future)
            if not self._in_flight:
                self._thread = None
                self._turn.notify_all()


class CommThread:
    """The process's communication thread: started on demand, stopped by :meth:`shutdown`."""

    def __init__(self) -> None:
        self._worker: _Worker | None = None
        # Held while a thread is started or stopped, and while a call is queued: a call
        # submitted during a shutdown waits for it and then goes to a fresh thread, so two
        # threads never run calls at the same time.
        self._lock = threading.Lock()
        self._atexit_registered = False
        self._callers = _Callers()

    def submit(self, job: Callable[[], None], tensor: torch.Tensor, async_op: bool) -> CerarWork | None:
        """Queue ``job`` (which works on ``tensor`` in place); wait for it unless ``async_op``."""
        future: Future[torch.Tensor] = Future()
        worker = self._worker
        if not async_op and worker is not None and worker.thread is threading.current_thread():
            raise RuntimeError(
                "cerar: a blocking call (async_op=False) cannot be made from the communication thread "
                "(a CerarWork callback): it would wait for itself. Pass async_op=True."
            )
        self._callers.enter(future)
        try:
            sync = _device_sync(tensor)
            self._queue(job, future, tensor, sync)
        except BaseException:
            self._callers.leave(future)
            raise
        if async_op:
            return CerarWork(future, sync)
        future.result()
        if sync is not None:
            sync.order_current_stream()
        return None

    def _queue(
        self, job: Callable[[], None], future: Future[torch.Tensor], tensor: torch.Tensor, sync: _DeviceSync | None
    ) -> None:
        with self._lock:
            if self._worker is None or not self._worker.thread.is_alive():
                self._worker = _Worker(self._callers.leave)
                if not self._atexit_registered:
                    # Registered at the first call, so it runs before the exit handlers of
                    # whatever the program set up before (atexit runs them last-in first-out).
                    atexit.register(self.shutdown)
                    self._atexit_registered = True
            self._worker.jobs.put((job, future, tensor, sync))

    def shutdown(self, timeout_s: float | None = DEFAULT_SHUTDOWN_TIMEOUT_S) -> bool:
        """Stop the thread after the calls already submitted; see ``cerar.shutdown``.

        Returns True if the thread is gone (or never ran), False if a call was still running
        after ``timeout_s`` (the calls queued behind it then fail with :class:`ShutdownError`
        and the thread is abandoned; it exits once that call returns).
        """
        with self._lock:
            worker, self._worker = self._worker, None
            if worker is None:
                return True
            if worker.thread is threading.current_thread():
                self._worker = worker
                raise RuntimeError("cerar.shutdown cannot be called from the communication thread (a callback).")
            worker.jobs.put(None)
            worker.thread.join(timeout_s)
            if worker.thread.is_alive():
                worker.fail_queued()
                worker.jobs.put(None)  # the stop request was drained too: ask again
                return False
        return True

    def _after_fork(self) -> None:
        # A forked child has no thread (only the forking one survives fork) and may have
        # inherited the lock held: start from scratch.
        self._worker = None
        self._lock = threading.Lock()
        self._callers = _Callers()


COMM = CommThread()
with contextlib.suppress(AttributeError):  # os.register_at_fork: POSIX only
    os.register_at_fork(after_in_child=COMM._after_fork)
