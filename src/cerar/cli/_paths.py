"""The commands' input and output paths, checked before any work: a path that cannot be read or
written is a ``ValueError`` naming the argument, the path and why (``cerar`` prints it as one
line and exits 2), not an ``OSError`` traceback after minutes of measuring."""

from __future__ import annotations

import tempfile
from pathlib import Path

__all__ = ["input_text", "output_file", "output_folder"]


def output_folder(name: str, path: Path | str) -> Path:
    """Create the folder ``path`` (with its parents) and check this process can write in it."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):  # root passes os.access on a read-only mount
            pass
    except OSError as exc:
        raise ValueError(
            f"Argument '{name}' must be a folder this process can write, not {str(path)!r} ({_why(path, exc)})."
        ) from None
    return path


def output_file(name: str, path: Path | str) -> Path:
    """Check the file ``path`` can be written (its folder is created), without writing it."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"Argument '{name}' must be a file this process can write, not the folder {str(path)!r}.")
    try:
        output_folder(name, path.parent)
    except ValueError:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            why = _why(path.parent, exc)
        else:
            why = f"cannot write in {str(path.parent)!r}"
        raise ValueError(
            f"Argument '{name}' must be a file this process can write, not {str(path)!r} ({why})."
        ) from None
    return path


def input_text(name: str, path: Path | str, what: str) -> str:
    """The text of the file ``path`` (``what`` it must be, for the message)."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"Argument '{name}' must be {what}, not the folder {str(path)!r}.")
    try:
        return path.read_text()
    except OSError as exc:
        raise ValueError(f"Argument '{name}' must be {what}, not {str(path)!r} ({_why(path, exc)}).") from None
    except UnicodeDecodeError:
        raise ValueError(f"Argument '{name}' must be {what}, not {str(path)!r} (not text).") from None


def _why(path: Path, exc: OSError) -> str:
    """The reason in words: the path or ancestor that is a file, else the OS's (``No such file or
    directory``)."""
    for parent in (path, *path.parents):
        if parent.exists():
            if not parent.is_dir():
                return f"{str(parent)!r} is a file"
            break
    return exc.strerror or str(exc)
