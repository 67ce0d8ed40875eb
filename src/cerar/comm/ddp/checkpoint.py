"""Checkpoints of :class:`cerar.comm.ddp.hooks.CerarState`: its ``state_dict`` as plain values, and the
checks of one being loaded.

A ``state_dict`` holds only ``None``, bools, ints, floats, strings, dicts of them and the
error-feedback residuals' float32 tensors (:class:`CerarState` adds those), so that
``torch.save(state.state_dict(), f)`` loads with ``torch.load(f, weights_only=True)`` (no pickled
classes to trust). It is one rank's: the statistics are what that rank measured, so each rank
saves and loads its own, and the saving rank's ``rank`` and ``world_size`` are kept to check it.
Kept apart from :mod:`cerar.comm.ddp.hooks` so that the hooks read without the bookkeeping; torch
is imported only where a residual or a dtype is read.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import fields
from typing import Any

from cerar._checks import check_bool, check_choice, check_float, check_int
from cerar.coding.linear_code import Code
from cerar.comm.collective.checks import check_packet_dtype
from cerar.comm.collective.policies import NONFINITE_POLICIES
from cerar.comm.runtime.stats import CommStats

__all__ = [
    "PREVIOUS_FORMAT",
    "SETTINGS",
    "STATE_DICT_FORMAT",
    "Setting",
    "check_count",
    "check_every",
    "check_packet_dtype",
    "check_tol",
    "from_state_dict",
    "to_state_dict",
]

#: The ``"format"`` entry of a ``CerarState.state_dict()`` (2: the bucket policy's settings and
#: counts were added; 3: ``packet_dtype``, and ``rescales`` in the statistics; 4:
#: ``error_feedback`` and the buckets' residuals, float32 tensors, which ``weights_only`` loads).
STATE_DICT_FORMAT = "cerar.comm.ddp.hooks.CerarState/4"
#: The format before, which still loads (no error feedback, no residuals).
PREVIOUS_FORMAT = "cerar.comm.ddp.hooks.CerarState/3"
#: ``packet_dtype`` settings by the name a state_dict saves them under (plain strings).
PACKET_DTYPE_NAMES = (None, "float32", "float64", "float16", "bfloat16")
#: Statistics saved as they are: counts, seconds, divergences (``None`` if never measured).
COUNTERS = ("iteration", "steps", "resyncs", "sparse_buckets", "exact_buckets", "exact_bytes")
SECONDS = ("resync_s",)
DIVERGENCES = ("last_divergence", "max_divergence")


def check_count(name: str, value: Any) -> int:
    """``min_bucket_bytes``, ``start_iter``: an integer of at least 0 (not a bool)."""
    return check_int(name, value, minimum=0)


def check_every(name: str, value: Any) -> int | None:
    """``resync_every``: None or an integer of at least 1."""
    return None if value is None else check_int(name, value, minimum=1)


def check_tol(name: str, value: Any) -> float | None:
    """``divergence_tol``: None or a positive float."""
    return None if value is None else check_float(name, value, positive=True)


def _same(value: Any) -> Any:
    return value


#: A setting in a state_dict: how its value is saved (a plain value) and how a loaded one is
#: checked (raising for a value the state's constructor would refuse).
Setting = tuple[Callable[[Any], Any], Callable[[Any], Any]]

#: CerarState's settings (``code`` is saved and checked apart: it must match the state's).
SETTINGS: dict[str, Setting] = {
    "nonfinite": (_same, lambda v: check_choice("nonfinite", v, NONFINITE_POLICIES)),
    "packet_dtype": (lambda v: None if v is None else str(v).removeprefix("torch."), lambda v: _packet_dtype(v)),
    "min_bucket_bytes": (_same, lambda v: check_count("min_bucket_bytes", v)),
    "start_iter": (_same, lambda v: check_count("start_iter", v)),
    "resync_every": (_same, lambda v: check_every("resync_every", v)),
    "divergence_tol": (_same, lambda v: check_tol("divergence_tol", v)),
    "error_feedback": (_same, lambda v: check_bool("error_feedback", v)),
}


def to_state_dict(
    state: Any, rank: int | None, world_size: int | None, form: str = STATE_DICT_FORMAT,
    settings: Mapping[str, Setting] = SETTINGS,
) -> dict[str, Any]:  # fmt: skip
    """The plain-valued ``state_dict`` of a state (read, not changed), saved by ``rank``:
    ``form`` and ``settings`` are its class's (:data:`STATE_DICT_FORMAT`, :data:`SETTINGS`)."""
    out: dict[str, Any] = {"format": form}
    if form == STATE_DICT_FORMAT:  # CerarState's own: its code and residuals (auto's state has neither)
        out["code"] = None if state.code is None else json.loads(state.code.to_json())
        held = state.residuals.items()
        out["residuals"] = {i: {"layout": layout, **store.state_dict()} for i, (layout, store) in held}
    out.update({name: save(getattr(state, name)) for name, (save, _) in settings.items()})
    out.update({
        "rank": rank,
        "world_size": world_size,
        "stats": state.stats.as_dict(),
        "last_step": None if state.last_step is None else state.last_step.as_dict(),
        "bucket_numel": dict(state.bucket_numel),
        "bucket_stats": {index: s.as_dict() for index, s in state.bucket_stats.items()},
    })  # fmt: skip
    out.update({name: getattr(state, name) for name in COUNTERS + SECONDS + DIVERGENCES})
    return out


