"""What this machine can start and hold, and the checks every ``cerar`` command runs against it
before it starts ranks or work.

* Ranks: at most :data:`RANKS_PER_CORE` local ranks per core this process may run on
  (``os.sched_getaffinity``, else ``os.cpu_count``). Each rank is a Python process with torch:
  beyond four per core they queue for the CPUs, their start-up alone takes minutes, and what
  they time is the scheduler (the measurements here run two ranks per core).
* Memory: a command's estimate of the working memory of all its ranks (or of its one process)
  must fit the machine's physical memory (``MemTotal`` of ``/proc/meminfo``, else
  ``os.sysconf``). The estimates are the callers' (:func:`rank_process_bytes` is a rank's fixed
  part); they err high, as the limit exists to refuse what cannot run, not to fill the machine.

Both limits give way to the commands' ``--allow-oversubscribe`` (:data:`OVERRIDE_FLAG`), for a
machine whose cgroup, swap or patience the estimates do not know.
"""

from __future__ import annotations

import argparse
import os

__all__ = [
    "OVERRIDE_FLAG",
    "RANKS_PER_CORE",
    "RANK_PROCESS_BYTES",
    "add_override_flag",
    "check_memory",
    "check_ranks",
    "cores",
    "format_bytes",
    "max_ranks",
    "memory_bytes",
    "rank_process_bytes",
]

#: Local ranks allowed per core (see the module doc).
RANKS_PER_CORE = 4
#: A rank's fixed memory: the interpreter, torch and its thread pools (measured about 300 MB
#: resident for a bench rank before its tensors; rounded up).
RANK_PROCESS_BYTES = 512 << 20
#: The flag that lifts both limits.
OVERRIDE_FLAG = "--allow-oversubscribe"
_MEMINFO = "/proc/meminfo"


def cores() -> int:
    """The cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


def memory_bytes() -> int | None:
    """The machine's physical memory in bytes (``None`` where neither source says)."""
    try:
        with open(_MEMINFO) as meminfo:
            for line in meminfo:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024  # the kernel writes kB
    except (OSError, ValueError, IndexError):
        pass
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, OSError, ValueError):
        return None


def max_ranks() -> int:
    """The most local ranks a command starts without the override flag."""
    return RANKS_PER_CORE * cores()


def rank_process_bytes(ranks: int) -> int:
    """The fixed memory of ``ranks`` rank processes (:data:`RANK_PROCESS_BYTES` each)."""
    return ranks * RANK_PROCESS_BYTES


def add_override_flag(parser: argparse.ArgumentParser) -> None:
    """Add :data:`OVERRIDE_FLAG` to a command's parser."""
    parser.add_argument(
        OVERRIDE_FLAG,
        action="store_true",
        help=f"start more than {RANKS_PER_CORE} ranks per core, or work whose estimated memory exceeds "
        "the machine's (refused otherwise)",
    )


def check_ranks(name: str, ranks: int, *, allow: bool) -> int:
    """Return ``ranks`` after checking this machine can start that many local ranks.

    Raises:
        ValueError: more than :func:`max_ranks` and not ``allow``.
    """
    limit = max_ranks()
    if ranks > limit and not allow:
        raise ValueError(
            f"Argument '{name}' must be at most {limit} local ranks ({RANKS_PER_CORE} per core on this machine's "
            f"{cores()} cores; {OVERRIDE_FLAG} starts more), not {ranks}."
        )
    return ranks


def check_memory(name: str, value: object, needed_bytes: float, what: str, *, allow: bool) -> None:
    """Check that ``needed_bytes`` (an estimate of ``what``) fits this machine's memory.

    Args:
        name: the argument the message names (the one that made the work large).
        value: its value, as the message shows it.
        needed_bytes: the estimated working memory.
        what: what needs it, for the message (``"8 ranks x 100G"``).
        allow: the override flag was given.

    Raises:
        ValueError: the estimate exceeds the machine's memory and not ``allow``.
    """
    total = memory_bytes()
    if allow or total is None or needed_bytes <= total:
        return
    raise ValueError(
        f"Argument '{name}' must fit this machine's memory ({what} need about {format_bytes(needed_bytes)}, "
        f"it has {format_bytes(total)}; {OVERRIDE_FLAG} tries anyway), not {value}."
    )


def format_bytes(size: float) -> str:
    """``25327521792`` -> ``"23.6 GiB"`` (powers of 1024, up to PiB)."""
    for unit, scale in (("PiB", 1 << 50), ("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale:
            return f"{size / scale:.3g} {unit}"
    return f"{int(size)} B"
