"""Command-line flags declared once, on the fields of the config dataclasses.

A config field becomes a flag when its metadata says so::

    steps: int = field(default=200, metadata=flag("optimizer steps"))

:func:`add_flags` turns every such field of a (nested) dataclass into an ``argparse`` option
(``--steps``; the type from the annotation, the help from the metadata, the default shown from
the field's), and :func:`from_flags` builds the config back from the parsed arguments. The
dataclass stays the single place where a setting, its default, its help and its checks live; the
commands and the rank workers (which also run under ``torchrun``) share the same flags.

Every flag's ``argparse`` default is ``None``, meaning "not given": :func:`from_flags` passes only
the given values, so the dataclass's own default applies otherwise and a command can put a preset
of its own in between (``cerar bench --quick``). Values that need parsing (comma lists, sizes)
are parsed when the config is built, not by ``argparse``, so that a bad value raises the same
``ValueError`` naming the argument as a bad value in Python does.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

__all__ = ["Flag", "add_flags", "flag", "flag_group", "from_flags", "given_flags"]

_KEY = "cerar.flag"


@dataclass(frozen=True)
class Flag:
    """How one config field appears on the command line.

    Attributes:
        help: the help text (``"(default X)"`` is appended from the field).
        name: the long option (default ``--`` + the field name with dashes).
        short: a short alias, e.g. ``"-N"``.
        parse: ``text -> value``, applied by :func:`from_flags` (``argparse`` then keeps the text).
        choices: the accepted texts.
        default_text: the default as ``--help`` shows it (default: the field's default).
        group: for a nested dataclass field: the title of its argument group.
    """

    help: str
    name: str | None = None
    short: str | None = None
    parse: Callable[[str], Any] | None = None
    choices: tuple[str, ...] | None = None
    default_text: str | None = None
    group: str | None = None


def flag(help: str, **options: Any) -> dict[str, Flag]:
    """Field metadata making the field a flag (see :class:`Flag` for ``options``)."""
    return {_KEY: Flag(help, **options)}


def flag_group(title: str) -> dict[str, Flag]:
    """Field metadata for a nested dataclass field: its flags form a group called ``title``."""
    return {_KEY: Flag(title, group=title)}


def add_flags(parser: argparse.ArgumentParser, config_type: type, *, title: str | None = None) -> None:
    """Add an option for every flagged field of ``config_type`` (nested dataclasses: a group)."""
    target: Any = parser.add_argument_group(title) if title else parser
    for field, spec, kind in _flagged(config_type):
        if dataclasses.is_dataclass(kind):
            add_flags(parser, kind, title=spec.group or spec.help)  # type: ignore[arg-type]
            continue
        names = [spec.name or "--" + field.name.replace("_", "-")] + ([spec.short] if spec.short else [])
        shown = spec.default_text if spec.default_text is not None else _default_text(field)
        target.add_argument(
            *names,
            dest=field.name,
            type=str if spec.parse is not None else _scalar(kind, field.name),
            default=None,
            choices=spec.choices,
            metavar=None if spec.choices else names[0].lstrip("-").upper().replace("-", "_"),
            help=f"{spec.help} (default {shown})".replace("%", "%%"),
        )


def given_flags(args: argparse.Namespace, config_type: type) -> dict[str, Any]:
    """The field values the command line gave (parsed), nested dataclasses built whole."""
    values: dict[str, Any] = {}
    for field, spec, kind in _flagged(config_type):
        if dataclasses.is_dataclass(kind):
            values[field.name] = kind(**given_flags(args, kind))  # type: ignore[operator]
            continue
        value = getattr(args, field.name, None)
        if value is not None:
            values[field.name] = spec.parse(value) if spec.parse is not None else value
    return values


def from_flags(args: argparse.Namespace, config_type: type, **overrides: Any) -> Any:
    """``config_type(**given flags, **overrides)``: the config (checked by its own ``__post_init__``)."""
    return config_type(**{**given_flags(args, config_type), **overrides})


def _flagged(config_type: type) -> Iterator[tuple[dataclasses.Field, Flag, Any]]:
    """``(field, flag, resolved type)`` for every flagged field, in declaration order."""
    hints = typing.get_type_hints(config_type)  # the annotations are strings (postponed)
    for field in dataclasses.fields(config_type):
        spec = field.metadata.get(_KEY)
        if spec is not None:
            yield field, spec, hints[field.name]


def _scalar(kind: Any, name: str) -> type:
    """``int``, ``float`` or ``str`` from the annotation (``X | None`` counts as ``X``)."""
    if isinstance(kind, types.UnionType) or typing.get_origin(kind) is typing.Union:
        kinds = [k for k in typing.get_args(kind) if k is not type(None)]
        kind = kinds[0] if len(kinds) == 1 else None
    if kind not in (int, float, str):
        raise TypeError(f"Field {name!r} of type {kind!r} needs a 'parse' function to be a flag.")
    return kind


def _default_text(field: dataclasses.Field) -> str:
    if field.default is not dataclasses.MISSING:
        return str(field.default)
    if field.default_factory is not dataclasses.MISSING:
        return str(field.default_factory())
    return "required"
