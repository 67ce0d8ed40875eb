"""The calibration schedule of ``method="auto"`` and its decisions, the same on every rank.

An :class:`AutoEngine` drives one stream of steps (DDP backward passes; for the collective, the
calls of one size) whose slots (DDP's buckets; the collective's one tensor) keep their sizes.
Its schedule depends on the step count and on agreed numbers alone, which every rank shares:

1. ``warmup`` steps: every slot exact (DDP rebuilds its buckets after the first);
2. ``trials`` steps per candidate, taken in turns: ``trials`` rounds of one step per
   candidate, the first round in the order of the bytes they send (fewest first: the slow ones
   come last, where they can be cut), the next one reversed, and so on alternately, so that a
   steady drift of the machine (steps that get faster as a run settles, load that comes and
   goes) moves every candidate's counted steps alike instead of favouring whichever was tried
   last. Every slot of a step by that step's candidate, so that whole steps compare (CERAR's
   coding competes with backward for the cores). A candidate's first step (the first round)
   warms it up and is not counted. A step is timed from the end of the step before to the
   end of its last slot (:meth:`AutoEngine.end_step`). After every trial step the ranks agree
   its time (the slowest rank's); a candidate whose step took more than ``prune_tol`` longer
   than the fastest other candidate's so far (the median of its counted steps; in the first
   round, its warm-up step) is cut there (``"prune"``: its remaining trial steps are not run,
   and it is no choice of this calibration unless it is a baseline), so that a hopeless
   method (exact on a slow link, float32 CERAR beside 16-bit CERAR) costs one or two steps,
   not ``trials``. Exact, which the
   warm-up ran, is cut at its turn without a step when the warm-up's exact calls (their
   service times summed, the least over the ranks) plus the least time any step spent before
   its first slot (the lead: together a lower bound on any step by exact) took ``prune_tol``
   longer than the fastest warm-up step before it (at a later turn, the fastest median of
   another's counted steps), and so is a CERAR candidate (fewer bytes in no fewer rounds, the
   same wire) when those calls scaled by its bytes, plus the lead, did (float32 CERAR on a
   slow link); at every turn a candidate's own counted steps so far are judged again against
   the others' (one first in a reversed round had none to be judged against). After the first
   round a candidate is judged by the fastest of its counted steps (or calls), from the second
   one on (:data:`COUNTED_BEFORE_CUT`): a call's time is far noisier than a step's, and a
   candidate's first counted step can still carry warm-up costs when other transports' steps
   ran between its first two;
3. the decision, at the first slot of the next step: the ranks agree their measurements by an
   elementwise maximum (the slowest rank's) on a side group, fit the cost model
   (:mod:`cerar.comm.auto.model`) and decide every slot from the same numbers; the plan is
   then agreed as the elementwise smallest candidate index, so that no platform's rounding
   can split the ranks;
4. windows of ``verify_every`` steps by the plan, each agreed at its end: for calls, a slot
   by CERAR measured slower than predicted (by ``verify_tol``) or than its baseline's trial
   calls duels its baseline over the next two windows, halves alternating as in the steps'
   duels below, and goes to it (``"verify"``) unless CERAR's calls were ``margin`` faster
   (then, ``"step"``: not verified again). With steps (DDP) the window's median step is what is judged,
   the measure the trials decided by: a window ``verify_tol`` slower than the plan's estimate
   from its trial steps sends every slot by CERAR to its baseline. A call's time in a
   backward pass does not show what the call costs the step: the first bucket's call waits
   for the ranks to reach it and shares the cores with the rest of backward (time the step
   spends anyway), its coding takes from backward what no call time shows, and the calls of
   two transports overlap. A verification's change runs the next window and stays only if that
   window is ``margin`` faster than the one before (its median step), since what it went by
   was timed earlier (the plan's trial steps); otherwise the slots it changed come back as
   ``"step"``, not verified again.
   If the plan has CERAR in it and its estimate from its methods' trial steps is not
   ``margin`` below the fastest exact or 16-bit ring's trial steps, that ring challenges it
   (CERAR must beat the rings by the margin in steps, the measure that judges; a call's time
   misses what the coding takes from backward); otherwise, if one method's trial steps were
   faster than the plan's methods' by ``margin``, or the plan mixes methods (a plan no trial
   step ran whole), that fastest single method does, and a plan of one ring is challenged by
   the fastest other ring whose trial steps came within ``margin`` of its own (a near tie, which
   two counted steps each do not settle). A plan with CERAR whose estimate from its methods'
   fastest counted trial steps is ``duel_tol`` slower than the challenging ring's median goes
   to the ring at once, without a duel. The plan and the challenger
   (everywhere, ``"step"``) duel over the next two windows, their halves alternating (plan,
   challenger | challenger, plan), and the one whose steps have the smaller median is kept, CERAR
   against a ring only by the margin (two trial
   steps are too noisy to decide alone, eight steps of each are not; alternating, a drift of
   the machine's pace moves both alike, where a window of each in turn would judge the later
   window's pace against the earlier's); a mixed
   plan whose estimate (its methods' trial steps weighted by the bytes each runs) is
   ``margin`` slower than the challenger's trial steps becomes the challenger at once, without a
   window. When the plan is one method and the trials leave no doubt (every counted step of
   the other method faster than every one of the plan's by ``margin``, the gap at least twice
   either's spread), the order turns: the other method runs the first window and stays if its
   median step beats the plan's trial steps, so that a clearly slower plan costs no window.
   Otherwise, after the first window that ran the plan unchanged, a plan whose median step is
   slower than the fastest single method's trial steps (by ``step_tol``) becomes that method
   (``"step"``);
5. a new calibration after ``redecide_every`` steps of the plan, or at the step after a slot's
   size changed (DDP rebuilt its buckets), with the previous plan as the hysteresis reference.

The side group is a Gloo group over the caller's ranks, created once by the caller (every rank
at the same point): nothing is added on the caller's own group. A measurement missing on a rank
travels as -1 (another rank's wins the maximum), a failed call as inf (the candidate is out).
"""

