"""The pinned table of ``method="auto"``: the user's choice for a range of bucket sizes, as
NCCL's tuner file pins an algorithm for a range of message sizes (``docs/auto.md`` has examples).

One row per line: ``min_bytes, max_bytes, algorithm, wire, c`` (``-``: any; ``#`` starts a
comment): ``[min_bytes, max_bytes)`` in bytes of the buffer (``64K``, ``1M``: powers of 1024),
``algorithm`` one of :data:`ALGORITHMS` and ``wire`` of :data:`WIRES`. A row fixes the knobs it
names, the decision the rest; the first row whose range holds a size applies, and a size none
holds is decided freely. A row that matches no candidate within the budget raises ValueError
naming it once the candidates are known.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cerar._checks import check_choice, format_size, parse_size
from cerar.comm.auto.candidates import Candidate

__all__ = ["PinnedRow", "PinnedTable"]

ALGORITHMS = ("ring", "cerar")
WIRES = ("fp32", "fp16", "bf16", "int8", "fp8")


@dataclass(frozen=True)
class PinnedRow:
    """``[min_bytes, max_bytes)`` (``max_bytes=None``: no upper end) and the knobs it fixes
    (``None``: left to the decision)."""

    min_bytes: int
    max_bytes: int | None
    algorithm: str | None = None
    wire: str | None = None
    components: int | None = None

    def holds(self, nbytes: int) -> bool:
        return self.min_bytes <= nbytes and (self.max_bytes is None or nbytes < self.max_bytes)

    def matches(self, candidate: Candidate) -> bool:
        return (
            (self.algorithm is None or self.algorithm == ("cerar" if candidate.route.coded else "ring"))
            and (self.wire is None or candidate.wire == self.wire)
            and (self.components is None or candidate.components == self.components)
        )

    def __str__(self) -> str:
        upper = "-" if self.max_bytes is None else format_size(self.max_bytes)
        knobs = [self.algorithm or "-", self.wire or "-", "-" if self.components is None else str(self.components)]
        return ",".join([format_size(self.min_bytes), upper, *knobs])


@dataclass(frozen=True)
class PinnedTable:
    """The rows, in order; :meth:`parse` reads the text form (see the module doc)."""

    rows: tuple[PinnedRow, ...] = ()

    @classmethod
    def parse(cls, text: str) -> PinnedTable:
        """The table in ``text``; a bad line raises ValueError naming its number and content."""
        rows = []
        for number, raw in enumerate(text.splitlines(), start=1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            try:
                rows.append(_row(line))
            except (TypeError, ValueError) as exc:
                raise ValueError(f"Argument 'pins' line {number} ({raw.strip()!r}): {exc}") from None
        return cls(tuple(rows))

    @classmethod
    def load(cls, source: str | Path | PinnedTable | None) -> PinnedTable:
        """A table from itself, a path to a file, the text itself (a string holding a comma or
        a newline), or ``None`` (no rows)."""
        if source is None:
            return cls()
        if isinstance(source, PinnedTable):
            return source
        if isinstance(source, Path) or (isinstance(source, str) and "," not in source and "\n" not in source):
            path = Path(source)
            if not path.is_file():
                raise ValueError(f"Argument 'pins' must be a table or a file holding one, not {str(source)!r}.")
            return cls.parse(path.read_text())
        if isinstance(source, str):
            return cls.parse(source)
        raise TypeError(f"Argument 'pins' must be a PinnedTable, a path, the table's text or None, not {source!r}.")

    def text(self) -> str | None:
        """The table as :meth:`parse` reads it (None for no rows)."""
        return "\n".join(str(row) for row in self.rows) or None

    def allowed(self, candidates: Sequence[Candidate], nbytes: int) -> tuple[list[int], bool]:
        """``(indices, pinned)``: the candidates a bucket of ``nbytes`` may take, and whether a
        row (the first whose range holds ``nbytes``) restricted them."""
        row = next((row for row in self.rows if row.holds(nbytes)), None)
        if row is None:
            return list(range(len(candidates))), False
        return _matching(row, candidates), True

    def check(self, candidates: Sequence[Candidate]) -> None:
        """Raise ValueError for a row that matches none of ``candidates``."""
        for row in self.rows:
            _matching(row, candidates)


def _matching(row: PinnedRow, candidates: Sequence[Candidate]) -> list[int]:
    matching = [i for i, c in enumerate(candidates) if row.matches(c)]
    if not matching:
        names = ", ".join(c.label for c in candidates)
        raise ValueError(
            f"Argument 'pins' row {str(row)!r} matches no candidate within the error budget (candidates: {names})."
        )
    return matching


def _row(line: str) -> PinnedRow:
    fields = [f.strip() for f in line.split(",")]
    if len(fields) != 5:
        raise ValueError(f"expected 5 fields (min_bytes, max_bytes, algorithm, wire, c), not {len(fields)}")
    low, high, algorithm, wire, components = (None if f == "-" else f for f in fields)
    minimum = 0 if low is None else parse_size(low, "pinned")
    maximum = None if high is None else parse_size(high, "pinned")
    if maximum is not None and maximum <= minimum:
        raise ValueError(f"max_bytes {high} must exceed min_bytes {low}")
    if algorithm is not None:
        check_choice("algorithm", algorithm, ALGORITHMS)
    if wire is not None:
        check_choice("wire", wire, WIRES)
    if components is not None and (not components.isdigit() or int(components) < 1):
        raise ValueError(f"c must be a positive integer or -, not {components!r}")
    return PinnedRow(minimum, maximum, algorithm, wire, None if components is None else int(components))
