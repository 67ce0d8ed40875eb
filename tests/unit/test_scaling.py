"""The packet scale window's choice of the next call's exponent (:meth:`ScaleWindow.follow`)."""

from __future__ import annotations

import math

from cerar.coding import codes
from cerar.coding.scaling import scale_window


def test_follow_recentres_a_narrow_format_only_beyond_a_binade() -> None:
    window = scale_window(codes.perturbed(4, 8), "fp32", "fp16", decode_gain=4.0)
    assert window.target is not None
    e = -20
    x = 2.0 ** (window.target - 0.5 + e - window.log_gain)  # its level at e: half a binade below the target
    assert window.level(x) - e == window.target - 0.5
    for binades in (-0.4, 0.4, 1.4):  # within a binade of the target: the scale stays
        assert window.follow(x * 2.0**binades, e) == e
    for binades in (-0.6, 1.6, 6.0, -12.0):  # beyond: the level goes back to the target
        moved = x * 2.0**binades
        assert window.follow(moved, e) == window.exponent_for(moved) != e
        assert window.target - 1 < window.level(moved) - window.follow(moved, e) <= window.target
    for unusable in (0.0, math.inf, math.nan):  # nothing to go by: unchanged
        assert window.follow(unusable, e) == e


def test_follow_leaves_a_wide_format_alone() -> None:
    window = scale_window(codes.perturbed(4, 8), "fp32", "fp32", decode_gain=4.0)
    assert window.target is None
    assert window.follow(1e30, 0) == 0 and window.follow(1e-30, 0) == 0