def from_state_dict(
    state_dict: Any, code: Code | None, rank: int | None, world_size: int | None, form: str = STATE_DICT_FORMAT,
    settings: Mapping[str, Setting] = SETTINGS,
) -> dict[str, Any]:  # fmt: skip
    """The attribute values ``state_dict`` gives a state holding ``code`` on ``rank`` of
    ``world_size`` (each None where unknown), checked key by key: errors name the key and the
    value. ``form`` and ``settings`` are the state's class's; ``code`` is None for a class
    without one (auto's state)."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"Argument 'state_dict' must be a mapping from state_dict(), not {type(state_dict).__name__}.")
    if form == STATE_DICT_FORMAT and state_dict.get("format") == PREVIOUS_FORMAT:  # before error feedback
        state_dict = {**state_dict, "format": form, "error_feedback": False, "residuals": {}}
    if state_dict.get("format") != form:
        raise ValueError(f"Key 'format' of the state_dict must be {form!r}, not {state_dict.get('format')!r}.")
    keys = ["format", *(["code", "residuals"] if form == STATE_DICT_FORMAT else []), *settings, *_RECORDS]
    missing = [k for k in keys if k not in state_dict]
    unexpected = sorted((k for k in state_dict if k not in keys), key=repr)
    if missing or unexpected:
        raise KeyError(f"load_state_dict: missing keys {missing}, unexpected keys {unexpected}.")
    for key, least in (("rank", 0), ("world_size", 1)):  # the saving rank's place: checked, not restored
        _keyed(key, lambda v, key=key, least=least: check_int(key, v, minimum=least, optional=True), state_dict)
    saved_rank, saved_size = state_dict["rank"], state_dict["world_size"]
    if saved_rank is not None and saved_size is not None and saved_rank >= saved_size:
        raise ValueError(
            f"Key 'rank' of the state_dict holds a bad value {saved_rank!r}: it must be less than its "
            f"'world_size', {saved_size!r}."
        )
    for key, here in (("rank", rank), ("world_size", world_size)):
        saved = state_dict[key]
        if saved is not None and here is not None and saved != here:
            raise ValueError(
                f"Key {key!r} of the state_dict is {saved!r} but this process has {key} {here}: "
                "each rank saves and loads its own state_dict()."
            )
    parsers: dict[str, Callable[[Any], Any]] = {name: parse for name, (_, parse) in settings.items()}
    if "code" in keys:
        parsers["code"] = lambda v: _loaded_code(v, code)
        parsers["residuals"] = _residuals
    parsers.update({
        "stats": _comm_stats,
        "last_step": lambda v: None if v is None else _comm_stats(v),
        "bucket_numel": lambda v: {_index(i): check_int("numel", n, minimum=0) for i, n in _mapping(v).items()},
        "bucket_stats": lambda v: {_index(i): _comm_stats(s) for i, s in _mapping(v).items()},
    })  # fmt: skip
    for name in COUNTERS:
        parsers[name] = lambda v, name=name: check_int(name, v, minimum=0)
    for name in SECONDS:
        parsers[name] = lambda v, name=name: check_float(name, v, nonnegative=True)
    for name in DIVERGENCES:  # inf is a divergence (a rank-0 replica of norm 0)
        parsers[name] = lambda v, name=name: None if v is None else _real(name, v)
    return {key: _keyed(key, parse, state_dict) for key, parse in parsers.items()}


#: The keys every state_dict has beside its format, code and settings.
_RECORDS = (
    "rank", "world_size", "stats", "last_step", "bucket_numel", "bucket_stats", *COUNTERS, *SECONDS, *DIVERGENCES,
)  # fmt: skip


def _keyed(key: str, parse: Callable[[Any], Any], state_dict: Mapping[str, Any]) -> Any:
    """``parse(state_dict[key])``, or a ValueError that names the key."""
    try:
        return parse(state_dict[key])
    except (TypeError, ValueError, AttributeError) as exc:
        if key == "code" and isinstance(exc, ValueError) and str(exc).startswith("Key 'code'"):
            raise
        raise ValueError(f"Key {key!r} of the state_dict holds a bad value {state_dict[key]!r:.200}: {exc}") from None


def _real(name: str, value: Any) -> float:
    """A divergence: a non-negative real number, infinity included (not NaN)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"Argument '{name}' must be a real number or None, not {value!r}.")
    if not value >= 0:  # NaN too
        raise ValueError(f"Argument '{name}' must be non-negative (or inf), not {value!r}.")
    return float(value)


