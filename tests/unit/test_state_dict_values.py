"""Every malformed value in a CerarState's or AutoState's state_dict is refused with an error that
names the key and the value (issue 53: a negative ``bucket_numel``, a string ``world_size`` and a
negative ``rank`` were loaded without a word); the state is left as it was."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from cerar.ddp import AutoState, CerarState

NAN, INF = float("nan"), float("inf")

#: key -> malformed values (for ``auto``: entries merged into the saved AutoConfig dict).
COMMON: dict[str, list[Any]] = {
    "rank": [-1, "0", 1.5, True],
    "world_size": ["4", 0, -2, 2.0, False],
    "bucket_numel": [{0: -5}, {-1: 5}, {"0": 5}, {0: 2.5}, [1]],
    "bucket_stats": [{0: {"bytes_sent": -1}}, {-1: {}}, {0: 3}],
    "stats": [{"bytes_sent": -1}, {"nope": 1}, 3, {"encode_s": NAN}],
    "last_step": [{"bytes_sent": -1}, 5],
    "iteration": [-1, "3", 1.0],
    "steps": [-1],
    "resyncs": [-2],
    "sparse_buckets": [-1],
    "exact_buckets": [None],
    "exact_bytes": [-1],
    "resync_s": [NAN, -1.0, INF, "1"],
    "last_divergence": [NAN, "x", -1.0],
    "max_divergence": [NAN, -2.0, True],
    "nonfinite": ["x", None],
    "min_bucket_bytes": [-1, "1"],
    "resync_every": [0, "2"],
    "divergence_tol": [0, -1, INF],
}
CERAR_ONLY: dict[str, list[Any]] = {
    "code": [{"x": 1}, 5, "abc"],
    "packet_dtype": ["int8", 5],
    "start_iter": [-1, None],
    "error_feedback": [1, None, "yes"],
    "residuals": [5, [1], {-1: {}}, {0: {"layout": 3, "identity": None, "residual": None}}],
}
AUTO_ONLY: dict[str, list[Any]] = {
    "max_error": [-1, "x", NAN],
    "auto": [5, {"trials": -1}, {"zzz": 1}, {"trials": "a"}, {"candidates": 5}, {"margin": -1.0}, {"pins": 5}],
}
CASES = [
    (cls, key, value)
    for cls, table in ((CerarState, {**COMMON, **CERAR_ONLY}), (AutoState, {**COMMON, **AUTO_ONLY}))
    for key, values in table.items()
    for value in values
]


@pytest.mark.parametrize(("cls", "key", "value"), CASES, ids=lambda v: getattr(v, "__name__", repr(v)))
def test_a_malformed_value_is_refused_naming_the_key_and_the_value(cls: type, key: str, value: Any) -> None:
    state = cls()
    saved = state.state_dict()
    loaded = copy.deepcopy(saved)
    loaded[key] = {**saved[key], **value} if key == "auto" and isinstance(value, dict) else value
    with pytest.raises((ValueError, TypeError, KeyError)) as info:
        state.load_state_dict(loaded)
    message = str(info.value)
    assert repr(key) in message, message
    shown = repr(loaded[key])
    assert shown[:60] in message or repr(value) in message, message
    assert state.state_dict() == saved  # unchanged


@pytest.mark.parametrize("cls", [CerarState, AutoState])
def test_a_rank_outside_its_world_is_refused(cls: type) -> None:
    loaded = {**cls().state_dict(), "rank": 4, "world_size": 4}
    with pytest.raises(ValueError, match=r"Key 'rank' .* 4: it must be less than its 'world_size', 4"):
        cls().load_state_dict(loaded)


@pytest.mark.parametrize("cls", [CerarState, AutoState])
def test_well_formed_values_still_load(cls: type) -> None:
    loaded = {
        **cls().state_dict(), "rank": 0, "world_size": 1, "bucket_numel": {0: 10, 1: 0},
        "last_divergence": 0.0, "max_divergence": INF,
    }  # fmt: skip
    state = cls()
    state.load_state_dict(loaded)
    assert state.bucket_numel == {0: 10, 1: 0} and state.max_divergence == INF
