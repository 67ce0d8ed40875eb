"""Process checks the integration tests share."""

from __future__ import annotations


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (a zombie has exited: it counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False