def _index(value: Any) -> int:
    """A bucket's index: an integer of at least 0."""
    return check_int("index", value, minimum=0)  # type: ignore[return-value]


def _packet_dtype(value: Any) -> Any:
    import torch

    if value not in PACKET_DTYPE_NAMES:
        raise ValueError(f"expected one of {PACKET_DTYPE_NAMES}, not {value!r}")
    return None if value is None else getattr(torch, value)


def _mapping(value: Any) -> Mapping[Any, Any]:
    if not isinstance(value, Mapping):
        raise TypeError(f"expected a mapping, not {type(value).__name__}")
    return value


def _comm_stats(value: Any) -> CommStats:
    """A :class:`CommStats` from its ``as_dict()``, each figure checked: counts are integers of at
    least 0, seconds finite and non-negative."""
    known = {f.name: f.type for f in fields(CommStats)}
    unexpected = sorted(set(_mapping(value)) - set(known), key=repr)
    if unexpected:
        raise ValueError(f"unexpected statistics {unexpected}")
    checked = {
        name: check_int(name, v, minimum=0) if known[name] in (int, "int") else check_float(name, v, nonnegative=True)
        for name, v in value.items()
    }
    return CommStats(**checked)


def _residuals(value: Any) -> dict[int, tuple[str, Any]]:
    """The buckets' error-feedback stores, ``{index: (layout, ErrorFeedback)}``, from what
    ``state_dict`` saved (``{index: {"layout", "identity", "residual"}}``), each entry checked: an
    identity ``(method, values, ranks)`` and a 1-D float32 residual of the padded size
    ``ranks * ceil(values / ranks)``, or neither."""
    out = {}
    for index, entry in _mapping(value).items():
        try:
            out[_index(index)] = _residual_entry(entry)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"bad entry {index!r}: {exc}") from None
    return out


def _residual_entry(entry: Any) -> tuple[str, Any]:
    import torch

    from cerar.comm.algorithms.ring.feedback import ErrorFeedback

    entry = _mapping(entry)
    if set(entry) != {"layout", "identity", "residual"}:
        raise ValueError(f"expected the keys 'layout', 'identity' and 'residual', not {sorted(entry, key=repr)}")
    layout, identity, residual = entry["layout"], entry["identity"], entry["residual"]
    if not isinstance(layout, str):
        raise TypeError(f"expected a layout string, not {layout!r}")
    if identity is not None:
        if not isinstance(identity, (tuple, list)) or len(identity) != 3 or not isinstance(identity[0], str):
            raise ValueError(f"expected an identity (method, values, ranks), not {identity!r}")
        values = check_int("values", identity[1], minimum=1)
        ranks = check_int("ranks", identity[2], minimum=1)
        assert values is not None and ranks is not None
        padded = ranks * -(-values // ranks)
        if isinstance(residual, torch.Tensor) and (residual.dim() != 1 or residual.numel() != padded):
            raise ValueError(f"expected a residual of {padded} values, not of shape {tuple(residual.shape)}")
    store = ErrorFeedback()
    store.load_state_dict(dict(entry))  # both or neither, a float32 tensor
    return layout, store


def _loaded_code(saved: Any, current: Code | None) -> Code | None:
    """The saved code if it equals ``current`` (or ``current`` is None), else a ValueError."""
    if saved is None:
        return current
    try:
        loaded = Code.from_dict(saved)
    except (TypeError, ValueError, KeyError) as exc:
        raise ValueError(f"Key 'code' of the state_dict is not a code description: {exc}") from None
    if current is not None and loaded != current:
        raise ValueError(f"Key 'code' of the state_dict holds {loaded!r}, but this state's code is {current!r}.")
    return loaded
