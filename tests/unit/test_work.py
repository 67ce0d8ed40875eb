"""cerar's futures (:mod:`cerar.comm.runtime.work`), in one process: errors keep their type through
:func:`chain`, and what a chain holds is let go before its future completes."""

from __future__ import annotations

import gc
import threading
import weakref
from typing import Any

import pytest
import torch

from cerar.comm.runtime.work import Work, chain, forward


class _Held:
    """Stands for a process group: something a finish holds whose freeing thread matters."""


def _finish_holding(held: _Held) -> Any:
    return lambda done: (held, done.wait())[1]


def test_chain_lets_go_of_its_finish_before_its_future_completes() -> None:
    source: torch.futures.Future[Any] = torch.futures.Future()
    held = _Held()
    alive = weakref.ref(held)
    out = chain(source, _finish_holding(held))
    seen: list[object] = []
    # Runs when ``out`` completes, on the completing thread: whoever wakes on ``out`` may drop its
    # own references then, so the chain must hold none by that time.
    out.add_done_callback(lambda _: (gc.collect(), seen.append(alive())))
    del held
    thread = threading.Thread(target=source.set_result, args=([torch.ones(2)],))
    thread.start()
    thread.join(10)
    assert seen == [None]
    assert out.wait()[0].tolist() == [1.0, 1.0]


def test_chain_hands_on_the_error_with_its_type() -> None:
    source: torch.futures.Future[Any] = torch.futures.Future()
    out = forward(source)
    source.set_exception(KeyError("lost"))
    with pytest.raises(KeyError, match="lost"):
        out.wait()
    work = Work(out)
    assert isinstance(work.exception(), KeyError)
    with pytest.raises(RuntimeError, match="KeyError"):  # torch's C++ reads get_future()'s error
        work.get_future().wait()
