"""The arithmetic of ``cerar bench``: timing summaries, bandwidths, theory ratios, the
alpha-beta cost model and the crossover size it predicts. Pure Python and numpy."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from cerar._checks import check_int


@dataclass(frozen=True)
class Timing:
    """Median, min and max of the timed iterations (each = the slowest rank's time)."""

    median_s: float
    min_s: float
    max_s: float


def summarize(times_s: Sequence[float]) -> Timing:
    """Median, min and max of ``times_s`` (at least one positive finite time)."""
    values = [float(t) for t in times_s]
    if not values:
        raise ValueError("Argument 'times_s' must hold at least one time, not [].")
    bad = [t for t in values if not math.isfinite(t) or t < 0]
    if bad:
        raise ValueError(f"Argument 'times_s' must hold finite non-negative times, not {bad[0]}.")
    return Timing(statistics.median(values), min(values), max(values))


def slowest_rank(per_rank_times: Sequence[Sequence[float]]) -> list[float]:
    """Iteration times as nccl-tests counts them: for each iteration the slowest rank's time.

    ``per_rank_times[r][k]`` is rank ``r``'s time of iteration ``k``.
    """
    if not per_rank_times:
        raise ValueError("Argument 'per_rank_times' must hold at least one rank, not [].")
    lengths = {len(times) for times in per_rank_times}
    if len(lengths) != 1:
        raise ValueError(f"Argument 'per_rank_times' must have equal lengths per rank, not {sorted(lengths)}.")
    return [max(column) for column in zip(*per_rank_times, strict=True)]


def bus_factor(world_size: int) -> float:
    """nccl-tests' all-reduce bus factor ``2(N-1)/N``: busbw = algbw x this."""
    n = check_int("world_size", world_size, minimum=1)
    return 2.0 * (n - 1) / n


def algbw(size_bytes: float, time_s: float) -> float:
    """Algorithm bandwidth ``size / time`` in bytes per second."""
    if time_s <= 0:
        raise ValueError(f"Argument 'time_s' must be positive, not {time_s}.")
    return size_bytes / time_s


def busbw(size_bytes: float, time_s: float, world_size: int) -> float:
    """Bus bandwidth ``algbw x 2(N-1)/N``, the same factor for every method so numbers compare."""
    return algbw(size_bytes, time_s) * bus_factor(world_size)


def byte_theory_ratio(world_size: int, components: int) -> float:
    """CERAR's bytes over ring all-reduce's: ``(1 + (N-2)/c) / (2(N-1)/N)``."""
    n = check_int("world_size", world_size, minimum=2)
    c = check_int("components", components, minimum=1)
    return (1.0 + (n - 2) / c) / bus_factor(n)


# ---------------------------------------------------------------------------------------------
# alpha-beta model


@dataclass(frozen=True)
class AlphaBeta:
    """``time = rounds x alpha + bytes_sent_per_rank x beta``, fitted to one method's sweep.

    Attributes:
        alpha_s: latency per round (seconds), at least 0: when the free fit gives a negative
            latency (every size bandwidth-bound, the intercept lost in the noise) the model is
            refitted through the origin and ``alpha_clamped`` is set.
        beta_s_per_byte: time per byte sent per rank; ``1 / beta`` is the effective bandwidth.
        rounds: rounds per call used to split the intercept.
        bytes_per_size: bytes sent per rank per message byte (from the sweep).
        points: sizes fitted.
        max_rel_residual: the worst relative misfit over the sweep.
    """

    alpha_s: float
    beta_s_per_byte: float
    rounds: int
    bytes_per_size: float
    points: int
    max_rel_residual: float
    alpha_clamped: bool = False

    @property
    def bandwidth_bytes_per_s(self) -> float | None:
        return 1.0 / self.beta_s_per_byte if self.beta_s_per_byte > 0 else None

    def predict(self, size_bytes: float) -> float:
        """Predicted time for a message of ``size_bytes``."""
        return self.rounds * self.alpha_s + self.beta_s_per_byte * self.bytes_per_size * size_bytes

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["bandwidth_bytes_per_s"] = self.bandwidth_bytes_per_s
        return out


def fit_alpha_beta(
    sizes_bytes: Sequence[float], bytes_sent: Sequence[float], times_s: Sequence[float], rounds: int
) -> AlphaBeta | None:
    """Least-squares fit of ``t = rounds alpha + B beta`` with relative weights (times span
    decades, so every size should count alike). ``None`` with fewer than two distinct sizes."""
    rounds = check_int("rounds", rounds, minimum=1)
    if not len(sizes_bytes) == len(bytes_sent) == len(times_s):
        raise ValueError(
            f"Arguments 'sizes_bytes', 'bytes_sent', 'times_s' must have equal lengths, not "
            f"{len(sizes_bytes)}, {len(bytes_sent)}, {len(times_s)}."
        )
    s = np.asarray(sizes_bytes, dtype=float)
    b = np.asarray(bytes_sent, dtype=float)
    t = np.asarray(times_s, dtype=float)
    if len(np.unique(b)) < 2 or np.any(t <= 0):
        return None
    weights = 1.0 / t
    design = np.stack([np.full_like(b, float(rounds)), b], axis=1) * weights[:, None]
    (alpha, beta), *_ = np.linalg.lstsq(design, t * weights, rcond=None)
    clamped = bool(alpha < 0)
    if clamped:  # a negative latency is unphysical: fit the slope alone
        wb = weights * b
        alpha, beta = 0.0, float(np.dot(wb, weights * t) / np.dot(wb, wb))
    fitted = rounds * alpha + beta * b
    return AlphaBeta(
        alpha_s=float(alpha),
        beta_s_per_byte=float(beta),
        rounds=rounds,
        bytes_per_size=float(np.median(b / s)),
        points=len(t),
        max_rel_residual=float(np.max(np.abs(fitted - t) / t)),
        alpha_clamped=clamped,
    )


@dataclass(frozen=True)
class Crossover:
    """Where one method beats the baseline, predicted by two alpha-beta fits.

    ``wins`` is ``"above"`` (faster for sizes above ``size_bytes``), ``"below"``,
    ``"always"`` or ``"never"``; ``size_bytes`` is ``None`` for the last two.
    """

    wins: str
    size_bytes: float | None

    def predicts_faster(self, size_bytes: float) -> bool:
        if self.wins == "always":
            return True
        if self.wins == "never" or self.size_bytes is None:
            return False
        return size_bytes > self.size_bytes if self.wins == "above" else size_bytes < self.size_bytes


def crossover(method: AlphaBeta, baseline: AlphaBeta) -> Crossover:
    """Solve ``method.predict(s) = baseline.predict(s)`` for the message size ``s``."""
    intercept = method.rounds * method.alpha_s - baseline.rounds * baseline.alpha_s
    slope = baseline.beta_s_per_byte * baseline.bytes_per_size - method.beta_s_per_byte * method.bytes_per_size
    # method faster  <=>  intercept < slope * s
    if slope > 0:
        return Crossover("above", intercept / slope) if intercept > 0 else Crossover("always", None)
    if slope < 0:
        return Crossover("below", intercept / slope) if intercept < 0 else Crossover("never", None)
    return Crossover("always", None) if intercept < 0 else Crossover("never", None)


def measured_crossover(sizes_bytes: Sequence[float], faster: Sequence[bool]) -> float | None:
    """The smallest measured size from which the method is faster at every larger size."""
    pairs = sorted(zip(sizes_bytes, faster, strict=True))
    answer: float | None = None
    for size, win in reversed(pairs):
        if not win:
            break
        answer = size
    return answer
