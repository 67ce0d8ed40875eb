"""cerar's cache folder, trusted only while it is private to the user who runs cerar.

Two things are cached: designs that take seconds to compute (JSON, :mod:`cerar.coding.design_cache`)
and the compiled coding (a shared library that the process then loads and runs,
:mod:`cerar.comm.algorithms.native`). A file that another local user could plant there would be run, or
would change the sums, so the folder is used only when

* it is a real folder (not a link), owned by the current user, and no one else can write to it
  (created with mode ``0o700``; an existing folder with group or other write permission is
  refused: whatever it holds may have been planted while it was open);
* every file in it is opened relative to the folder's open handle (a rename of the folder or of
  one of its parents after the check changes nothing) and never through a link (``O_NOFOLLOW``);
* every file is written to a fresh name created exclusively, then renamed over the target, so a
  reader never sees half a file.

The folder is ``$CERAR_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/cerar``, else
``~/.cache/cerar``. :meth:`PrivateFolder.fresh` gives a new private folder in the temp folder
instead (unpredictable name, removed when closed), for a process whose cache folder is refused.
Needs POSIX (``O_NOFOLLOW``, ``dir_fd``); elsewhere no folder is trusted.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

try:
    import fcntl
except ImportError:  # not POSIX: no folder is trusted there anyway
    fcntl = None  # type: ignore[assignment]

__all__ = ["ENV_VAR", "PrivateFolder", "UnsafeFolderError", "cache_dir"]

ENV_VAR = "CERAR_CACHE_DIR"
_SAFE_PLATFORM = hasattr(os, "O_NOFOLLOW") and os.open in os.supports_dir_fd and hasattr(os, "getuid")


class UnsafeFolderError(OSError):
    """A cache folder that is not private to this user: not a folder, someone else's, or open to
    writes by others."""


def cache_dir() -> Path:
    """The cache folder's path (neither created nor checked here: :meth:`PrivateFolder.open`)."""
    explicit = os.environ.get(ENV_VAR)
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "cerar"


class PrivateFolder:
    """An open handle on a folder only this user can write; files are read and written by name
    relative to it (see the module doc). Use as a context manager, or :meth:`close` it."""

    def __init__(self, path: Path, fd: int, temporary: bool = False) -> None:
        self.path, self._fd, self._temporary = path, fd, temporary

    @classmethod
    def open(cls, path: Path | str) -> PrivateFolder:
        """The folder at ``path``, created (mode ``0o700``) if missing. Raises
        :class:`UnsafeFolderError` naming the folder and why it is refused, or ``OSError`` if it
        cannot be created or opened."""
        path = Path(path)
        if not _SAFE_PLATFORM:
            raise UnsafeFolderError(f"cerar: the cache folder {path} cannot be checked on this platform")
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError as exc:
            raise UnsafeFolderError(
                f"cerar: the cache folder {path} is not a folder of its own (a link?): {exc}"
            ) from None
        try:
            _check_private(path, os.fstat(fd))
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd)

    @classmethod
    def fresh(cls) -> PrivateFolder:
        """A new private folder in the temp folder (``mkdtemp``: an unpredictable name, mode
        ``0o700``), removed with what it holds when closed."""
        folder = cls.open(tempfile.mkdtemp(prefix="cerar-"))
        folder._temporary = True
        return folder

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
            if self._temporary:
                shutil.rmtree(self.path, ignore_errors=True)

    def __enter__(self) -> PrivateFolder:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def read(self, name: str) -> bytes | None:
        """The content of the regular file ``name``, or None if there is none (a link, a folder
        or anything but a regular file counts as none)."""
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=self._fd)
        except OSError:  # missing, a link (ELOOP), unreadable
            return None
        with os.fdopen(fd, "rb") as handle:
            if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
                return None
            return handle.read()

    def write(self, name: str, data: bytes) -> None:
        """Write ``data`` as ``name`` atomically: to a fresh name created exclusively (no link
        followed), then renamed over ``name`` (a link there is replaced, not followed)."""
        temporary = f".{name}.{secrets.token_hex(8)}.tmp"
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=self._fd)
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
            os.replace(temporary, name, src_dir_fd=self._fd, dst_dir_fd=self._fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temporary, dir_fd=self._fd)
            raise

    @contextlib.contextmanager
    def locked(self, name: str) -> Iterator[None]:
        """Hold an exclusive lock on the file ``name`` (created, no link followed) while inside."""
        fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600, dir_fd=self._fd)
        try:
            if fcntl is not None:
                fcntl.flock(fd, fcntl.LOCK_EX)  # released when the file is closed
            yield
        finally:
            os.close(fd)


def _check_private(path: Path, info: os.stat_result) -> None:
    if not stat.S_ISDIR(info.st_mode):
        raise UnsafeFolderError(f"cerar: the cache folder {path} is not a folder")
    if info.st_uid != os.getuid():
        raise UnsafeFolderError(
            f"cerar: the cache folder {path} belongs to user id {info.st_uid}, not to this user ({os.getuid()})"
        )
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafeFolderError(
            f"cerar: the cache folder {path} can be written by other users (mode {stat.S_IMODE(info.st_mode):#o}); "
            f"check what it holds, then `chmod 700` it or remove it"
        )
