"""Atomic file writes shared by every layer: a reader never sees half a file.

The one helper behind the design cache, the benchmark's and training's result files and the
gradient captures: write to a temporary file in the target's folder, then ``os.replace`` it
over the target (atomic on POSIX), and never leave the temporary behind.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

__all__ = ["atomic_path", "atomic_write_text"]


@contextlib.contextmanager
def atomic_path(path: Path | str, suffix: str = ".tmp") -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on a clean exit it replaces ``path``.

    The parent folder is created. On an exception the temporary file is removed and ``path``
    keeps what it held before.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=suffix, dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def atomic_write_text(path: Path | str, text: str) -> Path:
    """Write ``text`` to ``path`` atomically and return ``path`` as a :class:`Path`."""
    with atomic_path(path) as tmp:
        tmp.write_text(text)
    return Path(path)