from __future__ import annotations

import math
import statistics
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist

from cerar._checks import check_float, check_int
from cerar.comm.auto.candidates import CANDIDATE_NAMES, DEFAULT_CANDIDATES, Candidate
from cerar.comm.auto.model import Choice, CostModel, decide_slot, fit_cost_model
from cerar.comm.auto.pins import PinnedTable

__all__ = ["AutoConfig", "AutoEngine", "SideGroup", "new_side_group"]

MISSING = -1.0
#: Counted trial steps (or the collective's calls) before a cut by them: a candidate is cut when
#: the fastest of them is ``prune_tol`` slower, so that one slow step or call never cuts a close
#: competitor (a first counted step may still carry warm-up costs: a first-round step warms a
#: method up, but the steps of another transport between its first two can undo part of that).
COUNTED_BEFORE_CUT = 2


@dataclass(frozen=True)
class AutoConfig:
    """The knobs of ``method="auto"`` (checked when built; steps are DDP backward passes, or for
    the collective calls of one size).

    Attributes:
        warmup: exact steps before the trials (at least 1 in DDP is wise: buckets are rebuilt
            after the first pass).
        trials: steps per candidate (the first of each is not counted; at least 2).
        prune_tol: a trial step this fraction slower than the fastest earlier candidate's median
            step cuts the candidate's trial short (``None``: every candidate runs ``trials``).
        margin: CERAR must be predicted this fraction faster than the best exact/16-bit ring.
        hysteresis: at a re-decision, a slot changes method only for this fraction of gain.
        verify_tol: a CERAR slot measured this fraction slower than predicted goes back (steps:
            a window whose median step is this fraction slower than the plan's trial estimate).
        step_tol: the plan's steps (and a CERAR slot against its baseline) may be this much slower.
        duel_tol: a plan with CERAR whose estimate from the trial steps is this fraction slower
            than its challenging ring's trial steps goes to the ring at the decision, without a
            duel (``None``: every such plan duels).
        verify_every: steps per verification window.
        redecide_every: steps of a plan before the next calibration (``None``: never on a schedule).
        candidates: the candidates' names (:data:`cerar.comm.auto.candidates.CANDIDATE_NAMES`).
        pinned: a :class:`cerar.comm.auto.pins.PinnedTable`, its text, a path, or None.
    """

    warmup: int = 1
    trials: int = 3
    prune_tol: float | None = 0.25
    margin: float = 0.03
    hysteresis: float = 0.05
    verify_tol: float = 0.25
    step_tol: float = 0.03
    duel_tol: float | None = 0.10
    verify_every: int = 10
    redecide_every: int | None = 1000
    candidates: tuple[str, ...] = DEFAULT_CANDIDATES
    pinned: Any = field(default=None)

    def __post_init__(self) -> None:
        check_int("warmup", self.warmup, minimum=0)
        check_int("trials", self.trials, minimum=2)
        check_float("prune_tol", self.prune_tol, nonnegative=True, optional=True)
        for name in ("margin", "hysteresis", "verify_tol", "step_tol"):
            check_float(name, getattr(self, name), nonnegative=True, maximum=1.0)
        check_float("duel_tol", self.duel_tol, nonnegative=True, optional=True)
        check_int("verify_every", self.verify_every, minimum=1)
        check_int("redecide_every", self.redecide_every, minimum=1, optional=True)
        names = tuple(self.candidates) if isinstance(self.candidates, (list, tuple)) else ()
        if not names or any(name not in CANDIDATE_NAMES for name in names):
            raise ValueError(f"Argument 'candidates' must list names among {CANDIDATE_NAMES}, not {self.candidates!r}.")
        object.__setattr__(self, "candidates", names)
        object.__setattr__(self, "pinned", PinnedTable.load(self.pinned))

    def calibration_steps(self, candidates: int) -> int:
        """Steps from a calibration's start to its decision, warm-up plus the trials, when no
        candidate is cut (the most a calibration takes)."""
        return self.warmup + candidates * self.trials


class SideGroup:
    """The agreement: elementwise max (floats) and min (integers) over the side group's ranks."""

    __slots__ = ("group",)

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group

    def max(self, values: Sequence[float]) -> list[float]:
        return self._reduce(torch.tensor(list(values), dtype=torch.float64), dist.ReduceOp.MAX)

    def min(self, values: Sequence[int]) -> list[int]:
        return [int(v) for v in self._reduce(torch.tensor(list(values), dtype=torch.int64), dist.ReduceOp.MIN)]

    def _reduce(self, tensor: torch.Tensor, op: Any) -> list[Any]:
        if tensor.numel():
            dist.all_reduce(tensor, op=op, group=self.group)
        return tensor.tolist()


def new_side_group(process_group: dist.ProcessGroup | None) -> SideGroup:
    """A Gloo group over ``process_group``'s ranks for the agreements (every member must call it
    at the same point)."""
    from cerar.comm.ring.exact import new_group_like

    return SideGroup(new_group_like(process_group, backend="gloo"))


