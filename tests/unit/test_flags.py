"""Flags declared on config dataclasses: one option per flagged field, help and default from
the field, the config built back from the parsed arguments (given values only)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

import pytest

from cerar.experiments._flags import add_flags, flag, flag_group, from_flags, given_flags
from cerar.experiments.train.config import ModelConfig, TrainConfig, add_config_arguments, config_from_args


@dataclass(frozen=True)
class Inner:
    width: int = field(default=3, metadata=flag("the width"))


@dataclass(frozen=True)
class Outer:
    count: int = field(default=2, metadata=flag("how many", short="-n"))
    ratio: float | None = field(default=None, metadata=flag("a ratio", default_text="off"))
    names: tuple[str, ...] = field(
        default=("a",), metadata=flag("names", name="--name", parse=lambda t: tuple(t.split(",")))
    )
    inner: Inner = field(default_factory=Inner, metadata=flag_group("inner settings"))
    hidden: str = "not a flag"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_flags(parser, Outer)
    return parser


def test_defaults_come_from_the_dataclass() -> None:
    args = _parser().parse_args([])
    assert given_flags(args, Outer) == {"inner": Inner()}
    assert from_flags(args, Outer) == Outer()
    assert not hasattr(args, "hidden")


def test_given_values_are_typed_and_parsed() -> None:
    args = _parser().parse_args(["-n", "5", "--ratio", "0.5", "--name", "x,y", "--width", "7"])
    assert from_flags(args, Outer, hidden="h") == Outer(5, 0.5, ("x", "y"), Inner(7), "h")
    with pytest.raises(SystemExit):
        _parser().parse_args(["--count", "five"])


def test_help_shows_the_field_help_and_default() -> None:
    text = _parser().format_help()
    assert "how many (default 2)" in text and "a ratio (default off)" in text
    assert "inner settings:" in text and "the width (default 3)" in text


def test_a_field_type_without_a_parser_is_refused() -> None:
    @dataclass
    class Bad:
        sizes: tuple[int, ...] = field(default=(1,), metadata=flag("sizes"))

    with pytest.raises(TypeError, match="Field 'sizes'"):
        add_flags(argparse.ArgumentParser(), Bad)


def test_train_flags_default_to_the_config() -> None:
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    assert config_from_args(parser.parse_args([]), "allreduce", 0, 4) == TrainConfig()
    args = parser.parse_args(["--steps", "7", "--layers", "2", "--powersgd-rank", "2", "--resync-every", "3"])
    config = config_from_args(args, "powersgd:5", 1, 4)
    assert (config.steps, config.model, config.powersgd_rank, config.seed) == (7, ModelConfig(layers=2), 5, 1)
    assert config.resync_every == 3  # the spec's parameter (5) won over --powersgd-rank 2, the rest is given
