"""The one progress-line protocol between a rank and the driver that launched it.

A rank (rank 0, usually) prints lines ``@@cerar-progress KIND DONE TOTAL DETAIL`` on stdout;
the launcher hands every line to the driver's ``on_line`` callback, which turns the ones of its
kind into a progress bar with :func:`parse_progress`. ``KIND`` names the worker (``bench``,
``train``, ``capture``), so a driver never mistakes another program's output for its own;
``DETAIL`` is free text to the end of the line (a case label, a loss).

One format and one parser for every worker: a change on one side cannot silently stop the
other side's bar.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from typing import TextIO

__all__ = ["PREFIX", "Progress", "format_progress", "parse_progress", "print_progress"]

PREFIX = "@@cerar-progress"
_KIND = re.compile(r"^[a-z][a-z0-9_-]*$")
_LINE = re.compile(rf"^{re.escape(PREFIX)} ([a-z][a-z0-9_-]*) (\d+) (\d+)(?: (.*))?$")


@dataclass(frozen=True)
class Progress:
    """One parsed progress line: ``done`` of ``total`` units of work of ``kind``, and a detail."""

    kind: str
    done: int
    total: int
    detail: str = ""


def format_progress(kind: str, done: int, total: int, detail: str = "") -> str:
    """The line (without newline) that reports ``done`` of ``total``; see the module doc."""
    if not isinstance(kind, str) or not _KIND.match(kind):
        raise ValueError(f"Argument 'kind' must be a lower-case word such as 'train', not {kind!r}.")
    for name, value in (("done", done), ("total", total)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"Argument '{name}' must be a non-negative integer, not {value!r}.")
    if not isinstance(detail, str) or "\n" in detail or "\r" in detail:
        raise ValueError(f"Argument 'detail' must be a one-line string, not {detail!r}.")
    line = f"{PREFIX} {kind} {done} {total}"
    return f"{line} {detail}" if detail else line


def print_progress(kind: str, done: int, total: int, detail: str = "", file: TextIO | None = None) -> None:
    """Write one progress line to ``file`` (stdout) in a single write, flushed at once, so the
    driver sees it while the rank runs and never half a line."""
    stream = sys.stdout if file is None else file
    stream.write(format_progress(kind, done, total, detail) + "\n")
    stream.flush()


def parse_progress(line: str, kind: str | None = None) -> Progress | None:
    """The :class:`Progress` in ``line`` (trailing newline allowed), or None if ``line`` is no
    progress line (or one of another ``kind``, when given)."""
    match = _LINE.match(line.rstrip("\r\n"))
    if match is None or (kind is not None and match.group(1) != kind):
        return None
    return Progress(match.group(1), int(match.group(2)), int(match.group(3)), match.group(4) or "")