class AutoEngine:
    """The schedule and the decisions of one stream of steps (see the module doc).

    Call :meth:`begin_step` before a step's first slot, :meth:`choose` for each slot (before it
    runs), :meth:`measured` when it is done and, for steps, :meth:`end_step` when its last slot
    is done (any thread). ``plan`` maps slots to the current :class:`Choice`; ``history`` lists
    the decisions as plain values (``cerar train``'s JSON).
    """

    __slots__ = (
        "_agreed_costs", "_contest", "_costs", "_cut", "_duel", "_ended", "_lead", "_lead_local", "_lock", "_order",
        "_previous", "_schedule", "_slot_times", "_stale", "_steps_checked", "_trial", "_trial_steps", "_uniform",
        "_warm_bound", "_warm_calls", "_window", "_window_steps", "agreement", "candidates", "config", "history",
        "layout", "model", "plan", "start", "steps",
    )  # fmt: skip

    def __init__(
        self, candidates: Sequence[Candidate], config: AutoConfig, agreement: SideGroup, *, steps: bool = True
    ) -> None:
        if not candidates or candidates[0].name != "exact":
            raise ValueError("Argument 'candidates' must start with the exact candidate.")
        config.pinned.check(candidates)
        self.candidates, self.config, self.agreement, self.steps = list(candidates), config, agreement, steps
        self.start: int | None = None
        self.layout: dict[int, tuple[int, int]] = {}  # slot -> (numel, bytes), fixed by the first trial step
        self.plan: dict[int, Choice] = {}
        self.model: CostModel | None = None
        self.history: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._previous: dict[int, tuple[int, int]] = {}  # slot -> (numel, candidate) for hysteresis
        self._stale = False
        self._steps_checked = False
        self._ended: tuple[int, float] | None = None  # the last step ended and when
        self._trial: dict[tuple[int, int, int], float] = {}  # (candidate, trial, slot) -> seconds
        self._window: dict[tuple[int, int, int], float] = {}  # (window, step, slot) -> seconds
        self._window_steps: dict[tuple[int, int], float] = {}
        self._slot_times: dict[tuple[int, int], float] = {}  # agreed trial medians (candidate, slot)
        # The first round's order (fewest bytes first), the trial steps as (candidate, round)
        # (a cut candidate's later ones removed), the candidates cut, and each trial step's cost
        # (the step's time; for calls, the slots' sum), local and agreed.
        self._order = sorted(range(len(self.candidates)), key=lambda k: (self.candidates[k].bytes_per_value, k))
        self._schedule = self._full_schedule()
        self._cut: set[int] = set()
        self._costs: dict[tuple[int, int], float] = {}
        self._agreed_costs: dict[tuple[int, int], float] = {}
        self._trial_steps: list[list[float]] = []  # agreed counted trial steps per candidate
        # Exact's calls in the last warm-up step, summed (local), and their agreed least over the
        # ranks: a lower bound on any step by exact (steps only).
        self._warm_calls = 0.0
        self._warm_bound: float | None = None
        # The time from a step's end to this step's first slot (the optimizer, the forward
        # pass, backward up to its first bucket: no communication runs then), local; agreed
        # per trial step as the slowest rank's (no rank's calls of a step finish before every
        # rank has joined them), and the least of those: what any step spends beside its calls.
        self._lead_local = math.inf
        self._lead: float | None = None
        self._uniform: list[float] = []  # their medians
        # The window contest of a changed plan against the plan it replaced: a clearly faster
        # challenger's (the challenger, (the plan, its trial steps' median)); a verification's
        # change in steps, with no challenger: (None, (the plan before it, its window's median)).
        self._contest: tuple[int | None, tuple[dict[int, Choice], float]] | None = None
        # A duel of the plan against its challenger (steps: the fastest ring, or the method of
        # the fastest trial steps, :meth:`_decide`; calls: the baseline of a slot the
        # verification found slow) in two windows, their halves alternating
        # (:meth:`_duel_choice`): the challenger's plan, the first window's agreed steps (for
        # calls, the calls' times) once it ended, and the duel's first window.
        self._duel: tuple[dict[int, Choice], list[float] | None, int] | None = None

    # ---------------------------------------------------------------------------------------
    def phase(self, step: int) -> tuple[str, int, int]:
        """``("warmup", 0, i)``, ``("trial", candidate, i)``, ``("run", window, i)`` or
        ``("old", -1, -1)`` (before the current calibration)."""
        offset = step - (self.start if self.start is not None else step)
        if offset < 0:
            return ("old", -1, -1)
        if offset < self.config.warmup:
            return ("warmup", 0, offset)
        offset -= self.config.warmup
        if offset < len(self._schedule):  # a step not yet run counts every uncut candidate in full
            k, i = self._schedule[offset]
            return ("trial", k, i)
        w, i = divmod(offset - len(self._schedule), self.config.verify_every)
        return ("run", w, i)

    def _full_schedule(self) -> list[tuple[int, int]]:
        """Every trial step as ``(candidate, round)``: ``trials`` rounds of every candidate,
        every other one in reverse order (the first in :attr:`_order`)."""
        backward = self._order[::-1]
        return [(k, i) for i in range(self.config.trials) for k in (backward if i % 2 else self._order)]

    @property
    def pruned(self) -> set[int]:
        """The candidates whose trial this calibration cut short."""
        return set(self._cut)

    def agreement_due(self, step: int) -> bool:
        """Whether :meth:`begin_step` of ``step`` may agree with the other ranks (a decision or a
        verification): a caller with calls in flight lets them finish first."""
        kind, _, offset = self.phase(step)
        return (kind == "run" and offset == 0) or self._prune_due(step)

    def _prune_due(self, step: int) -> bool:
        return self.config.prune_tol is not None and self.start is not None and self.phase(step - 1)[0] == "trial"

    def begin_step(self, step: int, now: float | None = None) -> None:
        """Step ``step``'s first slot is due (at ``now``, ``time.perf_counter()``, for steps):
        at the schedule's points the ranks agree and decide (a collective on the side group:
        every rank calls this at the same step)."""
        if self.start is None:
            self._restart(step, "first")
        elif self._stale:
            self._restart(step, "size")
        with self._lock:
            ended, self._lead_local = self._ended, math.inf
            if self.steps and now is not None and ended is not None and ended[0] == step - 1:
                self._lead_local = now - ended[1]
        if self._prune_due(step):
            self._prune(step)
        self._cut_before_turn(step)
        kind, index, offset = self.phase(step)
        every = self.config.redecide_every
        if kind == "run" and every is not None and index * self.config.verify_every + offset >= every:
            self._restart(step, "schedule")
            kind, index, offset = self.phase(step)
        if kind == "run" and offset == 0:
            self._decide(step) if index == 0 else self._verify(step, index - 1)

    def end_step(self, step: int, now: float) -> None:
        """Step ``step``'s last slot is done (at ``now``, ``time.perf_counter()``): its time is
        noted, from the end of the step before (steps only; calls are timed by measured()).

        A step is timed between the ends of its communication, not between the first slots of
        two passes: the last collective of a step ends at about the same moment on every rank,
        while the moment a backward pass hands over its first bucket scatters from rank to rank
        and step to step (the ranks' threads share the cores): timed from first slot to first
        slot, each rank's steps scattered widely around the common pace, and their maximum over
        the ranks, what the ranks agree, stood above every rank's true step."""
        with self._lock:
            if self.steps and self._ended is not None and self._ended[0] == step - 1:
                self._note_step(step, now - self._ended[1])
            self._ended = (step, now)

    def choose(self, step: int, slot: int, numel: int, nbytes: int) -> Choice:
        """The method of ``slot`` (``numel`` values, ``nbytes`` bytes) at ``step``."""
        kind, index, offset = self.phase(step)
        if kind in ("warmup", "old"):
            return Choice(0, "warmup")
        if kind == "trial" and (index, offset) == (self._order[0], 0):
            self.layout[slot] = (numel, nbytes)
        if self.layout.get(slot) != (numel, nbytes) or (kind == "run" and slot not in self.plan):
            self._stale = True
            return Choice(0, "size")
        if kind == "run":
            return self._duel_choice(index, offset, slot) or self.plan[slot]
        allowed, _ = self.config.pinned.allowed(self.candidates, nbytes)
        return Choice(index, "trial") if index in allowed else Choice(allowed[0], "pinned")

    def measured(self, step: int, slot: int, candidate: int, seconds: float) -> None:
        """``slot`` of ``step`` took ``seconds`` by ``candidate`` (``inf``: its call failed)."""
        kind, index, offset = self.phase(step)
        with self._lock:
            if kind == "warmup" and self.steps and offset == self.config.warmup - 1 and candidate == 0:
                self._warm_calls += seconds
            if kind == "trial" and candidate == index and not self.steps:
                self._costs[(index, offset)] = self._costs.get((index, offset), 0.0) + seconds
            if kind == "trial" and offset >= 1 and candidate == index:
                self._trial[(index, offset - 1, slot)] = seconds
            elif kind == "run" and slot in self.plan and candidate in self._running(slot):
                self._window[(index, offset, slot)] = seconds

    def _running(self, slot: int) -> tuple[int, ...]:
        """The candidates ``slot`` runs in this window: the plan's, and a duel's challenger."""
        plan = self.plan[slot].candidate
        return (plan,) if self._duel is None else (plan, self._duel[0][slot].candidate)

    # ---------------------------------------------------------------------------------------
    def _note_step(self, step: int, seconds: float) -> None:
        kind, index, offset = self.phase(step)
        if kind == "trial":
            self._costs[(index, offset)] = seconds
        elif kind == "run":
            self._window_steps[(index, offset)] = seconds

    def _restart(self, step: int, reason: str) -> None:
        with self._lock:
            self._previous = {s: (self.layout[s][0], c.candidate) for s, c in self.plan.items() if s in self.layout}
            self.start, self.layout, self._stale, self._contest, self._duel = step, {}, False, None, None
            self._warm_calls, self._warm_bound, self._lead_local, self._lead = 0.0, None, math.inf, None
            self._schedule, self._cut = self._full_schedule(), set()
            for table in (self._trial, self._window, self._window_steps, self._costs, self._agreed_costs):
                table.clear()
        self.history.append({"step": step, "event": "calibrate", "reason": reason})

    def _prune(self, step: int) -> None:
        """The trial step before ``step`` is over: agree its cost (the slowest rank's) and cut
        its candidate's trial if it was ``prune_tol`` slower than the fastest other candidate's
        so far (:meth:`_reference`). Every rank decides from the same agreed numbers."""
        _, k, i = self.phase(step - 1)
        with self._lock:
            local = self._costs.get((k, i), MISSING)
            warm, lead = self._warm_calls, self._lead_local
        # The warm-up's bound travels along (negated: the least over the ranks, whose waits for
        # the slowest rank to join a call are the shortest; none or a failed call: -inf), and
        # this step's lead (the slowest rank's; none: -1).
        cost, least, lead = self.agreement.max(
            [local, -warm if 0.0 < warm < math.inf else -math.inf, lead if math.isfinite(lead) else MISSING]
        )
        self._agreed_costs[(k, i)] = cost
        self._warm_bound = -least if math.isfinite(least) else None
        if lead >= 0.0:
            self._lead = lead if self._lead is None else min(self._lead, lead)
        if i >= 1 or not self.steps:  # counted: one is too noisy; the fastest of them so far
            cost = _fastest([self._agreed_costs.get((k, n), MISSING) for n in range(1, i + 1)])
        if i == self.config.trials - 1 or cost < 0.0:
            return  # its trial ends anyway, or nothing (enough) was measured
        reference = self._reference(k, i)
        assert self.config.prune_tol is not None
        if reference is not None and cost > (1.0 + self.config.prune_tol) * reference:
            self._cut.add(k)
            self._schedule = [(j, n) for j, n in self._schedule if j != k or n <= i]
            self.history.append(
                {"step": step - 1, "event": "prune", "candidate": self.candidates[k].label,
                 "trial_step": i, "step_s": _finite(cost), "best_s": reference}
            )  # fmt: skip

    def _cut_before_turn(self, step: int) -> None:
        """A candidate at its turn: cut without that step (and its later ones) if what is
        known of it already took ``prune_tol`` longer than the fastest other candidate's steps
        so far (:meth:`_reference`: in the first round, the warm-up steps before it):

        * the fastest of its own counted steps so far (from the second,
          :data:`COUNTED_BEFORE_CUT`), judged again now that others' counted steps exist (a
          candidate first in a reversed round had none to be judged against);
        * the warm-up step's exact calls, scaled by the bytes it sends against exact's, plus
          the lead. A step holds all its calls after its first slot is due on every rank, so
          the time from a step's end to the next one's first slot (the optimizer, the forward
          pass and backward up to its first bucket, with no communication running; the slowest
          rank's, the least over the trial steps so far) plus the calls' summed service time
          (each transport's overlap split among its calls) bounds any step by exact from below;
          a method that sends fewer bytes of the same precision in no fewer rounds (float32
          CERAR) costs at least that share of the calls, each call's fixed cost at least
          exact's and each byte on the same link. Exact's own step is no better measure at its
          first turn, as the first step carries DDP's bucket rebuild and every first-time cost;
          the calls alone, without the lead, fall short of a step that is as much compute as
          communication.

        Steps only (a call is judged by its counted calls); every rank judges the same agreed
        numbers."""
        while self.steps and self.config.prune_tol is not None:  # a cut leaves the step to the next
            kind, k, i = self.phase(step)
            reference = self._reference(k, i) if kind == "trial" else None
            if reference is None:
                return
            fastest = _fastest([self._agreed_costs.get((k, n), MISSING) for n in range(1, i)])
            own = None if fastest < 0.0 else fastest
            exact, method = self.candidates[0], self.candidates[k]
            bound = None
            if self._warm_bound is not None and method.rounds >= exact.rounds and method.wire == exact.wire:
                # (Fewer rounds: its fixed cost may be below exact's, no bound. The 16-bit
                # methods, which a slow link favours, are never cut by it: scaled down to their
                # bytes from calls that may carry first-time costs, it could cut the fastest.)
                bound = self._warm_bound * method.bytes_per_value / exact.bytes_per_value + (self._lead or 0.0)
            known = [t for t in (own, bound) if t is not None]
            if not known or max(known) <= (1.0 + self.config.prune_tol) * reference:
                return
            self._cut.add(k)
            self._schedule = [(j, n) for j, n in self._schedule if j != k or n < i]
            self.history.append(
                {"step": step, "event": "prune", "candidate": method.label, "trial_step": i, "step_s": None,
                 "own_s": own, "warmup_calls_s": self._warm_bound, "lead_s": self._lead, "bound_s": bound,
                 "best_s": reference}
            )  # fmt: skip

    def _reference(self, k: int, i: int) -> float | None:
        """What candidate ``k``'s trial step ``i`` is judged against: the fastest median of
        another uncut candidate's counted steps so far; in the first round, where no step is
        counted yet, the fastest warm-up step of the candidates before ``k`` (steps only: a
        call's is judged from its counted ones). None: nothing to compare with."""
        others = [j for j in self._order if j != k and j not in self._cut]
        medians = [
            _median([self._agreed_costs.get((j, n), MISSING) for n in range(1, self.config.trials)], None)
            for j in others
        ]
        known = [m for m in medians if m is not None and math.isfinite(m)]
        if not known and i == 0 and self.steps:
            warm = [self._agreed_costs.get((j, 0), MISSING) for j in others]
            known = [c for c in warm if c >= 0.0 and math.isfinite(c)]
        return min(known) if known else None

    def _decide(self, step: int) -> None:
        slots, counted = sorted(self.layout), self.config.trials - 1
        keys = [(k, j, s) for k in range(len(self.candidates)) for j in range(counted) for s in slots]
        step_keys = [(k, j) for k in range(len(self.candidates)) for j in range(counted)] if self.steps else []
        with self._lock:
            local = [self._trial.get(key, MISSING) for key in keys]
            local += [self._costs.get((k, j + 1), MISSING) for k, j in step_keys]  # counted: from the 2nd
        agreed = self.agreement.max(local)
        at = dict(zip(keys, agreed, strict=False))
        self._slot_times = {
            (k, s): _median([at[(k, j, s)] for j in range(counted)], unknown=math.inf)
            for k in range(len(self.candidates))
            for s in slots
        }
        steps = agreed[len(keys) :]
        self._trial_steps = [
            [t for t in steps[k * counted : (k + 1) * counted] if t >= 0.0] for k in range(len(self.candidates))
        ]
        self._uniform = [_median(known, unknown=math.inf) for known in self._trial_steps]
        self.model = fit_cost_model(
            (self.candidates[k], self.layout[s][0], t) for (k, s), t in self._slot_times.items()
        )
        plan = {s: self._decide_slot(s) for s in slots}
        agreed_plan = self.agreement.min([plan[s].candidate for s in slots])
        for s, candidate in zip(slots, agreed_plan, strict=True):
            if candidate != plan[s].candidate:
                plan[s] = self._choice(s, candidate, "agreed", plan[s].baseline)
        self.plan, self._steps_checked = plan, False
        challenger = None
        if self.steps:
            challenger = self._baseline_challenger(slots)
            challenger = self._challenger(slots) if challenger is None else challenger
        methods = {choice.candidate for choice in plan.values()}
        if challenger is not None:
            # The plan against the challenger in the next two windows, their halves alternating.
            steps_of = {s: self._choice(s, challenger, "step", plan[s].baseline) for s in slots}
            self._contest, self._duel = None, (steps_of, None, 0)
        # The plan's best case: each of its methods' fastest counted trial step, against the
        # ring's median, so that one slow trial step of CERAR's (a warm-up cost) hands nothing over.
        hand_over, tol = False, self.config.duel_tol
        if challenger is not None and tol is not None and self.candidates[challenger].baseline:
            estimate = self._mixed_estimate(slots, best=True) if self._has_cerar(plan) else None
            hand_over = estimate is not None and estimate >= (1.0 + tol) * self._uniform[challenger]
        if challenger is not None and hand_over:
            # CERAR's trial steps lost to the ring's by more than a duel reverses (docs/auto.md
            # lists the duels this was set from): the ring takes every slot now, instead of
            # after the ten steps of the plan a duel would run.
            self._contest, self._duel, self._steps_checked = None, None, True
            self._everywhere(challenger, slots)
        elif challenger is not None and len(methods) == 1 and self._clearly_faster(challenger, *methods):
            # The plan is one method, whose whole steps the trials timed: the challenger runs
            # the first window and stays if its steps beat that method's trial steps.
            (method,) = methods
            self._contest, self._duel = (challenger, (dict(plan), self._uniform[method])), None
            self._everywhere(challenger, slots)
        elif challenger is not None and len(methods) > 1:
            estimate = self._mixed_estimate(slots)
            if estimate is not None and self._uniform[challenger] < (1.0 - self.config.margin) * estimate:
                # Even the mixed plan's estimate from its methods' trial steps loses by the
                # margin: the challenger takes every slot without a window of the plan.
                self._contest, self._duel, self._steps_checked = None, None, True
                self._everywhere(challenger, slots)
        self._record(step, "decide")

    def _baseline_challenger(self, slots: list[int]) -> int | None:
        """The fastest exact or 16-bit ring by the trial steps if the plan has CERAR in it and
        its estimate from the trial steps is not ``margin`` below that ring's, else None: CERAR
        must beat the rings by the margin in what the decision is judged by, and a call's time
        misses what its coding takes from backward (on a fast link the calls' model may choose
        CERAR whose trial steps were no faster than the rings'). In the duel that follows,
        CERAR must beat the ring's median step by the margin too."""
        if not self._has_cerar(self.plan):
            return None
        rings = [k for k in self._usable(slots) if self.candidates[k].baseline and math.isfinite(self._uniform[k])]
        estimate = self._mixed_estimate(slots)
        if not rings or estimate is None:
            return None
        best = min(rings, key=lambda k: (self._uniform[k], k))
        return None if estimate < (1.0 - self.config.margin) * self._uniform[best] else best

    def _has_cerar(self, plan: dict[int, Choice]) -> bool:
        return not all(self.candidates[c.candidate].baseline for c in plan.values())

    def _duel_choice(self, window: int, offset: int, slot: int) -> Choice | None:
        """The challenger's choice for ``slot`` where a duel runs it, else None (the plan's).

        A duel takes two windows: the plan runs the first half of the first and the second
        half of the second, the challenger the middle (P C | C P, each half ``verify_every //
        2`` steps). Each method's steps then sit symmetrically about the middle, so that a drift
        of the machine's pace moves both medians alike; one window of each in turn pits the
        later window's pace against the earlier's (here, steps that computed a quarter slower
        for ten steps were once the whole difference between two methods)."""
        if self._duel is None:
            return None
        challenger, _, first = self._duel
        if window not in (first, first + 1):
            return None
        half = max(1, self.config.verify_every // 2)
        return challenger[slot] if (offset >= half) == (window == first) else None

    def _run_duel(self, window: int, steps: list[float]) -> dict[str, Any]:
        """The duel's window ``window`` ended with the agreed ``steps`` (by offset): after the
        second, the challenger takes the plan if the median of its steps is below the plan's
        (the plan stays on a tie), except that a side with CERAR against one of rings alone
        wins only if ``margin`` faster. The first step of each half is left out where a half
        has more: it may carry the switch's costs (a transport's first call after another's)."""
        assert self._duel is not None
        challenger, earlier, first = self._duel
        if window == first:
            self._duel = (challenger, steps, first)
            return {}
        assert earlier is not None
        half = max(1, self.config.verify_every // 2)

        def settled(block: list[float]) -> list[float]:
            return block[1:] if len(block) > 1 else block

        plan_s = _median(settled(earlier[:half]) + settled(steps[half:]), None)
        challenger_s = _median(settled(earlier[half:]) + settled(steps[:half]), None)
        kept = plan_s is not None and challenger_s is not None and challenger_s < plan_s
        coded = [self._has_cerar(self.plan), self._has_cerar(challenger)]
        if kept and coded == [False, True]:  # CERAR must beat the rings by the margin
            kept = challenger_s < (1.0 - self.config.margin) * plan_s
        elif not kept and coded == [True, False] and plan_s is not None and challenger_s is not None:
            kept = plan_s >= (1.0 - self.config.margin) * challenger_s
        if kept:
            self.plan = dict(challenger)
        elif not self.steps:  # a verification's duel that CERAR won: not verified again
            self.plan = {s: replace(c, reason="step") if challenger[s] != c else c for s, c in self.plan.items()}
        self._duel, self._steps_checked = None, True
        return {"duel": {"plan_s": _finite(plan_s), "challenger_s": _finite(challenger_s), "challenger_kept": kept}}

    def _everywhere(self, method: int, slots: list[int]) -> None:
        """Every slot by ``method`` (reason ``"step"``), each keeping its baseline."""
        for s in slots:
            self.plan[s] = self._choice(s, method, "step", self.plan[s].baseline)

    def _mixed_estimate(self, slots: list[int], best: bool = False) -> float | None:
        """A plan's step from its methods' trial steps (their medians; ``best``: the fastest of
        each), each weighted by the bytes of the slots it runs (each method's share of the
        step's communication), or None if one of them has no trial step. Optimistic for a plan
        that mixes transports: their calls slow each other, which no uniform trial step contains."""
        total = sum(self.layout[s][1] for s in slots)
        of = (lambda k: min(self._trial_steps[k], default=math.inf)) if best else (lambda k: self._uniform[k])
        steps = [of(self.plan[s].candidate) for s in slots]
        if total <= 0 or not all(map(math.isfinite, steps)):
            return None
        return sum(self.layout[s][1] * t for s, t in zip(slots, steps, strict=True)) / total

    def _clearly_faster(self, challenger: int, method: int) -> bool:
        """Whether every counted trial step of ``challenger`` beat every one of ``method`` by
        ``margin``, with a gap of at least twice the larger spread of either's steps: evidence
        that trial noise does not explain (a hopeless ring on a slow link, not a near tie).
        One counted step each shows no spread: never clear."""
        fast, slow = self._trial_steps[challenger], self._trial_steps[method]
        if min(len(fast), len(slow)) < 2 or not all(map(math.isfinite, fast + slow)):
            return False
        gap, spread = min(slow) - max(fast), max(max(fast) - min(fast), max(slow) - min(slow))
        return max(fast) < (1.0 - self.config.margin) * min(slow) and gap >= 2.0 * spread

    def _usable(self, slots: list[int]) -> set[int]:
        """The candidates every one of ``slots`` may run (budget and pins; none where a slot is
        pinned) that this calibration did not cut."""
        usable = set(range(len(self._uniform))) - self.pruned
        for s in slots:
            allowed, pinned = self.config.pinned.allowed(self.candidates, self.layout[s][1])
            usable &= set() if pinned else set(allowed)
        return usable

    def _challenger(self, slots: list[int]) -> int | None:
        """The method whose trial steps were faster than every method of the plan's by
        ``margin``, among those every slot may run (budget and pins), or None. A plan that
        mixes methods was never run whole in the trials, so its methods' trial steps do not
        bound its own (two transports side by side, each method's calls slowed by the other's):
        the fastest single method challenges it whatever the margin. A plan of one exact or
        16-bit ring is challenged by the fastest other ring whose trial steps came within
        ``margin`` of its own (a near tie that two counted steps each cannot settle: on a fast
        link exact and the float16 ring differ by a few percent, which the calls' model and
        two trial steps called either way); the duel's eight steps each settle it."""
        known = sorted(k for k in self._usable(slots) if math.isfinite(self._uniform[k]))
        methods = {self.plan[s].candidate for s in slots}
        if not known or not methods:
            return None
        best = min(known, key=lambda k: (self._uniform[k], k))
        if len(methods) > 1:
            return best
        reference = min(self._uniform[k] for k in methods)
        if {best} != methods and self._uniform[best] < (1.0 - self.config.margin) * reference:
            return best
        if self._has_cerar(self.plan):
            return None
        near = [
            k
            for k in known
            if k not in methods
            and self.candidates[k].baseline
            and self._uniform[k] < (1.0 + self.config.margin) * reference
        ]
        return min(near, key=lambda k: (self._uniform[k], k)) if near else None

    def _decide_slot(self, slot: int) -> Choice:
        numel, nbytes = self.layout[slot]
        predicted = [self._predict(k, slot) for k in range(len(self.candidates))]
        allowed, pinned = self.config.pinned.allowed(self.candidates, nbytes)
        if not pinned:  # a cut candidate is no choice, a cut baseline still the reference
            pruned = self.pruned
            allowed = [k for k in allowed if k not in pruned or self.candidates[k].baseline] or allowed
        previous = self._previous.get(slot)
        choice = decide_slot(
            self.candidates,
            predicted,
            allowed,
            margin=self.config.margin,
            hysteresis=self.config.hysteresis,
            previous=previous[1] if previous is not None and previous[0] == numel else None,
            pinned=pinned,
        )
        return replace(choice, measured_s=_finite(self._slot_times.get((choice.candidate, slot))))

    def _predict(self, k: int, slot: int) -> float:
        measured = self._slot_times.get((k, slot), math.inf)
        if self.model is None or not math.isfinite(measured):
            return math.inf  # never measured there, or failed: not a choice
        return self.model.predict(self.candidates[k], self.layout[slot][0])

    def _choice(self, slot: int, candidate: int, reason: str, baseline: int) -> Choice:
        predicted = self._predict(candidate, slot)
        measured = self._slot_times.get((candidate, slot))
        return Choice(candidate, reason, _finite(predicted), _finite(measured), baseline)

    def _verify(self, step: int, window: int) -> None:
        slots, every, config = sorted(self.plan), self.config.verify_every, self.config
        keys = [(window, j, s) for j in range(every) for s in slots]
        step_keys = [(window, j) for j in range(every)] if self.steps else []
        with self._lock:
            local = [self._window.get(key, MISSING) for key in keys]
            local += [self._window_steps.get(key, MISSING) for key in step_keys]
            for table in (self._window, self._window_steps):
                for key in [key for key in table if key[0] <= window]:
                    del table[key]
        agreed = self.agreement.max(local)
        at = dict(zip(keys, agreed, strict=False))
        before = dict(self.plan)
        window_s = {s: _median([at[(window, j, s)] for j in range(every)], unknown=None) for s in slots}
        if self.steps:
            plan_step = _median(agreed[len(keys) :], unknown=None)
        else:  # calls: the window's time is its calls' (the collective's stream has one slot)
            plan_step = None if any(window_s[s] is None for s in slots) else sum(window_s[s] for s in slots)
        # Steps: the window's step against the plan's estimate from its trial steps.
        estimate = self._mixed_estimate(slots) if self.steps and plan_step is not None else None
        slow_step = estimate is not None and plan_step is not None and plan_step > estimate * (1 + config.verify_tol)
        # What a duel judges: the window's steps, or for calls each offset's calls (summed over
        # the slots; the collective's stream has one).
        series = (
            agreed[len(keys) :] if self.steps else [_total([at[(window, j, s)] for s in slots]) for j in range(every)]
        )
        duel = {} if self._duel is None else self._run_duel(window, series)
        slow_slots = []
        # A contest's windows, and a duel's, are judged by their steps.
        for s in slots if self._contest is None and self._duel is None and not duel else ():
            choice, measured = self.plan[s], window_s[s]
            if self.candidates[choice.candidate].baseline or choice.reason in ("pinned", "step"):
                continue  # nothing to go back to, or judged by the steps
            if self.steps:
                slow = slow_step
            elif measured is None:
                continue
            else:
                slow = choice.predicted_s is None or measured > choice.predicted_s * (1 + config.verify_tol)
                slow = slow or measured > self._slot_times.get((choice.baseline, s), math.inf) * (1 + config.step_tol)
            if slow:
                slow_slots.append(s)
        if not self.steps and slow_slots and all(math.isfinite(window_s[s] or math.inf) for s in slow_slots):
            # Calls: the slow slots' baselines duel the plan over the next two windows, halves
            # alternating, as the steps' duels do: the window was compared with figures timed
            # earlier (the baseline's trial calls, among other calls), and a window of each in
            # turn pits one stretch of the machine's pace against another (in the bench at 1 MB
            # one slow window of 16-bit CERAR sent the stream to the float16 ring, whose next
            # window, the machine faster again, kept it there, while CERAR's calls beside the
            # ring's took 0.85x theirs).
            duel_plan = {t: self._choice(t, self.plan[t].baseline, "verify", self.plan[t].baseline) for t in slow_slots}
            self._duel = ({t: duel_plan.get(t, self.plan[t]) for t in slots}, None, window + 1)
        else:  # steps, or a failed call: to the baseline now, contested below
            for s in slow_slots:
                self.plan[s] = self._choice(s, self.plan[s].baseline, "verify", self.plan[s].baseline)
        if duel or self._duel is not None:
            pass  # a duel's windows mix two methods: they judge the duel alone
        elif self._contest is not None:
            self._run_contest(slots, plan_step)
        elif self.plan != before and plan_step is not None:
            # The verification compared this window with figures timed earlier (the baseline's
            # trial calls, among other calls; the plan's trial steps). So the plan it made runs
            # the next window, and stays only if that window is `margin` faster than this one:
            # like with like.
            self._contest = (None, (before, plan_step))
        # The steps compare once, in the first window that ran the plan as it stands.
        elif self.steps and not self._steps_checked and self.plan == before and plan_step is not None:
            self._steps_checked = True
            self._check_steps(slots, plan_step)
        self._record(
            step, "verify", window_s={s: _finite(t) for s, t in window_s.items()}, window_step_s=plan_step, **duel
        )

    def _run_contest(self, slots: list[int], plan_step: float | None) -> None:
        """The window of a changed plan has ended: the faster plan stays (a verification's
        change only if ``margin`` faster). A verification's contest (challenger ``None``) holds
        the plan before the verification and its window's step; a clearly faster challenger,
        which ran first, holds the plan and its trial steps' median. The same on every rank:
        the window medians are agreed."""
        assert self._contest is not None
        challenger, held = self._contest
        if plan_step is None or held is None:
            self._contest = None  # nothing measured: no contest
        else:
            plan, held_step = held
            # A challenger had trial steps `margin` faster than the plan; a verification's change
            # (no challenger) has only a window's calls against the trials that chose the plan,
            # so it must gain the margin too to stay, not a window's noise.
            reverted = plan_step >= held_step * (1.0 if challenger is not None else 1.0 - self.config.margin)
            if reverted:
                # Back to the held plan; after a verification's change, the slots it changed are
                # judged by the steps from now on (not verified again, to change again).
                self.plan = {
                    s: plan[s] if challenger is not None or plan[s] == self.plan[s] else replace(plan[s], reason="step")
                    for s in slots
                }
            # A challenger's contest compared the plan with the fastest method's steps, and a
            # verification's change that held was judged against newer steps than the trials';
            # a verification's change undone leaves the step check due for the plan it restored.
            self._contest = None
            self._steps_checked = self._steps_checked or challenger is not None or not reverted

    def _check_steps(self, slots: list[int], plan_step: float) -> None:
        """A plan slower than the fastest single method's trial steps becomes that method."""
        known = [k for k, t in enumerate(self._uniform) if math.isfinite(t)]
        if not known:
            return
        best = min(known, key=lambda k: (self._uniform[k], k))
        if all(self.plan[s].candidate == best for s in slots):
            return
        if plan_step > self._uniform[best] * (1 + self.config.step_tol):
            for s in slots:
                allowed, pinned = self.config.pinned.allowed(self.candidates, self.layout[s][1])
                if best in allowed and not pinned and self.plan[s].candidate != best:
                    self.plan[s] = self._choice(s, best, "step", self.plan[s].baseline)

    def _record(self, step: int, event: str, **measured: Any) -> None:
        """A decision or verification into :attr:`history`; a verification adds its window's
        median per slot (``window_s``) and median step (``window_step_s``; for calls, the
        slots' medians summed), what it judged by."""
        self.history.append(
            {
                "step": step,
                "event": event,
                "model": None if self.model is None else self.model.as_dict(),
                "step_s": dict(zip((c.label for c in self.candidates), map(_finite, self._uniform), strict=False)),
                "buckets": [self.describe(s) for s in sorted(self.plan)],
                **measured,
            }
        )

    def describe(self, slot: int) -> dict[str, Any]:
        """The plan for ``slot`` as plain values: size, method, reason, predicted and measured."""
        choice = self.plan[slot]
        numel, nbytes = self.layout.get(slot, (None, None))
        return {
            "slot": slot,
            "numel": numel,
            "bytes": nbytes,
            "method": self.candidates[choice.candidate].label,
            "reason": choice.reason,
            "predicted_s": choice.predicted_s,
            "measured_s": choice.measured_s,
        }


def _median(values: Sequence[float], unknown: float | None) -> Any:
    """The median of the known values (missing ones are -1), inf if a call failed, ``unknown``
    if none is known."""
    known = [v for v in values if v >= 0.0]
    if not known:
        return unknown
    return math.inf if any(math.isinf(v) for v in known) else float(statistics.median(known))


def _total(values: Sequence[float]) -> float:
    """The sum of one offset's slot times, missing (-1) if one of them is."""
    return MISSING if any(v < 0.0 for v in values) else float(sum(values))


def _fastest(counted: Sequence[float]) -> float:
    """The fastest of the known counted times (missing ones are -1) once there are
    :data:`COUNTED_BEFORE_CUT` of them, else -1 (``MISSING``: not enough to cut by)."""
    known = [c for c in counted if c >= 0.0]
    return min(known) if len(known) >= COUNTED_BEFORE_CUT else MISSING


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None
