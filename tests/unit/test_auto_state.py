"""``AutoState``'s checkpoints in one process: its settings round-trip through a plain-valued
``state_dict``, and a malformed dict raises naming the key and the value, the state unchanged."""

from __future__ import annotations

import math
from typing import Any

import pytest

from cerar.ddp import AutoConfig, AutoState, CerarState


def _state(**kwargs: Any) -> AutoState:
    config = AutoConfig(trials=3, margin=0.05, recheck_every=50, pins="0,1M,ring,-,-\n16M,-,cerar,fp16,-")
    return AutoState(max_error=1e-3, auto=config, nonfinite="raise", min_bucket_bytes=4096, **kwargs)


def _plain(value: Any) -> bool:
    if isinstance(value, dict):
        return all(isinstance(k, (str, int)) and _plain(v) for k, v in value.items())
    if isinstance(value, list):
        return all(_plain(v) for v in value)
    return value is None or isinstance(value, (bool, int, float, str))


def test_settings_round_trip() -> None:
    saved = _state(resync_every=7).state_dict()
    assert _plain(saved) and saved["max_error"] == 1e-3 and saved["auto"]["trials"] == 3
    loaded = AutoState()
    loaded.load_state_dict(saved)
    assert loaded.max_error == 1e-3 and loaded.auto == _state().auto
    assert (loaded.nonfinite, loaded.min_bucket_bytes, loaded.resync_every) == ("raise", 4096, 7)
    assert loaded.state_dict() == saved


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("max_error", -1.0, "Argument 'max_error'"),
        ("max_error", "tiny", "max_error"),
        ("auto", {"trials": 0}, "Argument 'trials'"),
        ("auto", {"margin": float("nan")}, "Argument 'margin'"),
        ("auto", {"pins": "0,-,nccl,-,-"}, "algorithm"),
        ("auto", "fast", "AutoConfig"),
        ("iteration", "12", "iteration"),
        ("resyncs", -1, "Argument 'resyncs' must be at least 0"),
        ("resync_s", math.nan, "resync_s"),
        ("stats", {"calls": "3"}, "Argument 'calls'"),
        ("stats", {"wall_s": math.nan}, "Argument 'wall_s'"),
        ("stats", {"calls": -2}, "Argument 'calls' must be at least 0"),
        ("stats", {"colls": 2}, "unexpected statistics"),
        ("bucket_stats", {0: {"bytes_sent": 1.5}}, "bytes_sent"),
        ("min_bucket_bytes", -5, "min_bucket_bytes"),
    ],
)
def test_a_malformed_state_dict_names_the_key_and_the_value(key: str, value: Any, message: str) -> None:
    saved = _state().state_dict()
    if isinstance(value, dict) and isinstance(saved[key], dict) and key != "bucket_stats":
        saved[key] = {**saved[key], **value}
    else:
        saved[key] = value
    state = AutoState()
    before = state.state_dict()
    with pytest.raises(ValueError, match=f"Key '{key}' of the state_dict holds a bad value") as info:
        state.load_state_dict(saved)
    assert message in str(info.value)
    assert state.state_dict() == before  # unchanged


def test_a_cerar_states_dict_is_refused_and_the_other_way_round() -> None:
    auto_format = r"Key 'format' of the state_dict must be 'cerar\.comm\.auto\.ddp\.AutoState/1'"
    with pytest.raises(ValueError, match=auto_format):
        AutoState().load_state_dict(CerarState(start_iter=3).state_dict())
    with pytest.raises(ValueError, match="Key 'format'"):
        CerarState().load_state_dict(AutoState().state_dict())


def test_settings_that_do_not_apply_are_refused() -> None:
    for name, value in (("code", None), ("packet_dtype", None), ("start_iter", 2)):
        with pytest.raises(TypeError, match=f"Argument '{name}' does not apply to AutoState"):
            AutoState(**{name: value})
