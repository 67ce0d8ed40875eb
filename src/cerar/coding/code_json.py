"""The JSON description and identity of a :class:`cerar.Code` (mixed into it as :class:`CodeJson`).

A code is described by what built it: its node set (one node per conjugate pair) when it was
built from nodes, else its table of rows, plus the decoder and the construction's name and
parameters. The canonical JSON text of that description is the code's identity: ranks compare
its SHA-256 (:attr:`CodeJson.fingerprint`) to check that they hold the same code, and two codes
are equal when their fingerprints are. Kept apart from :mod:`cerar.coding.linear_code` so that the
maths there reads without the bookkeeping. Pure standard library plus numpy.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any, TypeVar

import numpy as np

__all__ = ["JSON_FORMAT", "CodeJson"]

JSON_FORMAT = "cerar.coding.linear_code/1"
_C = TypeVar("_C", bound="CodeJson")


class CodeJson:
    """Serialisation and identity of :class:`cerar.coding.linear_code.Code`, its only subclass.

    Reads the attributes below, which ``Code.__init__`` sets; :meth:`from_dict` rebuilds through
    ``Code.from_nodes`` or ``Code(world_size, rows, ...)``.
    """

    world_size: int
    components: int
    construction: str
    params: dict[str, Any]
    reference: str
    spread_seam: bool
    _rows: np.ndarray
    _nodes: tuple[np.ndarray, np.ndarray] | None
    _fingerprint: str | None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready description from which :meth:`from_dict` rebuilds the same code."""
        out: dict[str, Any] = {
            "format": JSON_FORMAT,
            "world_size": self.world_size,
            "components": self.components,
            "construction": self.construction,
            "params": self.params,
            "reference": self.reference,
        }
        if self.spread_seam:
            out["spread_seam"] = True
        if self._nodes is not None:
            out["nodes"] = {"radius": self._nodes[0].tolist(), "angle": self._nodes[1].tolist()}
        else:
            out["rows"] = self._rows.tolist()
        return out

    def to_json(self) -> str:
        """Canonical JSON text (sorted keys, float64 round-trip)."""
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls: type[_C], data: Mapping[str, Any]) -> _C:
        """Inverse of :meth:`to_dict`; raises ValueError on anything malformed."""
        if not isinstance(data, Mapping) or data.get("format") != JSON_FORMAT:
            raise ValueError(f"Argument 'data' is not a {JSON_FORMAT} description: {data!r:.200}.")
        common = {
            "construction": data.get("construction", "custom"),
            "params": data.get("params", {}),
            "reference": data.get("reference", "mixed"),
        }
        if "nodes" in data:
            nodes = data["nodes"]
            code = cls.from_nodes(  # type: ignore[attr-defined]
                data["world_size"],
                nodes["radius"],
                nodes["angle"],
                spread_seam=bool(data.get("spread_seam", False)),
                **common,
            )
        else:
            code = cls(data["world_size"], np.array(data["rows"]), **common)  # type: ignore[call-arg]
        if code.components != data.get("components"):
            raise ValueError(
                f"Code description says components={data.get('components')!r} but its rows "
                f"give {code.components}."
            )
        return code

    @classmethod
    def from_json(cls: type[_C], text: str) -> _C:
        """Inverse of :meth:`to_json`."""
        try:
            data = json.loads(text)
        except (TypeError, json.JSONDecodeError) as exc:
            raise ValueError(f"Argument 'text' is not valid JSON: {exc}") from None
        return cls.from_dict(data)

    @property
    def fingerprint(self) -> str:
        """SHA-256 of :meth:`to_json`: ranks compare it to check they hold the same code."""
        if self._fingerprint is None:
            self._fingerprint = hashlib.sha256(self.to_json().encode()).hexdigest()
        return self._fingerprint

    def describe(self) -> str:
        """Every identifying field at full precision, on one line, for messages that compare codes
        across ranks: construction, ``N``, ``c``, every parameter (floats as ``repr``, the shortest
        text that round-trips, so 0.1 and 0.1000001 differ), the decoder, ``spread_seam`` and the
        first 16 hex digits of :attr:`fingerprint` (which also covers the nodes or rows)."""
        params = "".join(f", {k}={_full(v)}" for k, v in self.params.items())
        return (
            f"{self.construction}(N={self.world_size}, c={self.components}{params}) "
            f"decoder={self.reference} spread_seam={self.spread_seam} fingerprint={self.fingerprint[:16]}"
        )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CodeJson) and self.fingerprint == other.fingerprint

    def __hash__(self) -> int:
        return hash(self.fingerprint)


def _full(value: Any) -> str:
    """``repr`` of a parameter with every float (also inside lists, tuples, dicts) as a Python float."""
    if isinstance(value, (bool, np.bool_)):
        return repr(bool(value))
    if isinstance(value, (float, np.floating)):
        return repr(float(value))
    if isinstance(value, (int, np.integer)):
        return repr(int(value))
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k!r}: {_full(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        inner = ", ".join(_full(v) for v in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner}{',' if len(value) == 1 else ''})"
    return repr(value)
