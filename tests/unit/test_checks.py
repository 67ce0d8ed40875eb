"""cerar._checks: the shared argument checks name the argument and the value."""

from __future__ import annotations

import math

import pytest

from cerar._checks import check_bool, check_choice, check_float, check_int


def test_check_bool_takes_only_bools() -> None:
    assert check_bool("flag", True) is True and check_bool("flag", False) is False
    for bad in (0, 1, None, "yes"):
        with pytest.raises(TypeError, match=rf"Argument 'flag' must be a bool, not {bad!r}\."):
            check_bool("flag", bad)


def test_optional_lets_none_through_and_checks_the_rest() -> None:
    assert check_int("every", None, minimum=1, optional=True) is None
    assert check_float("tol", None, positive=True, optional=True) is None
    assert check_int("every", 3, minimum=1, optional=True) == 3
    with pytest.raises(ValueError, match=r"Argument 'every' must be at least 1, not 0\."):
        check_int("every", 0, minimum=1, optional=True)
    with pytest.raises(TypeError, match=r"Argument 'every' must be an integer, not None\."):
        check_int("every", None, minimum=1)
    with pytest.raises(ValueError, match=r"Argument 'tol' must be finite, not nan\."):
        check_float("tol", math.nan, optional=True)


def test_check_choice_lists_the_choices() -> None:
    with pytest.raises(ValueError, match=r"Argument 'policy' must be one of 'a', 'b', not 'c'\."):
        check_choice("policy", "c", ("a", "b"))
