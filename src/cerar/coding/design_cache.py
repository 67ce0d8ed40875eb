"""On-disk cache for designs that take seconds to compute (:func:`cerar.coding.optimize.optimized`).

One JSON file per entry, named by the SHA-256 of the entry's key (every input of the
computation, the library version and the algorithm's own version). An entry is trusted only if
it parses, its stored key equals the requested key, and its code rebuilds; anything else (a
truncated file, a file from another version, hand-edited JSON) counts as a miss, is recomputed
and overwritten. The folder is cerar's private cache folder (:mod:`cerar._cache`: ``$CERAR_CACHE_DIR``,
else ``$XDG_CACHE_HOME/cerar``, else ``~/.cache/cerar``), read and written only while no other
user can write to it, since a planted entry would change the sums; files are written atomically,
so a reader never sees a half-written entry. A folder that cannot be used is not an error: the
design is computed and not cached. Pure standard library plus :class:`cerar.Code`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from cerar._cache import PrivateFolder, cache_dir
from cerar.coding.linear_code import Code

__all__ = ["cache_dir", "cached_code", "entry_path"]


def _canonical(key: Mapping[str, Any]) -> str:
    return json.dumps(dict(key), sort_keys=True, separators=(",", ":"))


def entry_path(kind: str, key: Mapping[str, Any]) -> Path:
    """Where the entry of ``kind`` (a short word, e.g. ``"optimized"``) with ``key`` lives."""
    digest = hashlib.sha256(_canonical(key).encode()).hexdigest()[:32]
    return cache_dir() / f"{kind}-{digest}.json"


def _load(path: Path, key: Mapping[str, Any]) -> tuple[Code, dict[str, Any]] | None:
    try:
        with PrivateFolder.open(path.parent) as folder:
            raw = folder.read(path.name)
        if raw is None:
            return None
        data = json.loads(raw)
        if not isinstance(data, dict) or data.get("key") != json.loads(_canonical(key)):
            return None
        code = Code.from_dict(data["code"])
        extra = data.get("extra", {})
        return (code, extra) if isinstance(extra, dict) else None
    except (OSError, ValueError, TypeError, KeyError, IndexError, AttributeError):
        # Missing, unreadable, corrupt or stale: a miss, never a crash.
        return None


def _store(path: Path, key: Mapping[str, Any], code: Code, extra: Mapping[str, Any]) -> None:
    payload = json.dumps({"key": json.loads(_canonical(key)), "code": code.to_dict(), "extra": dict(extra)})
    try:
        with PrivateFolder.open(path.parent) as folder:
            folder.write(path.name, payload.encode())
    except OSError:
        pass  # read-only, full or not private (UnsafeFolderError): caching is an optimisation


def cached_code(
    kind: str,
    key: Mapping[str, Any],
    compute: Callable[[], tuple[Code, dict[str, Any]]],
    *,
    validate: Callable[[Code, dict[str, Any]], bool] | None = None,
) -> tuple[Code, dict[str, Any], bool]:
    """Return ``(code, extra, hit)``: the cached entry if valid, else ``compute()`` stored.

    ``extra`` is a small JSON-ready dict stored beside the code (figures of merit).
    ``validate(code, extra)`` may reject a parsed entry (e.g. wrong ``N``); rejected entries are
    recomputed like corrupt ones.
    """
    path = entry_path(kind, key)
    loaded = _load(path, key)
    if loaded is not None and (validate is None or validate(*loaded)):
        return loaded[0], loaded[1], True
    code, extra = compute()
    _store(path, key, code, extra)
    return code, extra, False
