"""The tournament of ``method="auto"`` over whole runs (DDP steps, or the calls of one size).
Every rank decides from the same agreed numbers by the same rule, so no plan needs agreeing;
torch-free: the caller measures the runs and passes the agreement in. ``docs/auto.md`` gives the
procedure's reasons. The phases, as :class:`Tournament` steps through them:

1. ``warmup``: one exact run (DDP rebuilds its buckets after its first step).
2. ``trial``: rounds of every remaining candidate, fewest bytes first, reversed every other
   round so a drift of the machine's pace moves all alike; the first round only warms up. After
   each, the agreed times (each the slowest rank's) cut by successive halving (:data:`CUT`).
3. ``decided``: the winner by median, CERAR only by ``margin`` over the fastest ring
   (:func:`cerar.comm.auto.candidates.rank`).
4. ``duel``: every ``recheck_every`` runs, or on :meth:`Tournament.recheck`, the winner and the
   runner-up in ABBA blocks; the runner-up takes over only by ``margin``.
"""

from __future__ import annotations

import math
import statistics
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from cerar._checks import check_float, check_int
from cerar.comm.auto.candidates import CANDIDATE_NAMES, DEFAULT_CANDIDATES, Candidate, rank
from cerar.comm.auto.pins import PinnedTable

__all__ = ["CUT", "AutoConfig", "Run", "Tournament"]

#: Successive halving's factor: a candidate whose best counted time is this many times another's
#: median is out. Far beyond the 2-10% a run's time moves here; a close contender stays to the end.
CUT = 1.25


@dataclass(frozen=True)
class AutoConfig:
    """The settings of ``method="auto"`` beside its error budget (checked when built).

    Attributes:
        trials: counted runs per candidate in the tournament, and per side in a duel (``None``:
            2 DDP steps, 10 calls of the collective, whose times scatter far more than a step's).
        margin: a CERAR method must be this fraction faster than the fastest ring to win, and a
            runner-up this fraction faster than the winner to take over in a duel.
        recheck_every: runs of the winner between duels (``None``: none on a schedule).
        pins: the table that fixes the candidates of a range of sizes
            (:class:`cerar.comm.auto.pins.PinnedTable`, its text, a path, or None).
        candidates: the candidates' names (:data:`cerar.comm.auto.candidates.CANDIDATE_NAMES`).
        max_streams: sizes the collective keeps a tournament for; the least recently used goes
            (a workload of ever-changing sizes gets the exact warm-up for each new one).
    """

    trials: int | None = None
    margin: float = 0.03
    recheck_every: int | None = 200
    pins: Any = field(default=None)
    candidates: tuple[str, ...] = DEFAULT_CANDIDATES
    max_streams: int = 64

    def __post_init__(self) -> None:
        check_int("trials", self.trials, minimum=1, optional=True)
        check_float("margin", self.margin, nonnegative=True, maximum=0.5)
        check_int("recheck_every", self.recheck_every, minimum=1, optional=True)
        check_int("max_streams", self.max_streams, minimum=1)
        names = tuple(self.candidates) if isinstance(self.candidates, (list, tuple)) else ()
        if not names or any(name not in CANDIDATE_NAMES for name in names):
            raise ValueError(f"Argument 'candidates' must list names among {CANDIDATE_NAMES}, not {self.candidates!r}.")
        object.__setattr__(self, "candidates", names)
        object.__setattr__(self, "pins", PinnedTable.load(self.pins))

    def trials_for(self, steps: bool) -> int:
        """The counted runs per candidate: ``trials``, or the default for steps or for calls."""
        return self.trials if self.trials is not None else (2 if steps else 10)


class Run(NamedTuple):
    """One run handed out by :meth:`Tournament.next`: which candidate, and where its time goes."""

    candidate: int
    round_id: int  # the round it belongs to (-1: a decided run, not timed)
    position: int


class Tournament:
    """The schedule and the decisions of one stream of runs; see the module doc.

    Before each run the caller asks :meth:`agree_due`; if it is, every rank calls
    :meth:`close_round` with the agreement (all of the round's measurements in). :meth:`next`
    names the run's candidate, :meth:`measured` takes its time (``inf``: it failed), and
    :meth:`recheck` asks for a duel. ``history`` lists what was decided, as plain values.
    """

    def __init__(
        self, candidates: Sequence[Candidate], trials: int, margin: float, recheck_every: int | None,
        allowed: Sequence[int] | None = None,
    ) -> None:  # fmt: skip
        self.candidates = list(candidates)  # exact first: the warm-up, and what a failure falls back to
        self.trials, self.margin, self.recheck_every = trials, margin, recheck_every
        # The candidates that compete (the pins may leave out some, exact included).
        self.remaining = sorted(range(len(self.candidates)) if allowed is None else set(allowed))
        self.counted: dict[int, list[float]] = {k: [] for k in range(len(self.candidates))}
        self.failures: set[int] = set()  # failed to start, or measured as failed: never a runner-up
        self.winner: int | None = None
        self.runner_up: int | None = None
        self.history: list[dict[str, Any]] = []
        self.runs = 0  # runs handed out so far
        self.phase = "warmup"  # then "trial", "decided", "duel"
        self._round: list[int] = [0]  # the warm-up: exact
        self._round_id = 0
        self._trial = -1  # the trial round's number (0: the uncounted one)
        self._next = 0  # the next run's position in the round
        self._times: list[float] = [math.inf]  # this round's local measurements
        self._since_duel = 0
        self._lock = threading.Lock()  # measurements may arrive on another thread

    def agree_due(self) -> bool:
        """Whether the round's runs are all handed out: the next run waits for its agreement."""
        return self.phase != "decided" and self._next >= len(self._round)

    def next(self) -> Run:
        """The next run (:meth:`close_round` first, where :meth:`agree_due`)."""
        if self.agree_due():
            raise RuntimeError("cerar auto: the round's agreement is due before its next run")
        self.runs += 1
        if self.phase == "decided":
            assert self.winner is not None
            self._since_duel += 1
            if self.recheck_every is not None and self._since_duel >= self.recheck_every:
                self.recheck()  # from the next run on
            return Run(self.winner, -1, 0)
        self._next += 1
        candidate = self._round[self._next - 1]
        # A candidate that failed since its round was drawn up is replaced by exact (already out).
        return Run(0 if candidate in self.failures else candidate, self._round_id, self._next - 1)

    def measured(self, run: Run, seconds: float) -> None:
        """This rank's time of ``run`` (ignored unless it belongs to the current round)."""
        with self._lock:
            if run.round_id == self._round_id:
                self._times[run.position] = seconds

    def failed(self, candidate: int) -> None:
        """``candidate``'s run failed to start, the same on every rank: it is out at once."""
        with self._lock:
            if candidate == 0 or candidate not in self.remaining:
                return  # exact is what failures fall back to
            self.remaining = [k for k in self.remaining if k != candidate] or [0]
            self.failures.add(candidate)
            self.history.append({"run": self.runs, "event": "failed", "candidate": self.label(candidate)})
            if candidate in (self.winner, self.runner_up):
                self._crown("failed")

    def recheck(self) -> None:
        """Duel the winner and the runner-up from the next run on (DDP rebuilt its buckets, or
        ``recheck_every`` runs have passed)."""
        if self.phase != "decided" or self.runner_up is None:
            return
        a, b = self.winner, self.runner_up
        self._start([x for _ in range(math.ceil(self.trials / 2)) for x in (a, b, b, a)], "duel")

    def close_round(self, agree: Callable[[Sequence[float]], list[float]]) -> None:
        """Agree the round's times (each the slowest rank's) and act on them: halve, decide, or
        judge the duel. Every rank calls it at the same run, with its own measurements."""
        if not self.agree_due():
            return
        with self._lock:
            agreed = agree(list(self._times))
        if self.phase == "warmup":
            self._start(self._trial_order(0), "trial")
        elif self.phase == "trial":
            self._after_trial(agreed)
        else:
            self._after_duel(agreed)

    def _after_trial(self, agreed: list[float]) -> None:
        times = list(zip(self._round, agreed, strict=True))
        out = {k for k, t in times if not math.isfinite(t)}
        self.failures |= out - {0}
        if self._trial > 0:  # counted
            for k, t in times:
                self.counted[k].append(t)
            medians = [statistics.median(self.counted[k]) for k in self.remaining if self.counted[k]]
            fastest = min(medians, default=math.inf)
            out |= {k for k in self.remaining if self.counted[k] and min(self.counted[k]) > CUT * fastest}
        out.discard(0)  # exact stays where it competes: the reference
        self.remaining = [k for k in self.remaining if k not in out] or [0]
        self.history.append({
            "run": self.runs, "event": "round", "round": self._trial, "counted": self._trial > 0,
            "times": {self.label(k): t for k, t in times}, "out": [self.label(k) for k in sorted(out)],
        })  # fmt: skip
        if self._trial >= self.trials or len(self.remaining) == 1:
            self._crown("decision")
        else:
            self._start(self._trial_order(self._trial + 1), "trial")

    def _after_duel(self, agreed: list[float]) -> None:
        a, b = self.winner, self.runner_up
        times = list(zip(self._round, agreed, strict=True))
        med_a, med_b = (statistics.median(t for k, t in times if k == side) for side in (a, b))
        handed = med_b < (1 - self.margin) * med_a  # the runner-up takes over only on a margin win
        self.history.append({
            "run": self.runs, "event": "duel", "winner": self.label(a), "challenger": self.label(b),
            "winner_s": med_a, "challenger_s": med_b, "handed_over": handed,
        })  # fmt: skip
        if handed:  # a challenger the halving had cut competes again
            self.winner, self.runner_up = b, a
            self.remaining = sorted({*self.remaining, b})
        self._start([], "decided")

    def _ranking(self, among: Sequence[int]) -> list[int]:
        """``among`` by median, CERAR behind the fastest ring unless the margin faster
        (:func:`cerar.comm.auto.candidates.rank`); unmeasured ones last."""
        medians = [statistics.median(times) if times else math.inf for times in self.counted.values()]
        return rank(self.candidates, medians, among, self.margin)

    def _crown(self, event: str) -> None:
        """The winner among the remaining; the runner-up, its duel's challenger, the next best of
        every candidate that ran and did not fail (one cut by the halving included: conditions
        change, and a recheck is what would show it)."""
        self.winner = self._ranking(self.remaining)[0]
        ran = [k for k, times in self.counted.items() if k not in self.failures and any(map(math.isfinite, times))]
        others = [k for k in self._ranking(sorted({*ran, *self.remaining})) if k != self.winner]
        self.runner_up = others[0] if others else None
        self.history.append({
            "run": self.runs, "event": event, "winner": self.label(self.winner),
            "runner_up": None if self.runner_up is None else self.label(self.runner_up),
            "medians": {self.label(k): statistics.median(v) for k, v in self.counted.items() if v},
        })  # fmt: skip
        self._start([], "decided")

    def _trial_order(self, trial: int) -> list[int]:
        """Trial round ``trial``'s order: fewest bytes first (a slow candidate runs last, where it
        can be cut), reversed every other round."""
        order = sorted(self.remaining, key=lambda k: (self.candidates[k].bytes_per_value, k))
        return order if trial % 2 == 0 else order[::-1]

    def _start(self, runs: list[int], phase: str) -> None:
        if phase == "trial":
            self._trial += 1
        if phase == "decided":
            self._since_duel = 0
        self.phase, self._round, self._next = phase, runs, 0
        self._times = [math.inf] * len(runs)  # a run never measured (it failed) counts as failed
        self._round_id += 1

    def label(self, k: int) -> str:
        return self.candidates[k].label

    def describe(self) -> dict[str, Any]:
        """The stream's state as plain values."""
        return {
            "phase": self.phase,
            "winner": None if self.winner is None else self.label(self.winner),
            "runner_up": None if self.runner_up is None else self.label(self.runner_up),
            "remaining": [self.label(k) for k in self.remaining],
            "runs": self.runs,
        }
